"""Dataset mixes: DuckDB queries over the warehouse that come out in the configured proportions, with
their SQL and proportions recorded, and the same bytes on every run."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from assets.mixes import build_mixes, quotas, write_mixes
from kiln.config import MixConfig, MixPart
from kiln.stage import write_table


def pool(n: int = 200) -> pa.Table:
    """A warehouse-like pool: 25% text-bearing rows, two source folders, a quality measure."""
    return pa.table(
        {
            "id": [f"{i:04d}" for i in range(n)],
            "uri": [f"raw/images/{'00' if i % 3 else '01'}/{i}.png" for i in range(n)],
            "contains_text": [i % 4 == 0 for i in range(n)],
            "caption": ["a striped thing" if i % 5 == 0 else "a circle" for i in range(n)],
            "laplacian_var": [float((i * 37) % 101) for i in range(n)],
        }
    )


CFG = MixConfig(
    midtrain_size=50,
    midtrain=[
        MixPart(name="text", where="contains_text", share=0.4),
        MixPart(name="stripes", where="caption LIKE '%striped%'", share=0.2),
        MixPart(name="rest", where="true", share=0.4),
    ],
    sft_size=10,
)


def test_quotas_follow_shares_and_sum_to_the_size():
    assert quotas([("a", 0.5), ("b", 0.3), ("c", 0.2)], 7) == {"a": 4, "b": 2, "c": 1}
    assert sum(quotas([("a", 1 / 3), ("b", 1 / 3), ("c", 1 / 3)], 100).values()) == 100
    with pytest.raises(ValueError, match="sum to"):
        quotas([("a", 0.5)], 10)


def test_mixes_come_out_in_the_configured_proportions():
    mixes = build_mixes(pool(), CFG)
    pre, pre_info = mixes["pretrain"]
    assert pre.num_rows == 200 and pre_info["built"] == "bottom-up"  # the whole pool
    assert pre_info["proportions"] == {"00": {"rows": 133, "share": 133 / 200}, "01": {"rows": 67, "share": 67 / 200}}
    mid, mid_info = mixes["midtrain"]
    assert mid.num_rows == 50 and len(set(mid.column("id").to_pylist())) == 50
    for name, share in (("text", 0.4), ("stripes", 0.2), ("rest", 0.4)):
        assert mid_info["proportions"][name]["share"] == share and not mid_info["proportions"][name]["short"]
    ids = set(mid.column("id").to_pylist())
    text_ids = {r["id"] for r in pool().to_pylist() if r["contains_text"]}
    assert len(ids & text_ids) >= 20  # the text part's rows are text rows
    sft, _ = mixes["sft"]
    best = sorted(pool().to_pylist(), key=lambda r: -r["laplacian_var"])[:10]
    assert sft.num_rows == 10 and set(sft.column("id").to_pylist()) <= {
        r["id"] for r in pool().to_pylist() if r["laplacian_var"] >= best[-1]["laplacian_var"]
    }


def test_a_part_with_too_few_rows_is_recorded_short_and_weights_travel_along():
    cfg = CFG.model_copy(
        update={
            "midtrain": [
                MixPart(name="text", where="contains_text AND laplacian_var > 95", share=0.5),
                MixPart(name="rest", where="true", share=0.5),
            ]
        }
    )
    weights = pa.table({"id": ["0000", "0004"], "sampling_weight": [3.0, 0.5]})
    mixes = build_mixes(pool(), cfg, weights)
    props = mixes["midtrain"][1]["proportions"]
    assert props["text"]["short"] and props["text"]["rows"] < props["text"]["quota"] == 25
    w = dict(
        zip(mixes["pretrain"][0].column("id").to_pylist(), mixes["pretrain"][0].column("sampling_weight").to_pylist())
    )
    assert (w["0000"], w["0004"], w["0001"]) == (3.0, 0.5, 1.0)


def test_written_mixes_carry_their_sql_and_reproduce_byte_for_byte(tmp_path):
    write_table(pool(), tmp_path / "pool" / "kept" / "part-00000.parquet")
    meta = write_mixes(tmp_path / "pool", tmp_path / "a", CFG)
    write_mixes(tmp_path / "pool", tmp_path / "b", CFG)
    for mix in ("pretrain", "midtrain", "sft"):
        a, b = (tmp_path / x / mix / "part-00000.parquet" for x in "ab")
        assert a.read_bytes() == b.read_bytes()
        stored = json.loads(pq.read_schema(a).metadata[b"kiln.mix"])
        assert stored == meta[mix] and "FROM warehouse" in stored["sql"]
    assert json.loads((tmp_path / "a" / "mixes.json").read_text()) == meta


def test_a_rows_source_is_its_tar_shard_or_its_folder():
    import duckdb

    from assets.mixes import SOURCE

    con = duckdb.connect()
    source = lambda uri: con.execute(f"SELECT {SOURCE} FROM (SELECT ? AS uri)", [uri]).fetchone()[0]  # noqa: E731
    assert source("tar:///data/shards/shard-000.tar#s/000.jpg") == "shard-000.tar"
    assert source("tar://s3://bucket/web/shard-7.tar#000.jpg") == "shard-7.tar"
    assert source("/data/raw/photos/x::y.jpg") == "photos"  # `::` is part of a file name, not a member
    assert source("s3://bucket/scans/a.png") == "scans"
