"""The C heap keeps the large blocks a frame frees, for the next frame.

glibc serves a block above its mmap threshold (128 KiB at start, raised on its own to the
largest block freed so far, never past 32 MiB) with fresh pages from the OS and unmaps them on
free. A batched step allocates and frees the same large temporaries every frame (several
sessions' rings, read for attention), so without this every step faults those pages in again:
at 8 sessions of the shipped world about 8,000 minor page faults a step and a slower step
(``python -m scripts.bench_heap`` runs both heaps; docs/results.md, The heap). Set once per
process, at the app's start, like the thread count.
"""
from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
HEAP_BLOCK_BYTES = 256 << 20  # blocks below this come from the heap and go back to it
TRIM_BYTES = 1 << 30  # free memory the heap keeps before it gives any back to the OS


def user_tuned_malloc() -> bool:
    """Whether the environment tunes glibc's malloc itself (then its choice stands)."""
    return any(k.startswith("MALLOC_") for k in os.environ) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")


def keep_freed_memory() -> bool:
    """On Linux with glibc, unless the environment tunes malloc: large blocks come from the heap
    and freed memory stays there. True when set."""
    if not sys.platform.startswith("linux") or user_tuned_malloc():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, HEAP_BLOCK_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_BYTES))
