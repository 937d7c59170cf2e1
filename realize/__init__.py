"""metrale.realize."""
