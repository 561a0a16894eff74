"""The cluster review table: where a person approves or rejects the clusters the cluster stage (assets.cluster)
flagged (through `kiln review`, kiln.cli.review). The table lives in DuckDB (`data.clustering.review_db`,
`cluster_review`); the stage writes flagged clusters into it and reads the decisions back on its next run.
A decision sticks to the cluster whose centroid it was made on (cosine >= CENTROID_MATCH); when re-clustering
moves a centroid, the cluster goes back to pending instead of silently inheriting a verdict about other images.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kiln.errors import UnknownName

if TYPE_CHECKING:
    from assets.cluster import ClusterInfo

CENTROID_MATCH = 0.99
DECISIONS = ("pending", "approve", "reject")


REVIEW_DDL = """
CREATE TABLE IF NOT EXISTS cluster_review (
    level INTEGER, cluster INTEGER, name VARCHAR, size INTEGER, cohesion DOUBLE, flag_reason VARCHAR,
    nearest_ids VARCHAR, centroid BLOB, decision VARCHAR DEFAULT 'pending', note VARCHAR DEFAULT '',
    PRIMARY KEY (level, cluster))
"""


def connect(db: Path | str):
    import duckdb

    Path(db).parent.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect(str(db))
    con.execute(REVIEW_DDL)
    return con


def sync_review(db: Path | str, clusters: list[ClusterInfo]) -> dict[int, tuple[str, str]]:
    """Upsert flagged clusters, keep decisions whose centroid still matches; return cluster -> (decision, name)
    for every cluster of the given level that has a live decision in the table."""
    con = connect(db)
    try:
        live: dict[int, tuple[str, str]] = {}
        for info in clusters:
            row = con.execute(
                "SELECT centroid, decision, note FROM cluster_review WHERE level = ? AND cluster = ?",
                [info.level, info.cluster],
            ).fetchone()
            same = False
            if row is not None and len(row[0]) == 4 * len(info.centroid):
                same = float(np.frombuffer(row[0], np.float32) @ info.centroid) >= CENTROID_MATCH
            if not info.flag_reason and not same:
                continue  # not flagged, nothing reviewed for it
            decision, note = (row[1], row[2]) if same else ("pending", "")
            con.execute(
                "INSERT OR REPLACE INTO cluster_review VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    info.level,
                    info.cluster,
                    info.name,
                    info.size,
                    info.cohesion,
                    info.flag_reason or "reviewed",
                    json.dumps(info.nearest),
                    info.centroid.astype(np.float32).tobytes(),
                    decision,
                    note,
                ],
            )
            live[info.cluster] = (decision, info.name)
        return live
    finally:
        con.close()


def set_decision(db: Path | str, level: int, cluster: int, decision: str, note: str = "") -> None:
    if decision not in DECISIONS:
        raise ValueError(f"decision must be one of {DECISIONS}, got {decision!r}")
    con = connect(db)
    try:
        n = con.execute(
            "SELECT count(*) FROM cluster_review WHERE level = ? AND cluster = ?", [level, cluster]
        ).fetchone()[0]
        if not n:
            raise UnknownName(f"no cluster {level}:{cluster} in the review table {db}; `kiln review list` shows them")
        con.execute(
            "UPDATE cluster_review SET decision = ?, note = ? WHERE level = ? AND cluster = ?",
            [decision, note, level, cluster],
        )
    finally:
        con.close()


def review_rows(db: Path | str) -> list[dict]:
    con = connect(db)
    try:
        cur = con.execute(
            "SELECT level, cluster, name, size, cohesion, flag_reason, decision, note FROM cluster_review ORDER BY level, cluster"
        )
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, r)) for r in cur.fetchall()]
    finally:
        con.close()
