"""Prefect tasks: thin wrappers (retries, names, artifacts) around omni_core calls."""
