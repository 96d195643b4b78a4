"""omni_core: the library behind the omni post-training platform (no Prefect imports here)."""

__version__ = "0.1.0"
