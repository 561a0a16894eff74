"""kiln model."""
