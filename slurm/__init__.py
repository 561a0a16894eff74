"""kiln slurm."""
