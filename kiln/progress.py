"""Progress bars and logging that stay quiet in CI logs and honest in terminals."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")

log = logging.getLogger("kiln")


def setup_logging(level: str | int = "INFO") -> None:
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def progress(it: Iterable[T], desc: str, total: int | None = None, unit: str = "it") -> Iterator[T]:
    """A tqdm bar on stderr; disabled with KILN_PROGRESS=0 (tests), when stderr is not a TTY and CI is set,
    and on every rank but 0 of a distributed job."""
    disable = os.environ.get("KILN_PROGRESS", "1") == "0" or (os.environ.get("CI") and not sys.stderr.isatty())
    disable = disable or os.environ.get("RANK", "0") != "0"  # one bar per job, not one per rank
    yield from tqdm(it, desc=desc, total=total, unit=unit, disable=bool(disable), leave=False, dynamic_ncols=True)
