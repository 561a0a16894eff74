"""Ordered, bounded work in threads: for I/O and for C code that drops the GIL (Pillow's decode, resize, encode)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def ordered_map(fn: Callable[[T], R], items: Iterable[T], workers: int, depth: int | None = None) -> Iterator[R]:
    """fn over `items` in `workers` threads, results in input order; at most `depth` (default 2 x workers) in
    flight, so memory is a window, not the whole input (unlike Executor.map, which submits everything).
    `workers` <= 1 runs in the caller."""
    if workers <= 1:
        yield from map(fn, items)
        return
    depth = depth or 2 * workers
    with ThreadPoolExecutor(workers, thread_name_prefix="kiln-map") as pool:
        pending: deque[Future[R]] = deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= depth:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
