"""URI-addressed object store (local path, file://, s3://) with atomic writes and digests."""

from omni_core.storage.store import ObjectNotFoundError, Store, open_store

__all__ = ["ObjectNotFoundError", "Store", "open_store"]
