"""SHA-256 of local files, read into one reused buffer.

`f.read(1 MiB)` in a loop allocates a fresh 1 MiB bytes object per block, which glibc maps and
unmaps each time: on a VM those page faults cost more than the hashing. `readinto` a buffer that
lives for the whole file avoids them.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable

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


class AppendDigest:
    """SHA-256 of a file that another writer is appending to, hashed as it grows.

    `update()` hashes the bytes appended since the last call (read back from the page cache while
    they are still hot, with no copy through the writer); `finish()` hashes the rest and returns
    (size, hex digest). Only for append-only writers, such as a Parquet writer: bytes already
    hashed must never be rewritten.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self._fd = os.open(path, os.O_RDONLY)
        self._digest = hashlib.sha256()
        self._size = 0
        self._buffer = bytearray(BLOCK)
        self._view = memoryview(self._buffer)

    def update(self) -> None:
        while n := os.preadv(self._fd, [self._buffer], self._size):
            self._digest.update(self._view[:n])
            self._size += n

    def finish(self) -> tuple[int, str]:
        self.update()
        self.close()
        return self._size, self._digest.hexdigest()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def file_list_sha256(files: Iterable[tuple[str, str]]) -> str:
    """One digest of a list of files: sha256 over the UTF-8 lines `PATH<TAB>SHA256<LF>`, sorted (as
    `LC_ALL=C sort` sorts them), of the (path, sha256 hex) pairs. The same files give the same digest
    in any order; a file renamed, added, dropped or changed changes it. From a dataset manifest:
    `jq -r '.raw_files[] | "\\(.path)\\t\\(.sha256)"' _manifest.json | LC_ALL=C sort | sha256sum`."""
    digest = hashlib.sha256()
    for line in sorted(f"{path}\t{sha256}\n" for path, sha256 in files):
        digest.update(line.encode())
    return digest.hexdigest()
