"""kiln training."""
