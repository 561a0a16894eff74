"""A cluster profile as a configured submitit executor. The profile is any object with the fields of
`ClusterProfile` (kiln's `conf/cluster/*.yaml` compose into one: kiln.config.ClusterConfig); slurm/ imports
nothing of kiln, so it is the launcher library any door or executor can stand on.

Two kinds of jobs: `train` (N nodes x one task per GPU, or `tasks_per_node` CPU tasks) and `array`
(data stages, one single-task job per shard). Everything a job needs from its environment (the code
snapshot on PYTHONPATH, NCCL / InfiniBand variables, site `setup` lines) goes into the setup lines of
the job script, so it is in place before Python starts on every node.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Literal, Protocol

import submitit

JobKind = Literal["train", "array"]


class ClusterProfile(Protocol):
    """What a cluster profile says: where jobs run, their shape, their environment and where logs go."""

    name: str
    kind: Literal["local", "slurm"]
    partition: str | None
    nodes: int
    gpus_per_node: int
    tasks_per_node: int
    cpus_per_task: int
    mem_gb: float | None
    timeout_min: int
    account: str | None
    qos: str | None
    constraint: str | None
    exclusive: bool
    signal_delay_s: int
    max_requeues: int
    env: dict[str, str]
    setup: list[str]
    python: str | None
    array_partition: str | None
    array_cpus_per_task: int
    array_mem_gb: float | None
    array_timeout_min: int
    max_array_parallel: int
    log_dir: str
    snapshot_code: bool
    poll_s: float

    def model_copy(self, *, update: dict[str, Any]) -> ClusterProfile:
        """The same profile with some fields changed (pydantic's spelling)."""
        ...


def tasks_per_node(cluster: ClusterProfile) -> int:
    """One task per GPU; CPU-only profiles say how many tasks they want."""
    return cluster.gpus_per_node if cluster.gpus_per_node > 0 else cluster.tasks_per_node


def setup_lines(cluster: ClusterProfile, snapshot: Path | None) -> list[str]:
    """Shell lines run in the job script before the tasks start."""
    lines = []
    if snapshot is not None:
        snap = shlex.quote(str(snapshot))
        lines += [
            # PYTHONSAFEPATH: `python -m submitit...` must not put the submit directory (the live tree)
            # ahead of the snapshot on sys.path; the job keeps the submit directory as its cwd so that
            # relative data paths mean what they meant at submission.
            "export PYTHONSAFEPATH=1",
            f'export PYTHONPATH={snap}"${{PYTHONPATH:+:$PYTHONPATH}}"',
            f"export KILN_CONF={shlex.quote(str(snapshot / 'conf'))}",
            f"export KILN_CODE_SNAPSHOT={snap}",
        ]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(cluster.env.items())]
    return lines + list(cluster.setup)


def flight_recorder_lines(cluster: ClusterProfile) -> list[str]:
    """NCCL flight recorder for GPU training jobs: each rank keeps its last collectives in a ring buffer and
    dumps it when the watchdog times out (train.parallel.watchdog_timeout_s), so a hang says which rank
    stopped in which collective (`python -m torch.distributed.flight_recorder.fr_trace <dir>`). The dumps go
    to the job's log folder; a variable the profile's `env` sets wins."""
    if not cluster.gpus_per_node:
        return []
    dump = f"{Path(cluster.log_dir).resolve()}/$SLURM_JOB_ID/nccl_trace_rank_"
    env = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": dump,
        "TORCH_FR_DUMP_TEMP_FILE": dump,  # the newer name of the same setting
    }
    return [f'export {k}="{v}"' for k, v in env.items() if k not in cluster.env]


def executor_parameters(
    cluster: ClusterProfile, kind: JobKind, job_name: str, snapshot: Path | None = None
) -> dict[str, Any]:
    """The `update_parameters` of an AutoExecutor; generic keys for every executor, `slurm_*` for Slurm."""
    setup = setup_lines(cluster, snapshot)
    if kind == "train":
        setup = flight_recorder_lines(cluster) + setup
    if kind == "train":
        p: dict[str, Any] = {
            "name": job_name,
            "nodes": cluster.nodes,
            "tasks_per_node": tasks_per_node(cluster),
            "cpus_per_task": cluster.cpus_per_task,
            "timeout_min": cluster.timeout_min,
            "slurm_partition": cluster.partition,
            "slurm_account": cluster.account,
            "slurm_qos": cluster.qos,
            "slurm_constraint": cluster.constraint,
            "slurm_exclusive": True if cluster.exclusive else None,
        }
        if cluster.gpus_per_node:
            p["gpus_per_node"] = cluster.gpus_per_node
        if cluster.mem_gb is not None:
            p["mem_gb"] = cluster.mem_gb
    else:
        p = {
            "name": job_name,
            "nodes": 1,
            "tasks_per_node": 1,
            "cpus_per_task": cluster.array_cpus_per_task,
            "timeout_min": cluster.array_timeout_min,
            "slurm_partition": cluster.array_partition,
            "slurm_account": cluster.account,
            "slurm_qos": cluster.qos,
            "slurm_array_parallelism": cluster.max_array_parallel,
        }
        if cluster.array_mem_gb is not None:
            p["mem_gb"] = cluster.array_mem_gb
    # USR2 (submitit's default signal: NCCL does not use it) this long before the time limit
    p["slurm_signal_delay_s"] = cluster.signal_delay_s
    if setup:
        p["slurm_setup"] = setup
        p["local_setup"] = setup
    return {k: v for k, v in p.items() if v is not None}


def make_executor(
    cluster: ClusterProfile, folder: Path, kind: JobKind = "train", job_name: str = "kiln", snapshot: Path | None = None
) -> submitit.AutoExecutor:
    """A submitit executor for this profile: sbatch for `slurm`, subprocesses on this machine for `local`.

    `folder` holds submitit's pickles and the logs; `%j` in it becomes the job id.
    """
    name = cluster.kind
    kwargs: dict[str, Any] = {f"{name}_max_num_timeout": cluster.max_requeues}
    if cluster.python:
        kwargs[f"{name}_python"] = cluster.python
    ex = submitit.AutoExecutor(folder=str(folder), cluster=name, **kwargs)
    ex.update_parameters(**executor_parameters(cluster, kind, job_name, snapshot))
    return ex


def sbatch_script(
    cluster: ClusterProfile,
    kind: JobKind = "train",
    job_name: str = "kiln",
    folder: str = "%j",
    snapshot: Path | None = None,
) -> str:
    """The sbatch script a profile produces, without submitting (for `kiln submit --dry-run` and tests)."""
    from submitit.slurm.slurm import SlurmExecutor, _convert_mem, _make_sbatch_string

    params = executor_parameters(cluster, kind, job_name, snapshot)
    rename = SlurmExecutor._equivalence_dict()
    sbatch = {rename[k]: v for k, v in params.items() if k in rename}
    if "mem" in sbatch:
        sbatch["mem"] = _convert_mem(sbatch["mem"])
    sbatch.update({k[len("slurm_") :]: v for k, v in params.items() if k.startswith("slurm_")})
    if kind == "array":
        sbatch["map_count"] = 1
    return _make_sbatch_string(command="python -u -m submitit.core._submit FOLDER", folder=folder, **sbatch)
