"""Handing freed heap memory back to the OS.

glibc keeps what a process frees in its arenas for reuse: after a burst of large temporaries (a text
encoder's batches before training, a stage's model outputs) the resident size stays at the burst's peak
although nothing holds it. `malloc_trim(0)` returns the free pages of every arena.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def release_freed_memory() -> bool:
    """Return the heap's free pages to the OS (glibc); False where the C library has no malloc_trim."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
