"""The Postgres work queue against a real server (scripts/postgres-local.sh; started here if needed).

What a queue for 1 to 1000 workers must guarantee: every row completes exactly once however many
workers race for it, a worker killed mid-batch loses nothing, a row that makes the stage raise
never holds up the others and is retried behind them, and the results are those of the embedded path.
"""

from __future__ import annotations

import os
import signal
import time

import pyarrow as pa
import pytest

import kiln.warehouse as wh
from kiln.config import KilnConfig
from kiln.databases import connect as db_connect
from kiln.reasons import Reason
from kiln.warehouse import postgres as pg
from kiln.warehouse.probes import COMPUTE, REJECT_EVERY, probe_rows

pytestmark = [pytest.mark.postgres, pytest.mark.integration]
CFG = KilnConfig()


def fresh(dsn: str, table: str, stage: str = COMPUTE.name) -> str:
    with db_connect(dsn) as conn:
        pg.drop_job(conn, table, stage)
        pg.drop_table(conn, table)
    return table


def claimed(dsn: str, queue: str) -> int:
    """Rows some worker holds right now (claimed, no result yet)."""
    with db_connect(dsn) as conn:
        return conn.execute(f'SELECT count(*) FROM "{queue}" WHERE claim IS NOT NULL AND status IS NULL').fetchone()[0]


@pytest.fixture(scope="module")
def eight_workers(dsn):
    """1200 rows, 8 workers racing over batches of 20 (each batch sleeps a little so they overlap)."""
    table = fresh(dsn, "q_eight")
    rows = probe_rows(1200, sleep_s=0.04)
    handle = wh.map(COMPUTE, rows, dsn=dsn, workers=8, table=table, batch_size=20, cfg=CFG)
    final = handle.wait(progress_bar=False, timeout=60)
    return rows, handle, final


def test_every_row_completes_exactly_once_under_8_workers(eight_workers):
    rows, handle, final = eight_workers
    assert (final.total, final.done, final.failed, final.pending) == (1200, 1200, 0, 0)
    state = handle.state()
    assert sorted(state) == rows.column("id").to_pylist()
    assert {a for a, _, _ in state.values()} == {1}, "a row was completed more than once"
    out = handle.results()
    ids = out.kept.column("id").to_pylist() + out.rejected.column("id").to_pylist()
    assert sorted(ids) == rows.column("id").to_pylist()
    assert out.rejected.num_rows == 1200 // REJECT_EVERY
    workers = {w for (w,) in handle.query('SELECT DISTINCT worker FROM "q_eight__probe_compute"')}
    assert len(workers) >= 3, f"the workers did not share the queue: {workers}"
    assert all(p.exitcode == 0 for p in handle.processes)


def test_results_match_the_embedded_path_row_for_row(eight_workers, tmp_path):
    rows, handle, _ = eight_workers
    embedded = wh.map(COMPUTE, rows, workers=1, table="q_eight", batch_size=300, cfg=CFG, root=tmp_path)
    embedded.wait(progress_bar=False, timeout=60)
    on_pg, local = handle.results(), embedded.results()
    assert on_pg.kept.equals(local.kept)
    assert on_pg.rejected.equals(local.rejected)
    assert on_pg.kept.schema == COMPUTE.output_schema


def test_attach_from_elsewhere_sees_the_same_job(eight_workers, dsn):
    _, _, final = eight_workers
    watcher = wh.attach(COMPUTE.name, table="q_eight", dsn=dsn)
    seen = watcher.progress()
    assert (seen.total, seen.kept, seen.rejected, seen.failed) == (
        final.total,
        final.kept,
        final.rejected,
        final.failed,
    )
    assert watcher.wait(progress_bar=False, timeout=5).remaining == 0


def test_a_worker_killed_mid_batch_loses_no_row(dsn):
    table = fresh(dsn, "q_kill")
    rows = probe_rows(30)
    slow_first_batch = pa.array([0.6 if i < 10 else 0.0 for i in range(30)], pa.float32())
    rows = rows.set_column(rows.schema.get_field_index("sleep_s"), rows.schema.field("sleep_s"), slow_first_batch)
    handle = wh.map(COMPUTE, rows, dsn=dsn, workers=1, table=table, batch_size=10, cfg=CFG)
    deadline = time.monotonic() + 30
    while claimed(dsn, f"{table}__probe_compute") == 0:  # the worker has claimed rows 0-9 and sleeps inside the stage
        assert time.monotonic() < deadline, "the worker never claimed a batch"
        time.sleep(0.02)
    victim = handle.processes[0]
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    assert victim.exitcode == -signal.SIGKILL
    assert handle.progress().done == 0, "the killed batch must not have committed anything"

    handle.add_workers(1)  # a worker joins the running job (wait also replaces the lost one)
    final = handle.wait(progress_bar=False, timeout=30)
    assert (final.done, final.pending, final.failed) == (30, 0, 0)
    # the killed attempt counts: the first batch's rows were claimed again (one at a time) and completed
    attempts = {i: a for i, (a, _, _) in handle.state().items()}
    assert attempts == {i: 2 if int(i[4:]) < 10 else 1 for i in rows.column("id").to_pylist()}
    out = handle.results()
    ids = out.kept.column("id").to_pylist() + out.rejected.column("id").to_pylist()
    assert sorted(ids) == rows.column("id").to_pylist()  # every row exactly once


def test_a_poison_row_does_not_block_the_others_is_retried_at_the_back_then_rejected(dsn):
    table = fresh(dsn, "q_poison")
    rows = probe_rows(300, poison=[5])
    handle = wh.map(COMPUTE, rows, dsn=dsn, workers=0, table=table, batch_size=50, cfg=CFG, max_attempts=3)
    report = wh.run_worker(dsn, COMPUTE.name, table)  # one worker in this process: a deterministic order
    # 6 batches, then the poison row alone twice more, then it is out of attempts and the worker leaves
    assert (report.batches, report.rows, report.failed) == (8, 302, 3)
    progress = handle.progress()
    assert (progress.done, progress.failed, progress.pending, progress.remaining) == (300, 0, 0, 0)
    attempts, status, error = handle.state()["row-0000005"]
    assert (attempts, status) == (3, "rejected") and "poison rows ['row-0000005']" in error
    (reject,) = handle.query(
        f"SELECT reason, detail FROM \"{table}__probe_compute__rejected\" WHERE id = 'row-0000005'"
    )
    assert reject[0] == Reason.STAGE_ERROR and "poison rows" in reject[1] and reject[1].endswith("(after 3 attempts)")
    first_retry_after_rest = handle.query(
        f"""SELECT bool_and(p.last_tried_at > o.last_tried_at) FROM "{table}__probe_compute" p, "{table}__probe_compute" o
            WHERE p.id = 'row-0000005' AND o.id <> p.id"""
    )
    assert first_retry_after_rest == [(True,)]
    # its 49 batch-mates were not held up: they completed in the first batch, before rows 50..
    (ordered,) = handle.query(
        f"""SELECT max(last_tried_at) FILTER (WHERE id < 'row-0000050') < min(last_tried_at) FILTER (WHERE id >= 'row-0000050')
            FROM "{table}__probe_compute" WHERE id <> 'row-0000005'"""
    )
    assert ordered == (True,)
    assert handle.wait(progress_bar=False, timeout=5).remaining == 0  # every row has a result: wait returns


def test_mapping_the_same_rows_again_resumes_instead_of_repeating(dsn):
    table = fresh(dsn, "q_resume")
    rows = probe_rows(40)
    first = wh.map(COMPUTE, rows, dsn=dsn, workers=0, table=table, batch_size=10, cfg=CFG)
    wh.run_worker(dsn, COMPUTE.name, table, max_batches=2)
    assert first.progress().done == 20
    again = wh.map(COMPUTE, rows, dsn=dsn, workers=0, table=table, batch_size=10, cfg=CFG)
    assert again.progress().done == 20
    assert wh.run_worker(dsn, COMPUTE.name, table).rows == 20
    assert {a for a, _, _ in again.state().values()} == {1}


def test_warehouse_tables_keep_exact_arrow_types(dsn):
    table = fresh(dsn, "q_types")
    schema = pa.schema(
        [
            pa.field("id", pa.string(), nullable=False),
            pa.field("small", pa.int8()),
            pa.field("f32", pa.float32()),
            pa.field("hash", pa.binary(3)),
            pa.field("flag", pa.bool_()),
            pa.field("note", pa.string()),
        ]
    )
    data = pa.table(
        {
            "id": ["a", "b"],
            "small": [-128, None],
            "f32": [0.1, float("inf")],
            "hash": [b"\x00\x01\x02", b"xyz"],
            "flag": [True, None],
            "note": ["tab\tand\nnewline\\", None],
        },
        schema=schema,
    )
    with db_connect(dsn) as conn:
        pg.load_rows(conn, table, data)
        pg.load_rows(conn, table, data)  # loading twice keeps one copy of each row
        assert pg.read_table(conn, table).equals(data)


@pytest.mark.slurm
def test_workers_as_a_slurm_job_array_complete_the_queue_like_local_ones(dsn, slurm_cluster, tmp_path):
    """The cluster tier: no local worker, only Slurm array tasks claiming from the same Postgres queue."""
    from kiln.config import load_config

    cfg = load_config(["cluster=test", f"cluster.log_dir={tmp_path / 'slurm'}", "cluster.poll_s=0.3"])
    table = fresh(dsn, "q_slurm")
    rows = probe_rows(600, sleep_s=0.002)
    handle = wh.map(COMPUTE, rows, dsn=dsn, workers=0, table=table, batch_size=50, cfg=CFG)
    jobs = handle.add_slurm_workers(2, cfg)
    final = handle.wait(progress_bar=False, timeout=180)

    assert len({j.job_id.split("_")[0] for j in jobs}) == 1 and len(jobs) == 2  # one array, two tasks
    assert (final.done, final.pending, final.failed) == (600, 0, 0)
    assert final.rejected == len([x for x in range(600) if x % REJECT_EVERY == 0])
    reference = wh.map(COMPUTE, rows, workers=1, batch_size=50, cfg=CFG, root=tmp_path / "embedded")
    reference.wait(progress_bar=False)
    mine, theirs = handle.results(), reference.results()
    assert mine.kept.equals(theirs.kept) and mine.rejected.equals(theirs.rejected)
    reports = [j.result() for j in jobs]  # each task's WorkerReport, through submitit's pickles
    assert sum(r.rows for r in reports) == 600 and all(r.worker.startswith("kiln-worker:") for r in reports)
