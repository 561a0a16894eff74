"""Human preference labels: one store over embedded DuckDB and Postgres, and their export as human pairs.

The annotation page (training/post/annotate.py) shows each candidate pair of a pairs table (training/post/pairs.py)
with its two images in an order fixed by a hash of the pair id, so a winner that always sits on one side
cannot teach the annotator a habit. A label records the key pressed (left / right / tie), which image of the
on-policy pair was shown left, and so which one was picked (winner / loser / tie). Labels are keyed by the
sha256 of the pairs file: pair ids of another sampling run never mix with these. One label per
(pairs file, pair, annotator); labelling a pair again replaces that annotator's earlier label.

`human_pairs` turns the labels of a pairs table into a pairs table with `source = "human"`: per pair the
annotators' picks vote, the image with more votes is the winner; pairs with only ties, or an even split,
are dropped and counted, as are the pairs nobody labelled. `dpo(..., source="human")` calibrates on it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from training.post.pairs import PAIRS, PAIRS_FILE, read_pairs

CHOICES = ("left", "right", "tie")
TABLE = "human_labels"
DB_FILE = "human_labels.duckdb"  # under the embedded warehouse root
MAX_ANNOTATOR = 64
DDL = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    pairs_sha256 VARCHAR NOT NULL, pair_id VARCHAR NOT NULL, annotator VARCHAR NOT NULL,
    choice VARCHAR NOT NULL, shown_left VARCHAR NOT NULL, picked VARCHAR NOT NULL,
    pairs_dir VARCHAR NOT NULL, labelled_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (pairs_sha256, pair_id, annotator))
"""
COLUMNS = ("pairs_sha256", "pair_id", "annotator", "choice", "shown_left", "picked", "pairs_dir", "labelled_at")
UPSERT = (
    f"INSERT INTO {TABLE} ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))}) "
    "ON CONFLICT (pairs_sha256, pair_id, annotator) DO UPDATE SET choice = excluded.choice, shown_left = excluded.shown_left, "
    "picked = excluded.picked, pairs_dir = excluded.pairs_dir, labelled_at = excluded.labelled_at"
)
SELECT = f"SELECT {', '.join(COLUMNS)} FROM {TABLE} WHERE pairs_sha256 = ? ORDER BY pair_id, annotator"


# ------------------------------------------------------------------------------------------- sides
def left_is_winner(pair_id: str) -> bool:
    """Whether the page shows the pair's winner on the left: a hash of the pair id, the same on every visit."""
    return hashlib.sha256(f"kiln-annotate:{pair_id}".encode()).digest()[0] < 128


def picked(pair_id: str, choice: str) -> str:
    """The image of the on-policy pair a key picked: "winner", "loser", or "tie"."""
    if choice not in CHOICES:
        raise ValueError(f"a label is one of {CHOICES}, got {choice!r}")
    if choice == "tie":
        return "tie"
    return "winner" if (choice == "left") == left_is_winner(pair_id) else "loser"


def pairs_sha256(folder: Path) -> str:
    from kiln.outputs import sha256_file

    return sha256_file(Path(folder) / PAIRS_FILE)


@dataclass(frozen=True)
class Label:
    pairs_sha256: str
    pair_id: str
    annotator: str
    choice: str  # the key: left / right / tie
    shown_left: str  # the image shown left: winner / loser
    picked: str  # winner / loser / tie
    pairs_dir: str  # where the pairs table was, for people reading the table
    labelled_at: datetime


def make_label(sha256: str, pairs_dir: Path | str, pair_id: str, annotator: str, choice: str) -> Label:
    annotator = annotator.strip()
    if not annotator or len(annotator) > MAX_ANNOTATOR:
        raise ValueError(f"an annotator name is 1 to {MAX_ANNOTATOR} characters, got {annotator!r}")
    return Label(sha256, pair_id, annotator, choice, "winner" if left_is_winner(pair_id) else "loser", picked(pair_id, choice),
                 str(pairs_dir), datetime.now(UTC))  # fmt: skip


# ------------------------------------------------------------------------------------------- store
class LabelStore:
    """The label table, in a DuckDB file or in Postgres; each call opens and closes its own connection, so
    `kiln annotate --export` can read a DuckDB file while the page is not writing it."""

    where: str

    def add(self, label: Label) -> None:
        self._run(UPSERT, [getattr(label, c) for c in COLUMNS])

    def labels(self, sha256: str) -> list[Label]:
        return [Label(*row) for row in self._run(SELECT, [sha256], fetch=True)]

    def _run(self, sql: str, params: list, fetch: bool = False) -> list[tuple]:
        raise NotImplementedError


class DuckDBLabels(LabelStore):
    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.where = str(self.path)

    def _run(self, sql: str, params: list, fetch: bool = False) -> list[tuple]:
        import duckdb

        self.path.parent.mkdir(parents=True, exist_ok=True)
        with duckdb.connect(str(self.path)) as con:
            con.execute(DDL)
            cur = con.execute(sql, params)
            return cur.fetchall() if fetch else []


class PostgresLabels(LabelStore):
    def __init__(self, dsn: str):
        from kiln.databases import DDL_LOCK, connect

        self.dsn = dsn
        self.where = "Postgres " + dsn.rsplit("@", 1)[-1]  # host/db only: no password in logs
        with connect(dsn, "kiln-annotate") as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", [DDL_LOCK])  # CREATE IF NOT EXISTS races otherwise
            conn.execute(DDL)

    def _run(self, sql: str, params: list, fetch: bool = False) -> list[tuple]:
        from kiln.databases import connect

        with connect(self.dsn, "kiln-annotate") as conn:
            cur = conn.execute(sql.replace("?", "%s"), params)  # our constant SQL: no '?' in a literal
            return cur.fetchall() if fetch else []


def open_labels(dsn: str | None = None, db: Path | str | None = None) -> LabelStore:
    """The label store: `db` (a DuckDB file) when given; else Postgres at `dsn` or KILN_PG_DSN; else the
    DuckDB file under the embedded warehouse root."""
    if db is not None and dsn is not None:
        raise ValueError("labels go to a DuckDB file or to Postgres, not both: give db or dsn")
    if db is not None:
        return DuckDBLabels(db)
    dsn = dsn or os.environ.get("KILN_PG_DSN")
    if dsn:
        return PostgresLabels(dsn)
    from kiln.databases import embedded_root

    return DuckDBLabels(embedded_root() / DB_FILE)


# ------------------------------------------------------------------------------------------ export
def vote(picks: list[str]) -> str:
    """One pair's verdict from its annotators' picks: "winner", "loser", or "tie" (only ties, or an even split)."""
    n = Counter(picks)
    return "winner" if n["winner"] > n["loser"] else "loser" if n["loser"] > n["winner"] else "tie"


def human_pairs(pairs_dir: Path, store: LabelStore, out: Path, overwrite: bool = False) -> dict:
    """OUT/pairs.parquet: the labelled pairs of `pairs_dir` with the human's pick as the winner and
    `source = "human"`; returns (and writes to OUT/pairs.json) what became of every candidate pair."""
    from kiln.outputs import check_output, staged_output, write_marker

    pairs_dir, out = Path(pairs_dir), Path(out)
    check_output(out, pairs_dir, overwrite)
    table = read_pairs(pairs_dir)
    sha = pairs_sha256(pairs_dir)
    labels = store.labels(sha)
    picks: dict[str, list[str]] = {}
    for lab in labels:
        picks.setdefault(lab.pair_id, []).append(lab.picked)
    rows = table.to_pylist()
    known = {r["pair_id"] for r in rows}
    verdicts = {pid: vote(p) for pid, p in picks.items() if pid in known}
    swap = {
        "winner_png": "loser_png",
        "winner_reward": "loser_reward",
        "winner_rewards": "loser_rewards",
        "winner_index": "loser_index",
    }
    swap |= {v: k for k, v in swap.items()}
    kept = []
    for r in rows:
        verdict = verdicts.get(r["pair_id"], "tie")
        if verdict == "tie":
            continue
        if verdict == "loser":  # the human picked the image the rewards ranked lower
            r = r | {k: r[swap[k]] for k in swap}
        kept.append(r | {"source": "human"})
    decided = Counter(verdicts.values())
    report = {"pairs_in": table.num_rows, "pairs_sha256": sha, "labels": len(labels), "annotators": len({lab.annotator for lab in labels}),
              "pairs": len(kept), "agree_with_rewards": decided["winner"], "flipped": decided["loser"],
              "ties": sum(1 for pid, v in verdicts.items() if v == "tie" and set(picks[pid]) == {"tie"}),
              "split": sum(1 for pid, v in verdicts.items() if v == "tie" and set(picks[pid]) != {"tie"}),
              "unlabelled": table.num_rows - len(verdicts), "labels_of_unknown_pairs": sum(1 for lab in labels if lab.pair_id not in known),
              "from": str(pairs_dir), "store": store.where}  # fmt: skip
    with staged_output(out) as tmp:
        pq.write_table(pa.Table.from_pylist(kept, schema=PAIRS), tmp / PAIRS_FILE)
        (tmp / "pairs.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
        write_marker(tmp, "human_pairs")
    return report
