"""The embedded warehouse: the queue's semantics over Parquet + DuckDB, with no server at all."""

from __future__ import annotations

import hashlib

import pyarrow.compute as pc
import pytest

import kiln.warehouse as wh
from kiln.config import KilnConfig
from kiln.reasons import Reason
from kiln.warehouse.probes import COMPUTE, NOOP, REJECT_EVERY, probe_rows

CFG = KilnConfig()


def digests(folder) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*.parquet"))
    }


def test_every_row_comes_out_kept_or_rejected_with_its_reason(tmp_path):
    rows = probe_rows(230)
    handle = wh.map(COMPUTE, rows, workers=1, batch_size=50, cfg=CFG, root=tmp_path)
    final = handle.wait(progress_bar=False, timeout=60)
    assert (final.total, final.done, final.failed, final.pending, final.remaining) == (230, 230, 0, 0, 0)
    out = handle.results()
    assert out.kept.schema == COMPUTE.output_schema
    assert out.rejected.num_rows == 230 // REJECT_EVERY
    assert set(out.rejected.column("reason").to_pylist()) == {Reason.PROBE_REJECT}
    assert (
        sorted(out.kept.column("id").to_pylist() + out.rejected.column("id").to_pylist())
        == rows.column("id").to_pylist()
    )


def test_two_runs_write_byte_identical_files_whatever_the_worker_count(tmp_path):
    rows = probe_rows(400, poison=[3])
    wh.map(COMPUTE, rows, workers=1, batch_size=64, cfg=CFG, root=tmp_path / "a").wait(progress_bar=False, timeout=60)
    wh.map(COMPUTE, rows, workers=2, batch_size=64, cfg=CFG, root=tmp_path / "b").wait(progress_bar=False, timeout=60)
    a, b = digests(tmp_path / "a"), digests(tmp_path / "b")
    assert a == b and len(a) > 10


def test_a_poison_row_is_retried_behind_the_others_then_rejected_with_its_error(tmp_path):
    handle = wh.map(
        COMPUTE, probe_rows(120, poison=[7]), workers=1, batch_size=40, cfg=CFG, max_attempts=3, root=tmp_path
    )
    final = handle.wait(progress_bar=False, timeout=60)
    assert (final.done, final.failed, final.pending, final.remaining) == (120, 0, 0, 0)
    attempts, status, error = handle.state()["row-0000007"]
    assert (attempts, status) == (3, "rejected") and "poison rows ['row-0000007']" in error
    (reject,) = handle.results().rejected.filter(pc.field("id") == "row-0000007").to_pylist()
    assert reject["reason"] == Reason.STAGE_ERROR and reject["detail"].endswith("(after 3 attempts)")
    # pass 0 holds every batch with the poison row's 39 batch-mates done; the retries are passes 1 and 2,
    # and the row that failed them all is rejected in the last file
    parts = sorted(p.name for p in (tmp_path / "images__probe_compute").glob("part-*.parquet"))
    assert parts == [
        "part-00-00000.parquet",
        "part-00-00001.parquet",
        "part-00-00002.parquet",
        "part-01-00000.parquet",
        "part-02-00000.parquet",
        "part-03-00000.parquet",
    ]


def test_another_process_can_attach_and_query_with_duckdb(tmp_path):
    wh.map(NOOP, probe_rows(50), workers=1, table="shots", cfg=CFG, root=tmp_path).wait(progress_bar=False)
    watcher = wh.attach(NOOP.name, table="shots", root=tmp_path)
    assert watcher.progress().done == 50
    assert watcher.query('SELECT status, count(*) FROM "shots__probe_noop" GROUP BY 1') == [("kept", 50)]
    joined = watcher.query('SELECT count(*) FROM "shots" JOIN "shots__probe_noop__kept" USING (id)')
    assert joined == [(50,)]


def test_a_kept_table_is_the_input_of_the_next_stage(tmp_path):
    wh.map(NOOP, probe_rows(30), workers=1, table="s", cfg=CFG, root=tmp_path).wait(progress_bar=False)
    chained = wh.map(COMPUTE, "s__probe_noop__kept", workers=1, cfg=CFG, root=tmp_path)
    assert chained.wait(progress_bar=False).done == 30
    with pytest.raises(ValueError, match=r"lacks the columns \['poison', 'sleep_s'\]"):
        wh.map(COMPUTE, probe_rows(3).drop_columns(["poison", "sleep_s"]), workers=1, cfg=CFG, root=tmp_path)


def test_attaching_to_a_job_that_does_not_exist_says_so(tmp_path):
    with pytest.raises(KeyError, match="no embedded warehouse job"):
        wh.attach("probe_noop", root=tmp_path)
