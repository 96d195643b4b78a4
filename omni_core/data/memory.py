"""Process memory settings for streaming work that allocates and frees large buffers in a loop.

Arrow's allocator (mimalloc) marks its arenas as eligible for transparent huge pages and hands freed
memory back to the kernel after 10 ms. An ingest frees a batch's buffers and allocates the next
batch's a few hundred milliseconds later, so every batch faults its memory in again, and with huge
pages each fault makes the kernel zero 2 MiB. Measured on this project's VM, that zeroing was ~40%
of an ingest's time (perf: clear_page_erms under do_huge_pmd_anonymous_page) and the ingest ran at
about half the speed it reaches with huge pages off. Turning them off for the duration keeps the
faults 4 KiB-sized; the previous setting is restored afterwards.

The allocator also keeps freed memory for reuse: at an ingest's peak, about as much again as the
batches in flight, and a varying amount (so the peak grew with the input's length).
`release_freed_memory`, called after each written batch, hands back what the calling thread's heap
holds; it lowered the peak and its spread in measurements, but memory freed into other threads'
heaps stays until they collect it.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pyarrow as pa

_PR_SET_THP_DISABLE = 41
_PR_GET_THP_DISABLE = 42


@contextmanager
def without_huge_pages() -> Iterator[None]:
    """Disable transparent huge pages for this process inside the block (Linux; elsewhere a no-op)."""
    if not sys.platform.startswith("linux"):
        yield
        return
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        previous = prctl(_PR_GET_THP_DISABLE, 0, 0, 0, 0)
    except (OSError, AttributeError):
        yield
        return
    changed = previous == 0 and prctl(_PR_SET_THP_DISABLE, 1, 0, 0, 0) == 0
    try:
        yield
    finally:
        if changed:
            prctl(_PR_SET_THP_DISABLE, 0, 0, 0, 0)


def release_freed_memory() -> None:
    """Return the memory Arrow's allocator holds freed (not in use) to the operating system."""
    pa.default_memory_pool().release_unused()
