"""Sweeps: one pipeline file over many settings (docs/sweeps.md).

`spec` the sweep file; `space` the settings (Optuna's samplers); `plan` the sweep checked against its
pipeline (shared and per-variant stages, rungs, Ray capacity); `asha` the early-stopping rule;
`state` the records in the store; `controller` the variants' runs; `report` and `plots` the comparison;
`run` a whole sweep; `shared_ray` the one Ray the variants share. No Prefect here: flows/sweep.py runs it.
"""
