"""A queue worker: claim a batch, run the stage, write results; until no row is left.

`run_worker` is the one entry point for every launcher: local processes started by `map`, a Slurm
array task, a shell (`python -m kiln.warehouse.worker DSN STAGE`). Any number may run at once on the
same queue, and more may join at any time.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kiln.config import KilnConfig
from kiln.databases import connect as db_connect
from kiln.progress import log
from kiln.reasons import Reason
from kiln.warehouse import postgres as pg
from kiln.warehouse.batch import process_batch
from kiln.warehouse.stages import resolve_stage

TIMEOUT_EXIT = 124  # a worker stopped by its lease watchdog exits with this code (as timeout(1) does)


@dataclass
class WorkerReport:
    worker: str
    batches: int = 0
    rows: int = 0
    kept: int = 0
    rejected: int = 0
    failed: int = 0


def worker_name() -> str:
    return f"kiln-worker:{socket.gethostname()}:{os.getpid()}"


def run_worker(
    dsn: str,
    stage_name: str,
    table: str = "images",
    batch_size: int | None = None,
    max_batches: int | None = None,
    poll_s: float = 0.2,
) -> WorkerReport:
    """Work the queue of `stage_name` over `table` until every row has a result.

    Each claim counts an attempt up front and holds its rows under a lease. A row the stage raised on is
    written back with its error and retried (alone, behind every untried row) until the job's
    max_attempts, then rejected `stage_error`. When nothing is claimable the worker takes back the rows
    of workers that died (`worker_crash`) or outlived their lease (`timeout`), and only leaves once
    every row has a result, so someone is still here to retry a dead worker's rows. A batch that
    outlives its own lease is given back and this process exits (code TIMEOUT_EXIT): a hung stage call
    cannot be interrupted, only left. `max_batches` bounds one worker's share (e.g. a Slurm task with
    a time limit).
    """
    report = WorkerReport(worker_name())
    with db_connect(dsn, report.worker) as conn:
        job = pg.read_job(conn, table, stage_name)
        stage = resolve_stage(job.stage_ref)
        cfg = KilnConfig.model_validate(job.config)
        if stage.setup is not None:  # load the stage's models once, before the first claim
            stage.setup(cfg)
        n = batch_size or job.batch_size
        while max_batches is None or report.batches < max_batches:
            claim = pg.claim(conn, job, stage.input_schema, n, report.worker)
            if claim is None:
                if pg.release_abandoned(conn, job):
                    continue
                with conn.transaction():
                    pg.reject_exhausted(conn, job)
                if not pg.has_pending(conn, job):
                    break
                time.sleep(poll_s)
                continue
            with lease_watchdog(dsn, job, claim, report.worker):
                result = process_batch(stage, claim.rows, cfg)
            written = pg.write_results(conn, job, claim.token, result, report.worker)
            if written < claim.rows.num_rows:
                log.warning(
                    "%s: %d rows of a batch were taken back before it finished",
                    report.worker,
                    claim.rows.num_rows - written,
                )
            report.batches += 1
            report.rows += claim.rows.num_rows
            report.kept += result.kept.num_rows
            report.rejected += result.rejected.num_rows
            report.failed += len(result.failed)
    log.debug("warehouse worker %s done: %s", report.worker, report)
    return report


@contextmanager
def lease_watchdog(dsn: str, job: pg.Job, claim: pg.Claim, worker: str) -> Iterator[None]:
    """Gives a claim back as `timeout` and ends this process if the batch outlives its lease.

    A timer thread, so it fires even while the stage blocks (a sleep, a read, a lock); the rows are
    released on a connection of its own before `os._exit`, so the next worker need not wait for the
    lease to be noticed.
    """

    def fire() -> None:
        error = f"timeout: a batch of {claim.rows.num_rows} rows ran past its lease of {job.lease_s:g} s in {worker}"
        try:
            with db_connect(dsn, f"{worker}:watchdog") as conn:
                pg.release_claim(conn, job, claim.token, Reason.TIMEOUT.value, error)
            log.error("%s; rows given back, worker exits", error)
        finally:
            os._exit(TIMEOUT_EXIT)

    timer = threading.Timer(job.lease_s, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="work one kiln warehouse queue until it is empty")
    p.add_argument("dsn")
    p.add_argument("stage")
    p.add_argument("--table", default="images")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--max-batches", type=int, default=None)
    a = p.parse_args(argv)
    r = run_worker(a.dsn, a.stage, a.table, a.batch_size, a.max_batches)
    print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
