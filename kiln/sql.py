"""DuckDB connections for stages whose outputs are pinned byte-for-byte (DVC, reproducibility tests)."""
from __future__ import annotations

import duckdb


def reproducible_connection(database: str = ":memory:") -> duckdb.DuckDBPyConnection:
    """One thread, so float aggregates (sum, avg) add in one order and the bytes written are the same every run.

    With DuckDB's default thread pool a parallel ``sum`` of doubles can differ in the last bit between
    runs, which breaks a ``dvc.lock`` hash; the stages using this are aggregation over a pool's metadata,
    small next to the image work, so one thread costs little.
    """
    return duckdb.connect(database, config={"threads": 1})
