"""metrale.plan."""
