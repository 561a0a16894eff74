"""Freed heap memory goes back to the OS when asked: glibc otherwise keeps it resident (a process that
encoded thousands of captions before training would carry the encoder's temporaries through every step)."""

import sys

import pytest

from kiln.memory import release_freed_memory


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 1e6


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_small_blocks_below_a_live_one_are_returned():
    blocks = [bytes(bytearray(64 * 1024)) for _ in range(3000)]  # about 200 MB of heap, below the mmap threshold
    pin = bytes(bytearray(64 * 1024))  # the heap's top stays in use, so free() alone cannot shrink the heap
    del blocks
    before = _rss_mb()
    assert release_freed_memory()
    assert before - _rss_mb() > 100
    del pin
