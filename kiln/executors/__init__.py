"""One way to run a data stage, whichever executor the cluster profile picks.

| executor | where the shards go | the profile that picks it (`cluster.executor: auto`) |
|---|---|---|
| `inprocess` | this process, one shard after another | - |
| `pool` | a local process pool of `cluster.workers` | `kind: local` |
| `queue` | the warehouse queue: Postgres when KILN_PG_DSN is set, else the embedded DuckDB one | - |
| `slurm_array` | one Slurm array task per shard (a global stage: one task) | `kind: slurm` |

Every executor calls `kiln.stage.apply_stage` on each shard, the one place the contract is checked, and
writes the output with `kiln.stage.write_stage_output`, so the same input gives the same kept and rejected
rows, row for row, whichever ran it. Global stages (dedup, clusters, pack) see all rows at once everywhere;
the queue refuses them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from kiln.config import KilnConfig
from kiln.outputs import check_output, swap_in
from kiln.progress import log as kiln_log
from kiln.stage import Summary, get_stage, run_stage

EXECUTORS = ("inprocess", "pool", "queue", "slurm_array")


def executor_of(cfg: KilnConfig) -> str:
    chosen = cfg.cluster.executor
    if chosen == "auto":
        return "slurm_array" if cfg.cluster.kind == "slurm" else "pool"
    return chosen


def execute(
    stage: str,
    input_path: Path | str,
    output: Path | str,
    cfg: KilnConfig,
    log: Callable[[str], None] = kiln_log.info,
    overwrite: bool = False,
) -> Summary:
    """Run `stage` over `input_path` into `output` on the profile's executor. The output is checked first
    (kiln.outputs.check_output): never the input or inside it, and holding only what kiln wrote unless `overwrite`."""
    check_output(output, input_path, overwrite)
    executor = executor_of(cfg)
    if executor == "slurm_array":
        from kiln.executors.slurm_array import run_stage_array

        return run_stage_array(stage, input_path, output, cfg, log=log, overwrite=overwrite)
    if executor == "queue" and get_stage(stage).scope == "shard":
        from kiln.warehouse.run import queue_table, run_map

        dsn = os.environ.get("KILN_PG_DSN")
        target = Path(output).resolve()
        fresh = (
            target.parent / f".{target.name}.queue-{os.getpid()}"
        )  # written whole, then swapped in: OUT was checked above
        try:
            summary = run_map(
                stage,
                Path(input_path),
                fresh,
                cfg,
                dsn,
                max(cfg.cluster.workers, 1),
                queue_table(stage, input_path, cfg),
                log=log,
            )
            swap_in(fresh, target)
            return summary
        finally:
            shutil.rmtree(fresh, ignore_errors=True)
    workers = 1 if executor in ("inprocess", "queue") else cfg.cluster.workers
    return run_stage(stage, input_path, output, cfg, workers=workers, overwrite=overwrite)


def train_task(data: Path, out: Path, cfg: KilnConfig):
    """The trainer as a Slurm job: one task per GPU over `nodes` nodes, FSDP2 x TP over them
    (`train.parallel.tp`). resume=True: a requeued job (and a resubmission into the same `out`) continues
    from the newest good DCP checkpoint there (refused if it saw another train set)."""
    from slurm.launcher import TaskSpec

    return TaskSpec(
        "training.core.trainer:train",
        (data if "://" in str(data) else Path(data).resolve(), Path(out).resolve()),
        {"resume": True},
        distributed=True, name="kiln-train", watchdog_timeout_s=cfg.train.parallel.watchdog_timeout_s,
    )  # fmt: skip


def run_training(
    data: Path,
    out: Path,
    cfg: KilnConfig,
    resume: bool = False,
    overwrite: bool = False,
    log: Callable[[str], None] = kiln_log.info,
):
    """The trainer on the profile's executor: in this process, or (a Slurm profile) as a Slurm job that this
    waits for. A fresh run into a used folder clears it before submitting (`overwrite`), since the job itself
    resumes: it must never delete what a requeue would resume. Returns the checkpoint folder, or the job's
    report on Slurm."""
    from training.core.runtime import prepare_output
    from training.core.trainer import train

    if cfg.cluster.kind != "slurm":
        return train(data if "://" in str(data) else Path(data), Path(out), cfg, resume=resume, overwrite=overwrite)
    from slurm.jobs import submit_and_wait

    prepare_output(Path(out), resume=resume, overwrite=overwrite)
    return submit_and_wait(train_task(data, out, cfg), cfg.cluster, cfg, log=log)
