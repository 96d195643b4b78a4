"""SHA-256 of local files, read into one reused buffer.

`f.read(1 MiB)` in a loop allocates a fresh 1 MiB bytes object per block, which glibc maps and
unmaps each time: on a VM those page faults cost more than the hashing. `readinto` a buffer that
lives for the whole file avoids them.
"""

from __future__ import annotations

import hashlib
import os

BLOCK = 1 << 20


def file_digest(path: str | os.PathLike[str]) -> tuple[int, str]:
    """(size in bytes, sha256 hex digest) of the file at `path`."""
    digest, size = hashlib.sha256(), 0
    buffer = bytearray(BLOCK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
            size += n
    return size, digest.hexdigest()


def file_sha256(path: str | os.PathLike[str]) -> str:
    return file_digest(path)[1]
