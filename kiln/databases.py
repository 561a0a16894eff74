"""Where kiln keeps state in a database, and how it connects: the warehouse queue (kiln.warehouse) and the
human-label store (training.post.labels) both open Postgres here, and both create their tables under one
advisory lock; without a server, their DuckDB files live under the embedded warehouse root."""

from __future__ import annotations

from pathlib import Path

from kiln.paths import artifact

DDL_LOCK = (
    7_345_001  # advisory lock key: one process at a time creates kiln's tables (CREATE IF NOT EXISTS races otherwise)
)


def connect(dsn: str, name: str = "kiln"):
    """Autocommit, so that every unit of work is an explicit `conn.transaction()`; `name` shows in pg_stat_activity."""
    import psycopg

    return psycopg.connect(dsn, autocommit=True, application_name=name[:63])


def embedded_root() -> Path:
    """The folder of the embedded (DuckDB) warehouse and label store: data/warehouse."""
    return artifact("warehouse")
