"""kiln assets."""
