"""DuckDB helpers: reproducible connections, and quoting for the names and paths spliced into SQL."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import duckdb


def reproducible_connection(database: str = ":memory:") -> duckdb.DuckDBPyConnection:
    """One thread, so float aggregates (sum, avg) add in one order and the bytes written are the same every run.

    With DuckDB's default thread pool a parallel ``sum`` of doubles can differ in the last bit between
    runs, which breaks a ``dvc.lock`` hash; the stages using this are aggregation over a pool's metadata,
    small next to the image work, so one thread costs little.
    """
    return duckdb.connect(database, config={"threads": 1})


def quote_literal(value: str | Path) -> str:
    """A SQL string literal: `'` doubled. For the places DuckDB takes no bound parameter (a view's definition)."""
    return "'" + str(value).replace("'", "''") + "'"


def quote_identifier(name: str) -> str:
    """A SQL identifier (table, view, column): `"` doubled."""
    return '"' + name.replace('"', '""') + '"'


def read_parquet(paths: Iterable[str | Path], **options: bool) -> str:
    """`read_parquet([...])` over these exact files, each path quoted, no glob: a `'`, `*`, `?` or `[` in a
    folder name is just a character. Options are DuckDB's boolean ones (`filename=True`)."""
    files = ", ".join(quote_literal(p) for p in paths)
    extra = "".join(f", {k}={'true' if v else 'false'}" for k, v in options.items())
    return f"read_parquet([{files}]{extra})"
