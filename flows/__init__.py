"""Prefect flows and the `omni` CLI: compose tasks, nothing else."""
