"""Semantic dedup: near-parallel embeddings inside one leaf cluster collapse to one deterministic keeper."""

import numpy as np
import pyarrow as pa
import pytest

from assets.embed import to_column
from assets.semdedup import leaf_pairs, semdedup_rows
from kiln.config import load_config
from kiln.reasons import Reason
from kiln.schemas import DEDUPED
from kiln.stage import check_accounting, read_dataset, run_stage


def clustered(tmp_path, overrides, root):
    cfg = load_config([*overrides, f"data.clustering.review_db={tmp_path / 'r.duckdb'}"])
    run_stage("cluster", root / "embedded", tmp_path / "c", cfg)
    return read_dataset(tmp_path / "c" / "kept"), cfg


def test_pairs_are_found_only_inside_a_leaf():
    x = np.array([[1, 0], [1, 0.01], [1, 0.02], [0, 1]], np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    pairs, compared = leaf_pairs(x, np.array([0, 0, 1, 1]), 0.99)
    assert pairs.tolist() == [[0, 1]] and compared == 2  # row 2 is as close to 0 but sits in another leaf


def test_planted_semantic_duplicates_are_removed_with_keeper_and_cosine(demo_embedded, tmp_path):
    table, cfg = clustered(tmp_path, *demo_embedded)
    x = (
        np.frombuffer(b"".join(table.column("embedding").to_pylist()), "<f2")
        .reshape(table.num_rows, -1)
        .astype(np.float32)
    )
    # make row 1 a semantic copy of row 0 (same leaf, near-identical embedding) and shrink its pixels
    leaf = table.column("leaf").to_pylist()
    x[1] = x[0] + 1e-3
    leaf[1] = leaf[0]
    width = table.column("width").to_pylist()
    width[1] = 1
    t = table.set_column(
        table.schema.get_field_index("embedding"), pa.field("embedding", pa.binary(), nullable=False), to_column(x)
    )
    t = t.set_column(
        t.schema.get_field_index("leaf"), pa.field("leaf", pa.int32(), nullable=False), pa.array(leaf, pa.int32())
    )
    t = t.set_column(
        t.schema.get_field_index("width"), pa.field("width", pa.int32(), nullable=False), pa.array(width, pa.int32())
    )
    out = semdedup_rows(t, 0.9999)
    check_accounting("semdedup", t, out)
    rej = out.rejected.to_pylist()
    ids = t.column("id").to_pylist()
    assert [(r["id"], r["reason"], r["detail"]) for r in rej] == [(ids[1], Reason.SEMANTIC_DUPLICATE, ids[0])]
    assert rej[0]["value"] >= 0.9999
    assert out.kept.schema.equals(DEDUPED)  # the caption stage takes it as it is


def test_demo_semdedup_is_deterministic_and_feeds_caption(demo_embedded, tmp_path):
    overrides, root = demo_embedded
    cfg = load_config([*overrides, f"data.clustering.review_db={tmp_path / 'r.duckdb'}"])
    run_stage("cluster", root / "embedded", tmp_path / "c", cfg)
    a = run_stage("semdedup", tmp_path / "c", tmp_path / "s1", cfg)
    run_stage("semdedup", tmp_path / "c", tmp_path / "s2", cfg)
    assert (tmp_path / "s1/kept/part-00000.parquet").read_bytes() == (
        tmp_path / "s2/kept/part-00000.parquet"
    ).read_bytes()
    assert a.rejected < a.input_rows * 0.2  # the demo has no true semantic duplicates left after hash dedup
    cap = run_stage("caption", tmp_path / "s1", tmp_path / "cap", cfg)
    assert cap.input_rows == a.kept


@pytest.mark.parametrize("threshold,expect", [(1.0, 0), (-1.0, 2)])
def test_threshold_bounds(threshold, expect, demo_embedded, tmp_path):
    table, _ = clustered(tmp_path, *demo_embedded)
    leaf0 = table.filter(pa.compute.equal(table.column("leaf"), table.column("leaf")[0])).slice(0, 3)
    assert leaf0.num_rows == 3
    out = semdedup_rows(leaf0, threshold)
    assert out.rejected.num_rows == expect
