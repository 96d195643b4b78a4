"""Errors a user can cause. Each message names the thing that is wrong and how to fix it."""


class OmniError(Exception):
    """Base class: the CLI prints these as one line and exits with code 2."""


class ConfigError(OmniError):
    """A pipeline file or override is missing, unreadable or invalid."""


class StorageError(OmniError):
    """The store cannot be reached, read or written."""


class DataError(OmniError):
    """A dataset source or its raw files cannot be used."""


class ModelError(OmniError):
    """A model URI cannot be resolved or loaded."""
