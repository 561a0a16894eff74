"""Faults on the warehouse queue: a row that kills, segfaults or hangs its worker ends as a reject, never a stall.

Each attempt is counted when a row is claimed, so a row that takes its worker down still uses one; after
max_attempts it is rejected `worker_crash` or `timeout` and the job finishes, with every other row kept
or rejected exactly once. The same on Postgres and on the embedded path, which also resumes a run that
was killed. And the ways `kiln map` used to hand back results that were not this input's: a table keyed
by input and config, rows in == rows out, a folder name with a quote in it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pyarrow.compute as pc
import pytest

import kiln.warehouse as wh
from kiln.config import KilnConfig, load_config
from kiln.databases import connect as db_connect
from kiln.reasons import Reason
from kiln.stage import Rejects, StageOutput
from kiln.warehouse import postgres as pg
from kiln.warehouse.probes import COMPUTE, FAULTS, fault_rows, probe_rows

LEASE_S = 1.5  # long enough for a clean batch of probe rows, short enough to wait out a hung one
CFG = KilnConfig().model_copy(
    update={"cluster": KilnConfig().cluster.model_copy(update={"queue_lease_s": LEASE_S, "queue_max_attempts": 2})}
)
FAULTY_ROW = 13
REASON = {"sigkill": Reason.WORKER_CRASH, "segfault": Reason.WORKER_CRASH, "hang": Reason.TIMEOUT}


def assert_one_reject_and_the_rest_exactly_once(handle, n: int, fault: str, says: str) -> None:
    final = handle.wait(progress_bar=False, timeout=60)
    assert (final.total, final.done, final.pending, final.remaining) == (n, n, 0, 0)
    out = handle.results()
    ids = out.kept.column("id").to_pylist() + out.rejected.column("id").to_pylist()
    assert sorted(ids) == [f"row-{i:07d}" for i in range(n)], "every row once, kept or rejected"
    (reject,) = out.rejected.to_pylist()
    assert (reject["id"], reject["reason"]) == (f"row-{FAULTY_ROW:07d}", REASON[fault])
    assert says in reject["detail"] and reject["detail"].endswith("(after 2 attempts)")
    assert reject["value"] == (LEASE_S if fault == "hang" else None)
    attempts, status, _ = handle.state()[reject["id"]]
    assert (attempts, status) == (2, "rejected")


# ------------------------------------------------------------------------------------------- embedded
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["sigkill", "segfault", "hang"])
def test_embedded_a_row_that_takes_its_worker_down_is_rejected_and_the_run_completes(tmp_path, fault):
    rows = fault_rows(40, {FAULTY_ROW: fault})
    handle = wh.map(FAULTS, rows, workers=2, batch_size=10, cfg=CFG, root=tmp_path)
    says = {"sigkill": "signal SIGKILL", "segfault": "signal SIGSEGV", "hang": "ran past its lease of 1.5 s"}[fault]
    assert_one_reject_and_the_rest_exactly_once(handle, 40, fault, says)
    # its batch-mates lost one attempt with it, then were retried one row at a time
    state = handle.state()
    assert {i: a for i, (a, s, _) in state.items() if a == 2 and s == "kept"} == {
        f"row-{i:07d}": 2 for i in range(10, 20) if i != FAULTY_ROW
    }


KILLED_RUN = """
import sys
import kiln.warehouse as wh
from kiln.config import KilnConfig
from kiln.warehouse.probes import COMPUTE, probe_rows

wh.map(COMPUTE, probe_rows(60, sleep_s=0.25), workers=1, batch_size=10, cfg=KilnConfig(), root=sys.argv[1]).wait(progress_bar=False)
"""


@pytest.mark.slow  # a second Python process, killed mid-run
def test_embedded_a_killed_run_resumes_where_it_stopped(tmp_path):
    queue = tmp_path / "images__probe_compute"
    run = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED_RUN), str(tmp_path)], start_new_session=True)
    deadline = time.monotonic() + 60
    while len(list(queue.glob("part-*.parquet"))) < 2:
        assert time.monotonic() < deadline and run.poll() is None, "the first run never finished two batches"
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGKILL)  # the driver and its worker, mid-run
    run.wait()
    before = {p.name: p.stat().st_mtime_ns for p in queue.glob("part-*.parquet")}
    assert 2 <= len(before) < 6

    handle = wh.map(COMPUTE, probe_rows(60, sleep_s=0.25), workers=1, batch_size=10, cfg=KilnConfig(), root=tmp_path)
    final = handle.wait(progress_bar=False, timeout=60)
    assert (final.done, final.remaining) == (60, 0)
    after = {p.name: p.stat().st_mtime_ns for p in queue.glob("part-*.parquet")}
    assert {n: after[n] for n in before} == before, "batches done before the kill were not run again"
    assert len(after) == 6 and {a for a, _, _ in handle.state().values()} == {1}


def test_embedded_paths_with_quotes_and_glob_characters_work(tmp_path):
    root = tmp_path / """it's a "warehouse" [1]*?"""
    handle = wh.map(COMPUTE, probe_rows(30), workers=1, batch_size=10, table="o'brien", cfg=CFG, root=root)
    assert handle.wait(progress_bar=False, timeout=60).done == 30
    watcher = wh.attach(COMPUTE.name, table="o'brien", root=root)
    assert watcher.progress().done == 30
    assert watcher.query('SELECT count(*) FROM "o\'brien" JOIN "o\'brien__probe_compute__kept" USING (id)') == [(24,)]
    assert len(watcher.state()) == 30


# ------------------------------------------------------------------------------------------- postgres
def fresh(dsn: str, table: str, stage: str) -> str:
    with db_connect(dsn) as conn:
        pg.drop_job(conn, table, stage)
        pg.drop_table(conn, table)
    return table


@pytest.mark.postgres
@pytest.mark.parametrize("fault", ["sigkill", "segfault", "hang"])
def test_postgres_a_row_that_takes_its_worker_down_is_rejected_and_the_job_finishes(dsn, fault):
    table = fresh(dsn, f"qf_{fault}", FAULTS.name)
    handle = wh.map(
        FAULTS, fault_rows(40, {FAULTY_ROW: fault}), dsn=dsn, workers=2, table=table, batch_size=10, cfg=CFG
    )
    says = "ran past its lease of 1.5 s" if fault == "hang" else "died while it held this row"
    assert_one_reject_and_the_rest_exactly_once(handle, 40, fault, says)
    lost = [w.exitcode for w in handle.processes if w.exitcode != 0]
    assert len(lost) == 2, f"one worker per attempt of the faulty row, replaced each time: {lost}"


@pytest.mark.postgres
def test_postgres_a_row_that_always_raises_becomes_a_stage_error_reject(dsn):
    table = fresh(dsn, "qf_raise", FAULTS.name)
    handle = wh.map(
        FAULTS, fault_rows(20, {FAULTY_ROW: "raise"}), dsn=dsn, workers=1, table=table, batch_size=10, cfg=CFG
    )
    handle.wait(progress_bar=False, timeout=60)
    (reject,) = handle.results().rejected.to_pylist()
    assert reject["reason"] == Reason.STAGE_ERROR and "always raises" in reject["detail"]
    assert all(w.exitcode == 0 for w in handle.processes)


@pytest.mark.postgres
def test_postgres_a_queue_of_another_config_is_refused_not_reused(dsn):
    table = fresh(dsn, "qf_config", COMPUTE.name)
    wh.map(COMPUTE, probe_rows(10), dsn=dsn, workers=1, table=table, cfg=CFG).wait(progress_bar=False, timeout=60)
    other = CFG.model_copy(update={"train": CFG.train.model_copy(update={"seed": 7})})  # any setting but cluster.*
    with pytest.raises(ValueError, match="under another config"):
        wh.map(COMPUTE, probe_rows(10), dsn=dsn, workers=0, table=table, cfg=other)
    rows = probe_rows(10)
    changed = rows.set_column(2, rows.schema.field("x"), pc.add(rows.column("x"), 1))
    with pytest.raises(ValueError, match="already holds 10 of these ids with other values"):
        wh.map(COMPUTE, changed, dsn=dsn, workers=0, table=table, cfg=CFG)


@pytest.mark.postgres
def test_postgres_a_queue_of_other_rows_is_refused_not_mixed_in(dsn):
    """The API's table name defaults to `images`: mapping other rows into a table whose job holds these
    would hand back both inputs' results. The same rows again resume."""
    table = fresh(dsn, "qf_rows", COMPUTE.name)
    wh.map(COMPUTE, probe_rows(10), dsn=dsn, workers=1, table=table, cfg=CFG).wait(progress_bar=False, timeout=60)
    with pytest.raises(ValueError, match="holds 10 rows that are not among these 5: it is another input's job"):
        wh.map(COMPUTE, probe_rows(5, start=10), dsn=dsn, workers=0, table=table, cfg=CFG)
    with pytest.raises(ValueError, match="holds 5 rows that are not among these 5"):
        wh.map(COMPUTE, probe_rows(5), dsn=dsn, workers=0, table=table, cfg=CFG)  # five of the ten
    again = wh.map(COMPUTE, probe_rows(10), dsn=dsn, workers=0, table=table, cfg=CFG)
    assert again.progress().done == 10
    with db_connect(dsn) as conn:
        assert len(pg.read_table(conn, table)) == 10  # nothing of the refused rows was loaded


# ------------------------------------------------------------------------------------------- kiln map
@pytest.fixture(scope="module")
def manifests(tmp_path_factory):
    """Two ingested folders of scenes 100, 140 and 200 px wide: six images, and four of the same six."""
    from samples import scene

    from kiln.stage import run_stage

    root = tmp_path_factory.mktemp("map")
    for i, size in enumerate([100, 140, 200, 100, 140, 200]):
        (root / "raw" / "all").mkdir(parents=True, exist_ok=True)
        scene(i, size=size).save(root / "raw" / "all" / f"s{i}.png")
    cfg = load_config(["cluster.workers=1"])
    run_stage("ingest", root / "raw" / "all", root / "six", cfg)
    four = root / "four" / "kept"
    four.mkdir(parents=True)
    from kiln.stage import read_dataset, write_table

    write_table(read_dataset(root / "six" / "kept").slice(0, 4), four / "part-00000.parquet")
    return root


def too_small(summary) -> int:
    return summary.by_reason.get(Reason.TOO_SMALL, 0)


@pytest.mark.postgres
@pytest.mark.integration
def test_kiln_map_on_postgres_gives_new_results_for_a_new_config(manifests, tmp_path, dsn):
    from kiln.warehouse.run import run_map

    quiet = {"log": lambda _: None}
    small = run_map(
        "filter", manifests / "six", tmp_path / "a", load_config(["data.filters.min_side=128"]), dsn, 1, **quiet
    )
    large = run_map(
        "filter", manifests / "six", tmp_path / "b", load_config(["data.filters.min_side=150"]), dsn, 1, **quiet
    )
    assert (too_small(small), too_small(large)) == (2, 4)
    again = run_map(
        "filter", manifests / "six", tmp_path / "c", load_config(["data.filters.min_side=128"]), dsn, 1, **quiet
    )
    assert again == small


@pytest.mark.integration
def test_kiln_map_embedded_runs_a_named_table_afresh_for_a_new_config_or_input(manifests, tmp_path, monkeypatch):
    """Even mapped into one table by name, the embedded warehouse never hands back another config's or another
    input's results: its job records both, and a change empties the job's folders before any row runs."""
    from kiln.warehouse.run import run_map

    monkeypatch.setenv("KILN_DATA", str(tmp_path / "data"))  # the embedded warehouse: this test's, not the checkout's
    quiet = {"log": lambda _: None}

    def embedded(input_name: str, out: str, min_side: int):
        cfg = load_config([f"data.filters.min_side={min_side}", "cluster.workers=1"])
        return run_map("filter", manifests / input_name, tmp_path / out, cfg, None, 1, "shared", **quiet)

    small, large = embedded("six", "a", 128), embedded("six", "b", 150)
    assert (too_small(small), too_small(large)) == (2, 4)
    four = embedded("four", "c", 150)  # four of the six rows: no row of the six-row job comes back
    assert four.input_rows == four.kept + four.rejected == 4


@pytest.mark.postgres
@pytest.mark.integration
def test_kiln_map_refuses_a_named_table_that_holds_another_inputs_rows(manifests, tmp_path, dsn):
    from kiln.warehouse.run import run_map

    cfg = load_config(["cluster.workers=1"])
    table = fresh(dsn, "qf_shared", "filter")
    run_map("filter", manifests / "six", tmp_path / "a", cfg, dsn, 1, table, log=lambda _: None)
    with pytest.raises(ValueError, match="'qf_shared__filter' holds 2 rows that are not among these 4"):
        run_map("filter", manifests / "four", tmp_path / "b", cfg, dsn, 1, table, log=lambda _: None)
    assert not (tmp_path / "b").exists()


def test_kiln_map_fails_when_rows_out_are_not_the_rows_in():
    """The last check before OUT is written, whatever the warehouse handed back."""
    from kiln.warehouse.run import check_rows_out

    rows = probe_rows(4)
    extra = probe_rows(6).select(["id", "uri"])
    out = StageOutput(extra.slice(0, 3), Rejects("probe").table())
    with pytest.raises(
        RuntimeError,
        match=r"4 rows in but 3 kept \+ 0 rejected out of warehouse table 't' \(0 not in this input.*1 without a result",
    ):
        check_rows_out("probe", "t", rows, out)
    with pytest.raises(RuntimeError, match=r"2 not in this input, e.g. \['row-0000004', 'row-0000005'\]"):
        check_rows_out("probe", "t", rows, StageOutput(extra, Rejects("probe").table()))
    check_rows_out(
        "probe", "t", rows, StageOutput(extra.slice(0, 4), Rejects("probe").table())
    )  # the same ids: written
