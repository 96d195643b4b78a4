"""The built-in training algorithms: one module each that defines its options model and trainer
factory and registers its record (omni_core.config.algorithms: the table, the record and the
options base, re-exported here). The platform loads this package as a built-in plugin
(omni_core.plugins) before the table is read; another package adds an algorithm the same way through
the `omni_core.plugins` entry point group (docs/concepts/plugins.md).

This package imports pydantic only (trainers are imported by the factories when a stage runs), so
loading it costs no torch or Ray.
"""

from __future__ import annotations

from omni_core.config.algorithms import (
    ALL,
    DIFFUSION_MODEL,
    DIFFUSION_PROMPTS,
    LANGUAGE_MODEL,
    PAIRS,
    PROMPTS,
    SET_ELSEWHERE,
    SUPERVISED,
    Algorithm,
    AlgorithmOptions,
    algorithm_names,
    algorithm_records,
    get_algorithm,
    parse_options,
    register_algorithm,
)

__all__ = ["ALL", "DIFFUSION_MODEL", "DIFFUSION_PROMPTS", "LANGUAGE_MODEL", "PAIRS", "PROMPTS", "SET_ELSEWHERE",
           "SUPERVISED", "Algorithm", "AlgorithmOptions", "algorithm_names", "algorithm_records", "get_algorithm",
           "parse_options", "register_algorithm"]

from omni_core.training.algorithms import flow_grpo, grpo, preference, sft  # noqa: E402,F401  (register them)
