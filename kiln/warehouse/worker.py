"""A queue worker: claim a batch, run the stage, write results, commit; until no row is left.

`run_worker` is the one entry point for every launcher: local processes started by `map`, a Slurm
array task, a shell (`python -m kiln.warehouse.worker DSN STAGE`). Any number may run at once on the
same queue, and more may join at any time.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from dataclasses import dataclass

from kiln.config import KilnConfig
from kiln.progress import log
from kiln.warehouse import postgres as pg
from kiln.warehouse.batch import process_batch
from kiln.warehouse.stages import resolve_stage


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
    """Work the queue of `stage_name` over `table` until no claimable row is left.

    A row a stage raised on is written back with its error, attempts + 1 and a fresh last_tried_at,
    which puts it behind every untried row; it is retried until the job's max_attempts. The worker
    only leaves when no unfinished row is claimable *or held by another worker*: if that worker dies,
    its rows come back and someone is still here to take them. `max_batches` bounds one worker's share
    (e.g. a Slurm task with a time limit).
    """
    report = WorkerReport(worker_name())
    with pg.connect(dsn, report.worker) as conn:
        job = pg.read_job(conn, table, stage_name)
        stage = resolve_stage(job.stage_ref)
        cfg = KilnConfig.model_validate(job.config)
        if stage.setup is not None:  # load the stage's models once, before the first claim
            stage.setup(cfg)
        n = batch_size or job.batch_size
        while max_batches is None or report.batches < max_batches:
            with conn.transaction():
                rows = pg.claim(conn, job, stage.input_schema, n)
                if rows.num_rows:
                    result = process_batch(stage, rows, cfg)
                    pg.write_results(conn, job, result, report.worker)
            if not rows.num_rows:
                if not pg.has_pending(conn, job):
                    break
                time.sleep(poll_s)
                continue
            report.batches += 1
            report.rows += rows.num_rows
            report.kept += result.kept.num_rows
            report.rejected += result.rejected.num_rows
            report.failed += len(result.failed)
    log.debug("warehouse worker %s done: %s", report.worker, report)
    return report


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
