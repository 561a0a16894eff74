"""Concept coverage: phrase search over captions with an SQL inverted index in DuckDB, counts per concept,
weights that raise rare concepts, and a report with a plot."""

from __future__ import annotations

import json
import re
import statistics

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from assets.concepts import concept_hits, coverage, load_concepts, write_coverage
from kiln.config import ConceptConfig
from kiln.schemas import CONCEPT_COUNTS, CONCEPT_WEIGHTS
from kiln.stage import write_table

CAPTIONS = ["a red circle, on a blue background"] * 12 + [
    "two green squares",
    'a sign with the word "STOP"',
    "a stop sign",
    "three circles",
]


def pool() -> pa.Table:
    return pa.table(
        {
            "id": [f"r{i:02d}" for i in range(len(CAPTIONS))],
            "caption": CAPTIONS,
            "ocr_text": ["STOP" if "STOP" in c else "" for c in CAPTIONS],
        }
    )


def concepts() -> pa.Table:
    return pa.table(
        {"concept": ["circle", "stop sign", "square", "blue background", "giraffe"], "rank": [1, 2, 3, 4, 5]}
    )


def terms(text: str) -> list[str]:
    """The documented tokenisation, written again here: lower-case alphanumeric runs, a trailing plural "s"
    dropped from words of more than three letters that do not end in "ss"."""
    words = [t for t in re.split("[^a-z0-9]+", text.lower()) if t]
    return [t[:-1] if len(t) > 3 and t.endswith("s") and not t.endswith("ss") else t for t in words]


def expected_hits(pool: pa.Table, concepts: pa.Table) -> dict[str, set[str]]:
    """concept -> ids of the rows where the concept's terms sit at consecutive positions of caption + ocr_text."""
    out: dict[str, set[str]] = {}
    for row in pool.to_pylist():
        text = terms(" ".join([row["caption"], row["ocr_text"]]))
        for concept in concepts.column("concept").to_pylist():
            want = terms(concept)
            if any(text[k : k + len(want)] == want for k in range(len(text) - len(want) + 1)):
                out.setdefault(concept, set()).add(row["id"])
    return out


def expected_weights(ids: list[str], hits: dict[str, set[str]], alpha: float, max_weight: float) -> dict[str, float]:
    """The documented weight: (median count over covered concepts / count of the row's rarest concept) ** alpha,
    capped at max_weight, 1 for a row with no concept, then normalised to mean 1."""
    median = statistics.median(len(rows) for rows in hits.values())
    raw = {}
    for i in ids:
        counts = [len(rows) for rows in hits.values() if i in rows]
        raw[i] = min(max_weight, (median / min(counts)) ** alpha) if counts else 1.0
    mean = sum(raw.values()) / len(raw)
    return {i: w / mean for i, w in raw.items()}


def test_search_matches_phrases_in_order_and_plurals():
    hits = concept_hits(pool(), concepts(), ["caption", "ocr_text"]).to_pylist()
    by = {}
    for h in hits:
        by.setdefault(h["concept"], set()).add(h["id"])
    assert by == expected_hits(pool(), concepts())
    assert by["stop sign"] == {"r14"}  # 'a sign with the word "STOP"' has both words, not the phrase
    assert by["square"] == {"r12"}  # "squares" stems to square
    assert "giraffe" not in by


@pytest.mark.parametrize("alpha, max_weight", [(1.0, 10.0), (0.5, 10.0), (1.0, 2.0)])  # the last caps the rare rows
def test_weights_follow_the_documented_formula_and_raise_rare_concepts(alpha, max_weight):
    cov = coverage(
        pool(), concepts(), ConceptConfig(columns=["caption", "ocr_text"], alpha=alpha, max_weight=max_weight)
    )
    assert cov.counts.schema.equals(CONCEPT_COUNTS) and cov.weights.schema.equals(CONCEPT_WEIGHTS)
    assert cov.weights.num_rows == pool().num_rows  # nothing lost: every row gets a weight
    hits = expected_hits(pool(), concepts())
    want = expected_weights(pool().column("id").to_pylist(), hits, alpha, max_weight)
    w = dict(zip(cov.weights.column("id").to_pylist(), cov.weights.column("sampling_weight").to_pylist()))
    assert w == pytest.approx(want, rel=1e-9)
    n = pool().num_rows
    for r in cov.counts.to_pylist():
        rows = hits.get(r["concept"], set())
        assert (r["rows"], r["share"]) == (len(rows), pytest.approx(len(rows) / n))
        assert r["weighted_share"] == pytest.approx(sum(want[i] for i in rows) / n)
    counts = {r["concept"]: r for r in cov.counts.to_pylist()}
    assert w["r14"] > w["r00"] and w["r12"] > w["r00"]
    assert counts["stop sign"]["weighted_share"] > counts["stop sign"]["share"]
    assert counts["circle"]["weighted_share"] < counts["circle"]["share"]
    assert cov.report["uncovered"] == ["giraffe"] and cov.report["rare_boost"] > 1


def test_the_report_says_whether_duckdb_full_text_search_loaded():
    try:  # asked of DuckDB directly: offline the extension cannot be installed
        duckdb.connect().execute("LOAD fts")
        here = "loaded"
    except duckdb.Error:
        here = "unavailable"
    fts = coverage(pool(), concepts(), ConceptConfig(columns=["caption"])).report["fts_extension"]
    assert fts.split(":")[0] == here and (here == "loaded" or len(fts) > len("unavailable: "))


def test_coverage_asset_is_written_from_csv_or_parquet_reproducibly(tmp_path):
    write_table(pool(), tmp_path / "pool" / "kept" / "part-00000.parquet")
    csv = tmp_path / "c.csv"
    csv.write_text("concept,rank\ncircle,1\nstop sign,2\n square ,3\nsquare,9\n,4\n")
    assert load_concepts(csv).to_pylist() == [
        {"concept": "circle", "rank": 1},
        {"concept": "stop sign", "rank": 2},
        {"concept": "square", "rank": 3},
    ]
    pq.write_table(concepts(), tmp_path / "c.parquet")
    assert load_concepts(tmp_path / "c.parquet").num_rows == 5
    report = write_coverage(tmp_path / "pool", tmp_path / "a", ConceptConfig(path=str(csv)))
    write_coverage(tmp_path / "pool", tmp_path / "b", ConceptConfig(path=str(csv)))
    for f in ("counts.parquet", "weights.parquet", "report.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    assert json.loads((tmp_path / "a" / "report.json").read_text()) == report
    assert (tmp_path / "a" / "coverage.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
