"""kiln dagster_project."""
