"""Small real jobs that check a cluster profile end to end (`kiln submit selftest`), and that the tests use.

`allreduce_sgd`: every task computes the gradient of a tiny nn.Linear on its own deterministic batch,
the gradients are all-reduce-averaged, and rank 0 checkpoints after every step (one safetensors file,
written atomically, step and history in its metadata). Restarted, it resumes from that file, so a
preempted-and-requeued run ends in exactly the state of an uninterrupted one. `reference_sgd` is the
same computation in one process. On a GPU cluster the same job exercises NCCL over the profile's
interconnect settings.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

CHECKPOINT = "checkpoint.safetensors"


def init_model(dim: int, seed: int) -> torch.nn.Linear:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(dim, 1)
    with torch.no_grad():
        model.weight.copy_(torch.randn(model.weight.shape, generator=g))
        model.bias.zero_()
    return model


def batch_for(step: int, rank: int, batch: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data a rank sees at a step: a function of (seed, step, rank) only, so reruns see the same."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(batch, dim, generator=g)
    true_w = torch.arange(1, dim + 1, dtype=torch.float32) / dim
    return x, x @ true_w[:, None] + 0.5


def local_grads(model: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return float(loss.detach()), [p.grad.detach().clone() for p in model.parameters()]


def sgd_update(model: torch.nn.Linear, grads: list[torch.Tensor], lr: float) -> None:
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p.sub_(lr * g)


def _save(path: Path, model: torch.nn.Linear, step: int, losses: list[float], starts: list[int]) -> None:
    tmp = path.with_suffix(".tmp")
    meta = {"step": str(step), "losses": json.dumps(losses), "starts": json.dumps(starts)}
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(tmp), metadata=meta)
    os.replace(tmp, path)


def _load(path: Path, model: torch.nn.Linear) -> tuple[int, list[float], list[int]]:
    if not path.exists():
        return 0, [], []
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    model.load_state_dict(load_file(str(path)))
    return int(meta["step"]), json.loads(meta["losses"]), json.loads(meta["starts"])


def allreduce_sgd(
    out_dir: str,
    *,
    cfg: Any = None,
    steps: int = 20,
    lr: float = 0.1,
    batch: int = 8,
    dim: int = 4,
    seed: int = 0,
    step_sleep_s: float = 0.0,
) -> dict[str, Any]:
    """Data-parallel SGD over every task of the job; resumes from `out_dir/checkpoint.safetensors`."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # NCCL reduces CUDA tensors only: on GPU tasks the whole computation lives on this task's GPU
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    model = init_model(dim, seed)
    start, losses, starts = _load(out / CHECKPOINT, model)
    model.to(device)
    starts = starts + [start]
    if world > 1:
        dist.barrier()  # everyone has read the checkpoint before rank 0 writes the next one
    for step in range(start, steps):
        x, y = batch_for(step, rank, batch, dim, seed)
        loss, grads = local_grads(model, x.to(device), y.to(device))
        flat = torch.cat([g.flatten() for g in grads] + [torch.tensor([loss], device=device)])
        if world > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= world
        grads = [t.view_as(g) for t, g in zip(flat[:-1].split([g.numel() for g in grads]), grads)]
        sgd_update(model, grads, lr)
        losses.append(float(flat[-1]))
        if rank == 0:
            _save(out / CHECKPOINT, model, step + 1, losses, starts)
        if world > 1:
            dist.barrier()
        if step_sleep_s:
            time.sleep(step_sleep_s)
    import slurm

    return {
        "rank": rank,
        "world_size": world,
        "final_loss": losses[-1] if losses else None,
        "losses": losses,
        "starts": starts,
        "weights": torch.cat([p.detach().cpu().flatten() for p in model.parameters()]).tolist(),
        "device": str(device),
        "code": str(Path(slurm.__file__).parent),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        "backend": dist.get_backend() if dist.is_initialized() else "none",
    }


def reference_sgd(
    world_size: int, *, steps: int = 20, lr: float = 0.1, batch: int = 8, dim: int = 4, seed: int = 0
) -> dict[str, Any]:
    """`allreduce_sgd` over `world_size` simulated ranks, in this process, without torch.distributed."""
    model = init_model(dim, seed)
    losses = []
    for step in range(steps):
        per_rank = [local_grads(model, *batch_for(step, r, batch, dim, seed)) for r in range(world_size)]
        flat = torch.cat([g.flatten() for g in per_rank[0][1]] + [torch.tensor([per_rank[0][0]])])
        for loss, grads in per_rank[1:]:
            flat = flat + torch.cat([g.flatten() for g in grads] + [torch.tensor([loss])])
        flat /= world_size
        shapes = per_rank[0][1]
        sgd_update(model, [t.view_as(g) for t, g in zip(flat[:-1].split([g.numel() for g in shapes]), shapes)], lr)
        losses.append(float(flat[-1]))
    return {
        "final_loss": losses[-1],
        "losses": losses,
        "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
    }
