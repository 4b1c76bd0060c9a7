"""slurm_plugin package."""
