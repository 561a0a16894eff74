"""cluster: where jobs run, locally or on Slurm, and the warehouse queue's leases."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kiln.config.base import (
    MAX_THREADS,
    PairError,
    Strict,
)


class ClusterConfig(Strict):
    """Where jobs run. `local`: this machine (data stages in-process / a pool, launched jobs as
    submitit local subprocesses); `slurm`: sbatch through submitit (slurm/, docs/slurm.md)."""

    name: str = "local"
    kind: Literal["local", "slurm"] = "local"
    executor: Literal["auto", "inprocess", "pool", "queue", "slurm_array"] = Field(
        "auto",
        description="where data stages run (kiln.executors); auto: a process pool locally, Slurm arrays on kind=slurm",
    )
    workers: int = Field(2, ge=1, le=4096, description="local process pool size for data stages (and queue workers)")
    # the warehouse queue (kiln.warehouse): a claimed batch that outlives its lease is taken back and its worker stopped
    queue_lease_s: float = Field(
        1800.0,
        ge=0.5,
        le=7 * 86400,
        description="seconds a worker may hold a claimed batch before it counts as hung (reject: timeout)",
    )
    queue_max_attempts: int = Field(
        3,
        ge=1,
        le=100,
        description="attempts per row (counted at claim) before it becomes a reject: stage_error, worker_crash or timeout",
    )
    # training jobs: one task per GPU (or `tasks_per_node` tasks per node on CPU-only profiles)
    partition: str | None = Field(None, description="Slurm partition of training jobs; None = the cluster default")
    nodes: int = Field(1, ge=1, le=100000)
    gpus_per_node: int = Field(0, ge=0, le=256, description="also the number of tasks per node when > 0")
    tasks_per_node: int = Field(
        1, ge=1, le=MAX_THREADS, description="tasks per node when gpus_per_node is 0 (CPU / gloo jobs)"
    )
    cpus_per_task: int = Field(1, ge=1, le=MAX_THREADS)
    mem_gb: float | None = Field(None, gt=0, le=1e6, description="memory per node; None = the partition default")
    timeout_min: int = Field(60, ge=1, le=366 * 24 * 60)
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = Field(False, description="whole nodes only (sbatch --exclusive)")
    signal_delay_s: int = Field(
        90, ge=1, le=86400, description="USR2 this many seconds before the time limit: checkpoint + requeue"
    )
    max_requeues: int = Field(
        3, ge=0, le=1000, description="preemptions / timeouts survived before a job counts as failed"
    )
    env: dict[str, str] = Field(default_factory=dict, description="exported in every job (NCCL / InfiniBand settings)")
    setup: list[str] = Field(default_factory=list, description="shell lines run before the tasks (module load ...)")
    python: str | None = Field(None, description="interpreter on the compute nodes; None = this one")
    # data-stage job arrays: one array task per shard
    array_partition: str | None = Field(None, description="partition of data-stage arrays; None = the cluster default")
    array_cpus_per_task: int = Field(1, ge=1, le=MAX_THREADS)
    array_mem_gb: float | None = Field(None, gt=0, le=1e6)
    array_timeout_min: int = Field(60, ge=1, le=366 * 24 * 60)
    max_array_parallel: int = Field(
        64, ge=1, le=10**6, description="array tasks running at once (sbatch --array=...%N)"
    )
    # bookkeeping
    log_dir: str = Field(
        "data/slurm", description="submitit folder: pickles, sbatch scripts, logs (job id in the path)"
    )
    snapshot_code: bool = Field(True, description="copy the code for each job so later edits do not change it")
    poll_s: float = Field(1.0, gt=0, le=3600, description="seconds between state checks while waiting on a job")

    @model_validator(mode="after")
    def _signal_before_the_limit(self) -> ClusterConfig:
        if self.signal_delay_s >= self.timeout_min * 60:
            raise PairError(
                f"signal_delay_s ({self.signal_delay_s}) must be below the time limit, timeout_min ({self.timeout_min} min)",
                "signal_delay_s",
                "timeout_min",
            )
        return self
