"""Warehouse queue workers as a Slurm job array (slurm/, the launcher): the cluster tier of `kiln.warehouse.map`.

Each array task runs `kiln.warehouse.run_worker` against the Postgres queue until no claimable row is
left, so the array needs no shard plan: tasks claim batches with FOR UPDATE SKIP LOCKED, and more arrays
(or local processes) can join the same job while it runs. The queue is addressed by (dsn, stage, table);
the stage and its config are read from the job registry in Postgres, never re-composed on the node.
"""

from __future__ import annotations

import submitit

from kiln.config import KilnConfig
from kiln.progress import log as kiln_log
from kiln.warehouse.worker import run_worker
from slurm.launcher import executor_for


def submit_queue_workers(
    dsn: str,
    stage: str,
    table: str,
    n: int,
    cfg: KilnConfig,
    batch_size: int | None = None,
    max_batches: int | None = None,
    log=kiln_log.info,
) -> list[submitit.Job]:
    """`n` workers of `stage`'s queue on `table` as one Slurm array (at most `cluster.max_array_parallel` at once)."""
    if cfg.cluster.kind != "slurm":
        raise ValueError(
            f"queue workers on Slurm need a Slurm cluster profile (cluster=test, cluster=h200), not {cfg.cluster.name!r}"
        )
    if n < 1:
        return []
    executor = executor_for(cfg.cluster, "array", f"kiln-worker-{stage}")
    executor.update_parameters(slurm_array_parallelism=min(n, cfg.cluster.max_array_parallel))
    jobs = executor.map_array(run_worker, [dsn] * n, [stage] * n, [table] * n, [batch_size] * n, [max_batches] * n)
    log(f"{stage}: {n} queue workers as slurm array {jobs[0].job_id.split('_')[0]} on table {table!r}")
    return jobs
