"""Launch any `module:function` as a (multi-node, one task per GPU) job that survives preemption.

The entry is called as `fn(*args, cfg=cfg, **kwargs)` in every task (`cfg`: whatever the submitter passes,
kiln's config for kiln's entries), after torch.distributed is set up from the Slurm environment
(`distributed=True`). Preemption and time limits arrive as USR2
(`--signal=USR2@<signal_delay_s>`): submitit calls `LaunchedTask.checkpoint`, which requeues the same
task; the entry is expected to resume from the last checkpoint it wrote in its output folder (the
contract kiln's trainer and `slurm.selftest.allreduce_sgd` follow). Code is snapshotted at
submission (slurm.snapshot) so a requeued job runs the code it was submitted with.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import submitit
from submitit.helpers import Checkpointable

from slurm.profiles import ClusterProfile, JobKind, make_executor
from slurm.snapshot import snapshot_code


@dataclass(frozen=True)
class TaskSpec:
    """What to run: an importable `package.module:function` and its arguments (picklable)."""

    entry: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    distributed: bool = True  # set up torch.distributed before calling the entry
    name: str | None = None  # Slurm job name; default: the function's name
    watchdog_timeout_s: float = 600.0  # a collective that hangs this long fails the job (NCCL's watchdog)

    @property
    def job_name(self) -> str:
        return self.name or self.entry.rsplit(":", 1)[-1]


def resolve_entry(entry: str) -> Callable[..., Any]:
    module, sep, attr = entry.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"task entry must look like 'package.module:function', got {entry!r}")
    fn = importlib.import_module(module)
    for part in attr.split("."):
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"{entry} is not callable")
    return fn  # type: ignore[return-value]


class LaunchedTask(Checkpointable):
    """The callable submitit pickles; `checkpoint()` (inherited) resubmits it unchanged on USR2."""

    def __init__(self, spec: TaskSpec, cfg: Any = None):
        self.spec = spec
        self.cfg = cfg

    def __call__(self) -> Any:
        _forget_previous_result()
        fn = resolve_entry(self.spec.entry)
        if not self.spec.distributed:
            return fn(*self.spec.args, cfg=self.cfg, **self.spec.kwargs)
        from slurm.environment import close_distributed, init_distributed

        init_distributed(self.spec.watchdog_timeout_s)  # a hung collective fails the job (NCCL's watchdog)
        result = fn(*self.spec.args, cfg=self.cfg, **self.spec.kwargs)
        close_distributed()  # only on success: a failed peer would leave the barrier hanging
        return result


def _forget_previous_result() -> None:
    """After a requeue, a peer of the preempted run may have left an error result (its collective lost
    rank 0); remove this task's stale result so the job is judged by its final run only."""
    try:
        submitit.JobEnvironment().paths.result_pickle.unlink(missing_ok=True)
    except (KeyError, RuntimeError):  # not inside a submitit job (called directly)
        pass


def job_folder(cluster: ClusterProfile) -> Path:
    """submitit's folder: pickles and logs of one job under `<log_dir>/<job id>/`."""
    return Path(cluster.log_dir).resolve() / "%j"


def executor_for(cluster: ClusterProfile, kind: JobKind, job_name: str) -> submitit.AutoExecutor:
    snapshot = None
    if cluster.snapshot_code:
        snapshot = snapshot_code(Path(cluster.log_dir) / "snapshots")
    return make_executor(cluster, job_folder(cluster), kind=kind, job_name=job_name, snapshot=snapshot)


def single_task(cluster: ClusterProfile) -> ClusterProfile:
    """The profile shrunk to one task on one node (one GPU if it has GPUs): for non-distributed entries."""
    return cluster.model_copy(
        update={"nodes": 1, "tasks_per_node": 1, "gpus_per_node": min(cluster.gpus_per_node, 1), "exclusive": False}
    )


def launch(spec: TaskSpec, cluster: ClusterProfile, cfg: Any = None) -> submitit.Job:
    """Submit `spec` as one job: `nodes x tasks_per_node` tasks when distributed, else a single task; each
    task calls the entry with `cfg=cfg`."""
    resolve_entry(spec.entry)  # fail here, not in the queue
    shape = cluster if spec.distributed else single_task(cluster)
    return executor_for(shape, "train", spec.job_name).submit(LaunchedTask(spec, cfg))
