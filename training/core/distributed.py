"""Process groups and meshes for the trainer: joining the job's group, each rank's share of a batch, a
DTensor-aware gradient norm, and the export of a sharded model to the single-process checkpoint format.

The trainer (training/core/trainer.py) runs under torchrun, as a submitit task with distributed=True (RANK /
WORLD_SIZE / MASTER_ADDR in the environment), or plainly in one process (no group, no mesh). Every rank
reads the same batch stream; a step's timesteps, noise and caption dropout are drawn for the *global*
batch from the (seed, step) generator, and each data-parallel rank keeps its contiguous slice of rows.
The local loss is sum(per-sample loss) / global batch * dp, so FSDP's gradient average over dp equals the
single-process mean: sharded and single-process runs match.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from kiln.config import KilnConfig
from training.core.data import TrainSet
from training.core.dcp import RunState


@dataclass(frozen=True)
class Ranks:
    rank: int
    world: int
    local_rank: int
    dp_rank: int
    dp_size: int


SINGLE = Ranks(0, 1, 0, 0, 1)


def launched_distributed() -> bool:
    """Whether a launcher (torchrun, submitit's TorchDistributedEnvironment) set up a multi-process job."""
    return dist.is_initialized() or ("MASTER_ADDR" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1)


def init_distributed(device_type: str, timeout_s: float | None = None) -> bool:
    """Join the job's process group (env://) when launched as one; returns whether this call created it
    (and so should destroy it). A plain single-process run gets no group: there is nothing to talk to.
    `timeout_s`: a collective stuck this long fails the job (NCCL's watchdog; torch's default if None)."""
    if dist.is_initialized() or not launched_distributed():
        return False
    from datetime import timedelta

    timeout = timedelta(seconds=timeout_s) if timeout_s else None
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=timeout)
    return True


def build_ranks(tp: int, device_type: str):
    """(mesh, Ranks): the 2-D ("dp_shard", "tp") mesh of a distributed job, or (None, SINGLE) for one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if tp != 1:
            raise ValueError(
                f"parallel.tp={tp} needs {tp} or more processes (torchrun, or a Slurm job with that many tasks)"
            )
        return None, SINGLE
    from training.core.parallel import build_mesh

    mesh = build_mesh(dist.get_world_size(), tp, device_type)
    dp = mesh["dp_shard"]
    return mesh, Ranks(
        dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), dp.get_local_rank(), dp.size()
    )


def grad_norm_and_clip(params: list[torch.Tensor], max_norm: float) -> float:
    """Global L2 norm of the gradients (DTensor-aware: each norm is reduced over its own mesh), clipped."""
    sq = 0.0
    for p in params:
        if p.grad is None:
            continue
        n = torch.linalg.vector_norm(p.grad)
        sq += float(n.full_tensor() if hasattr(n, "full_tensor") else n) ** 2
    total = math.sqrt(sq)
    if max_norm > 0 and total > max_norm:
        coef = max_norm / (total + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return total


def all_reduce_sum(values: list[float], device: torch.device, dp_size: int) -> list[float]:
    """Sum per-rank values over the data-parallel ranks (tp ranks of one dp group hold the same rows)."""
    if not dist.is_initialized() or dp_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / (dist.get_world_size() // dp_size)).tolist()


def full_model_state(gen, tp: int) -> dict[str, torch.Tensor]:
    """Gathered, canonical-layout weights on CPU: every rank takes part, rank 0 receives them ({} elsewhere)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from training.core.parallel import canonical_state_dict

    full = get_model_state_dict(gen, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return canonical_state_dict(full, gen, tp) if full else {}


def export_checkpoint(
    gen, out_dir: Path, cfg: KilnConfig, data: TrainSet, run: RunState, tp: int, rank: int, sharded: bool
) -> None:
    """The single-process checkpoint folder (config.json, model.safetensors in the canonical layout,
    train_state.json) from the trained model, sharded or not: what sampling, evaluation and PMA read."""
    from training.core.checkpoint import STATE_FILE, TrainState

    plain = gen
    if sharded:
        from training.core.runtime import init_generator

        state = full_model_state(gen, tp)
        if rank != 0:
            return
        plain = init_generator(cfg.model, cfg.train.seed)
        plain.load_state_dict(state, strict=True)
    plain.save_pretrained(out_dir)
    ts = TrainState(
        step=run.step,
        position=run.position,
        final_loss=run.last_loss,
        loss_ema=run.loss_ema,
        bucket=data.main_bucket(),
        rows=data.num_rows,
        holdout=cfg.train.holdout,
        num_params=plain.num_params(),
        config=cfg.model_dump(mode="json"),
    )
    (Path(out_dir) / STATE_FILE).write_text(ts.to_json())
