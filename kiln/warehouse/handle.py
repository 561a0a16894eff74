"""What a running map looks like from outside: counts, a rate, and a wait with a live bar.

Both warehouse paths (Postgres, embedded) give the same `Progress`, so a notebook, the CLI or a test
watches a job the same way whichever path runs it, from the process that started it or another one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kiln.progress import progress as progress_bar_over


@dataclass(frozen=True)
class Progress:
    total: int  # rows in the job
    kept: int
    rejected: int
    failed: int  # no result yet, last attempt raised (being retried, or out of attempts)
    pending: int  # no result yet and still claimable (attempts left)
    rate: float  # rows completed per second, over the last few seconds

    @property
    def done(self) -> int:
        return self.kept + self.rejected

    @property
    def remaining(self) -> int:
        return self.total - self.done


def wait_until(
    poll: Callable[[], Progress],
    finished: Callable[[Progress], bool],
    desc: str,
    progress_bar: bool = True,
    poll_s: float = 0.25,
    timeout: float | None = None,
) -> Progress:
    """Poll until `finished`; with a bar, one tick per completed row (kiln.progress's tqdm)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    state = {"last": poll()}

    def ticks() -> Iterator[None]:
        seen = 0
        while True:
            last = state["last"]
            yield from (None for _ in range(max(last.done - seen, 0)))
            seen = max(seen, last.done)
            if finished(last):
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{desc}: not finished after {timeout}s: {last}")
            time.sleep(poll_s)
            state["last"] = poll()

    if progress_bar:
        for _ in progress_bar_over(ticks(), desc=desc, total=state["last"].total, unit="row"):
            pass
    else:
        for _ in ticks():
            pass
    return state["last"]
