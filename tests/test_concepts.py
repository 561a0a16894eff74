"""Concept coverage: phrase search over captions with an SQL inverted index in DuckDB, counts per concept,
weights that raise rare concepts, and a report with a plot."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from assets.concepts import concept_hits, coverage, load_concepts, write_coverage
from kiln.config import ConceptConfig
from kiln.schemas import CONCEPT_COUNTS, CONCEPT_WEIGHTS
from kiln.stage import write_table

CAPTIONS = ["a red circle, on a blue background"] * 12 + ["two green squares", 'a sign with the word "STOP"', "a stop sign", "three circles"]


def pool() -> pa.Table:
    return pa.table({"id": [f"r{i:02d}" for i in range(len(CAPTIONS))], "caption": CAPTIONS, "ocr_text": ["STOP" if "STOP" in c else "" for c in CAPTIONS]})


def concepts() -> pa.Table:
    return pa.table({"concept": ["circle", "stop sign", "square", "blue background", "giraffe"], "rank": [1, 2, 3, 4, 5]})


def test_search_matches_phrases_in_order_and_plurals():
    hits = concept_hits(pool(), concepts(), ["caption", "ocr_text"]).to_pylist()
    by = {}
    for h in hits:
        by.setdefault(h["concept"], set()).add(h["id"])
    assert by["stop sign"] == {"r14"}  # 'a sign with the word "STOP"' has both words, not the phrase
    assert by["square"] == {"r12"}  # "squares" stems to square
    assert len(by["circle"]) == 13 and len(by["blue background"]) == 12
    assert "giraffe" not in by


def test_weights_raise_rare_concepts_and_cover_every_row():
    cov = coverage(pool(), concepts(), ConceptConfig(columns=["caption", "ocr_text"], alpha=1.0, max_weight=10))
    assert cov.counts.schema.equals(CONCEPT_COUNTS) and cov.weights.schema.equals(CONCEPT_WEIGHTS)
    assert cov.weights.num_rows == pool().num_rows  # nothing lost: every row gets a weight
    w = dict(zip(cov.weights.column("id").to_pylist(), cov.weights.column("sampling_weight").to_pylist()))
    assert sum(w.values()) / len(w) == 1.0 or abs(sum(w.values()) / len(w) - 1) < 1e-9
    assert w["r14"] > w["r00"] and w["r12"] > w["r00"]
    counts = {r["concept"]: r for r in cov.counts.to_pylist()}
    assert counts["stop sign"]["weighted_share"] > counts["stop sign"]["share"]
    assert counts["circle"]["weighted_share"] < counts["circle"]["share"]
    assert cov.report["uncovered"] == ["giraffe"] and cov.report["rare_boost"] > 1
    assert cov.report["fts_extension"].startswith(("loaded", "unavailable"))


def test_coverage_asset_is_written_from_csv_or_parquet_reproducibly(tmp_path):
    write_table(pool(), tmp_path / "pool" / "kept" / "part-00000.parquet")
    csv = tmp_path / "c.csv"
    csv.write_text("concept,rank\ncircle,1\nstop sign,2\n square ,3\nsquare,9\n,4\n")
    assert load_concepts(csv).to_pylist() == [{"concept": "circle", "rank": 1}, {"concept": "stop sign", "rank": 2}, {"concept": "square", "rank": 3}]
    pq.write_table(concepts(), tmp_path / "c.parquet")
    assert load_concepts(tmp_path / "c.parquet").num_rows == 5
    report = write_coverage(tmp_path / "pool", tmp_path / "a", ConceptConfig(path=str(csv)))
    write_coverage(tmp_path / "pool", tmp_path / "b", ConceptConfig(path=str(csv)))
    for f in ("counts.parquet", "weights.parquet", "report.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    assert json.loads((tmp_path / "a" / "report.json").read_text()) == report
    assert (tmp_path / "a" / "coverage.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
