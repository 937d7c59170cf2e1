"""metrale.runtime."""
