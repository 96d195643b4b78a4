"""Datasets: raw sources, fixture generators, one converter per dataset, versioned ingestion."""

# Each dataset module registers its converter and fixture generator.
from omni_core.data import avqa, digits, gsm8k, image_edit, mmk12, ocr, omni_preference, prompts  # noqa: F401
from omni_core.data.converter import (
    Converter,
    RowRejected,
    get_converter,
    holds_preference_pairs,
    preference_converters,
    register_converter,
)
from omni_core.data.fixtures import fixture_names, write_fixture
from omni_core.data.ingest import DatasetVersion, ingest, load_version
from omni_core.data.sources import RawSource, resolve_source

__all__ = ["Converter", "DatasetVersion", "RawSource", "RowRejected", "fixture_names", "get_converter",
           "holds_preference_pairs", "ingest", "load_version", "preference_converters", "register_converter",
           "resolve_source", "write_fixture"]

