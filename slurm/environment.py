"""Inside a task: torch.distributed from the Slurm (or submitit local) environment.

submitit's `TorchDistributedEnvironment` reads rank, world size and the first host of the node list;
we only pick the port (stable per job *and* per restart, so that a requeued job does not race the
socket its previous run left in TIME_WAIT) and the backend (NCCL when this task has a GPU, else gloo).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    master: str
    job_id: str
    restart: int  # how many times this job has been requeued (SLURM_RESTART_COUNT)


def restart_count() -> int:
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)


def master_port(job_id: str, restart: int) -> int:
    """A port every task of one run of one job agrees on, different after each requeue."""
    digest = hashlib.sha256(f"{job_id}:{restart}".encode()).digest()
    return 20000 + int.from_bytes(digest[:4], "big") % 40000


def init_distributed(timeout_s: float = 300.0) -> DistInfo:
    """Export MASTER_ADDR/PORT, RANK, WORLD_SIZE... and `init_process_group`; idempotent."""
    from datetime import timedelta

    from submitit import JobEnvironment
    from submitit.helpers import TorchDistributedEnvironment

    job = JobEnvironment()
    restart = restart_count()
    os.environ["MASTER_PORT"] = str(master_port(str(job.job_id), restart))
    env = TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return DistInfo(env.rank, env.world_size, env.local_rank, backend, env.master_addr, str(job.job_id), restart)


def close_distributed() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
