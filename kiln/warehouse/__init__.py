"""The warehouse and work queue: a stage over rows on Postgres (1 to 1000 workers) or embedded (Parquet + DuckDB).

    handle = kiln.warehouse.map(stage, rows, dsn=None, workers=4)   # returns at once
    handle.progress()        # done / failed / remaining / rate
    handle.wait()            # live tqdm bar
    kiln.warehouse.attach("filter", dsn=dsn).progress()            # from any other process
    kiln.warehouse.run_worker(dsn, "filter", "images", 256)        # one worker, e.g. a Slurm array task

Names are imported on first use, so that a worker process (which needs only kiln.warehouse.worker)
starts without DuckDB and the embedded path. See docs/warehouse.md.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "map": "kiln.warehouse.api",
    "attach": "kiln.warehouse.api",
    "PostgresHandle": "kiln.warehouse.api",
    "EmbeddedHandle": "kiln.warehouse.embedded",
    "Progress": "kiln.warehouse.handle",
    "run_worker": "kiln.warehouse.worker",
    "WorkerReport": "kiln.warehouse.worker",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kiln.warehouse' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
