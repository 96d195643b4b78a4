"""Evaluation of every model the platform trains, run where the model fits (a Ray task with the eval
stage's resources): language models (`text`), text-to-image diffusion models (`images`) and preference
models on held-out pairs (`pairs`); `job` holds the plain-data job, the Ray submission and the baseline
cache. The eval stage (omni_core.pipeline.stages.eval) builds the job and logs the result."""
