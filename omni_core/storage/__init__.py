"""URI-addressed object store (local path, file://, s3://) with atomic writes and digests."""

from omni_core.storage.digest import file_digest, file_sha256
from omni_core.storage.store import ObjectNotFoundError, Store, open_store, settle_pointer

__all__ = ["ObjectNotFoundError", "Store", "file_digest", "file_sha256", "open_store", "settle_pointer"]
