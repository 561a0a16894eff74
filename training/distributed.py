"""The distributed trainer: FSDP2 x TP over a 2-D mesh, DCP checkpoints, one code path from 1 to N processes.

`train_distributed(data_dir, out_dir, cfg)` runs under torchrun, a submitit TaskSpec with distributed=True
(the environment carries RANK / WORLD_SIZE / MASTER_ADDR), or plainly in one process (a 1-rank gloo
group over an in-memory store). Every rank reads the same batch stream; a step's timesteps, noise and
caption dropout are drawn for the *global* batch from the (seed, step) generator, and each data-parallel
rank keeps its contiguous slice of rows. The local loss is sum(per-sample loss) / global batch * dp, so
FSDP's gradient average over dp equals the single-process mean: sharded and single-process runs match.

Output: out/dcp/step-*/ (resume state, training/dcp.py) and, at the end, the same checkpoint folder the
single-process trainer writes (config.json, model.safetensors in the canonical layout, train_state.json,
metrics), so sampling, evaluation and PMA read either.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from kiln.config import KilnConfig, TrainConfig
from kiln.progress import log
from training.data import DataPosition, TrainSet, next_position
from training.dcp import Checkpointer, RunState
from training.muon import make_optimizer
from training.objective import flow_loss, num_image_tokens, sample_timesteps, timestep_shift
from training.parallel import build_mesh, canonical_state_dict, parallelize
from training.schedules import wsd_lr


@dataclass(frozen=True)
class Ranks:
    rank: int
    world: int
    local_rank: int
    dp_rank: int
    dp_size: int


def init_distributed(device_type: str) -> bool:
    """Join the job's process group (env://), or make a 1-process one when launched plainly; returns
    whether this call created it (and so should destroy it)."""
    if dist.is_initialized():
        return False
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def mesh_ranks(mesh) -> Ranks:
    dp = mesh["dp_shard"]
    return Ranks(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), dp.get_local_rank(), dp.size())


def local_rows(batch: int, dp_rank: int, dp_size: int) -> slice:
    """This data-parallel rank's contiguous share of a global batch (sizes differ by at most one)."""
    if batch < dp_size:
        raise ValueError(f"a batch of {batch} rows cannot feed {dp_size} data-parallel ranks")
    base, extra = divmod(batch, dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return slice(start, start + base + (dp_rank < extra))


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


def sharded_step(gen, opt, x0, text, null_text, rng: torch.Generator, cfg: TrainConfig, lr: float, shift: float, rows: slice, dp_size: int, device: torch.device) -> tuple[float, float]:
    """One optimiser step on this rank's rows of a global batch; returns (global mean loss, grad norm).

    With dp_size=1 and rows=all it is the single-process step, with the same draws as training.trainer."""
    b = x0.shape[0]
    t = sample_timesteps(b, rng, cfg.timestep_mean, cfg.timestep_std, shift, device)
    eps = torch.randn(x0.shape, generator=rng).to(device)
    if cfg.caption_dropout > 0:
        keep = torch.rand(b, generator=rng, device=rng.device) >= cfg.caption_dropout
        text = text.where(keep, null_text)
    for group in opt.param_groups:
        group["lr"] = lr
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    with autocast:
        per_sample = flow_loss(gen, x0[rows], eps[rows], t[rows], text[rows])
    loss_sum = per_sample.sum()
    opt.zero_grad(set_to_none=True)
    (loss_sum * (dp_size / b)).backward()
    params = [p for p in gen.parameters() if p.requires_grad]
    norm = grad_norm_and_clip(params, cfg.grad_clip)
    opt.step()
    total = loss_sum.detach().float().reshape(1)
    if dist.is_initialized() and dp_size > 1:
        total = total.to(device)
        dist.all_reduce(total)
        total = total / (dist.get_world_size() // dp_size)  # tp ranks of a dp group hold the same rows
    return float(total) / b, norm


def full_model_state(gen, tp: int) -> dict[str, torch.Tensor]:
    """Gathered, canonical-layout weights on CPU: every rank takes part, rank 0 receives them ({} elsewhere)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(gen, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return canonical_state_dict(full, gen, tp) if full else {}


def export_checkpoint(gen, out_dir: Path, cfg: KilnConfig, data: TrainSet, run: RunState, tp: int, rank: int) -> None:
    """The single-process checkpoint format (training/checkpoint.py) from a sharded model."""
    from training.checkpoint import STATE_FILE, TrainState
    from training.trainer import init_generator

    state = full_model_state(gen, tp)
    if rank == 0:
        plain = init_generator(cfg.model, cfg.train.seed)
        plain.load_state_dict(state, strict=True)
        plain.save_pretrained(out_dir)
        ts = TrainState(step=run.step, position=run.position, final_loss=run.last_loss, loss_ema=run.loss_ema, bucket=data.main_bucket(), rows=data.num_rows, holdout=cfg.train.holdout, num_params=plain.num_params(), config=cfg.model_dump(mode="json"))
        (Path(out_dir) / STATE_FILE).write_text(ts.to_json())


def train_distributed(data_dir: Path, out_dir: Path, cfg: KilnConfig, resume: bool = True, stop_at: int | None = None) -> Path:
    """Train on a pack stage output with FSDP2 (x TP when parallel.tp > 1); returns `out_dir`.

    Resumes from the newest complete DCP checkpoint in out_dir (when `resume`); `stop_at` ends the run at
    that step (a pre-emption), saving a resumable checkpoint, with the schedule still planned for train.steps."""
    from training.telemetry import StepRecord, Telemetry
    from training.text_cache import TextCache
    from training.trainer import init_generator, setup_runtime, step_generator

    tc = cfg.train
    out_dir = Path(out_dir)
    runtime = setup_runtime(tc)
    device = runtime.device
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    created = init_distributed(device.type)
    mesh = build_mesh(dist.get_world_size(), tc.parallel.tp, device.type)
    ranks = mesh_ranks(mesh)
    data = TrainSet.from_dir(Path(data_dir), tc.batch_size, tc.holdout)
    gen = init_generator(cfg.model, tc.seed, device)
    if tc.init_from:  # a chained stage starts from the previous stage's exported weights (a resume overrides them)
        from safetensors.torch import load_file

        gen.load_state_dict(load_file(str(Path(tc.init_from) / "model.safetensors")), strict=True)
    cache = TextCache.build(gen, data.captions())  # before sharding: the backbone is not part of the model
    null_one = gen.null_text(1)
    parallelize(gen, mesh, tc.parallel, device.type)
    opt = make_optimizer(gen, tc)
    facts = {"tp": tc.parallel.tp, "world_size": ranks.world, "optimizer": tc.optim.name}
    ckpt = Checkpointer(out_dir, tc.dcp.keep, tc.dcp.async_save, facts)
    run = (ckpt.load_latest(gen, opt) if resume else None) or RunState(0, DataPosition())
    if ranks.rank == 0:
        log.info("train_distributed: %d ranks, mesh dp_shard=%d x tp=%d, %s, from step %d", ranks.world, ranks.dp_size, tc.parallel.tp, tc.optim.name, run.step)
    telemetry = Telemetry(out_dir, append=run.step > 0) if ranks.rank == 0 else None
    stream = data.stream(tc.seed, run.position)
    patch = cfg.model.patch_size * gen.autoencoder.downsample
    gen.train()
    end = min(tc.steps, stop_at if stop_at is not None else tc.steps)
    step, position, loss_ema, last = run.step, run.position, run.loss_ema, run.last_loss
    while step < end:
        batch = next(stream)
        started = time.perf_counter()
        x0 = gen.autoencoder.encode(batch.pixels).to(device)
        text = cache.batch(batch.captions, device)
        null = type(null_one)(null_one.hidden.expand(batch.size, -1, -1, -1), null_one.mask.expand(batch.size, -1)).to(device)
        h, w = batch.pixels.shape[1:3]
        tokens = num_image_tokens(h, w, patch)
        lr = wsd_lr(step, tc.steps, tc.lr, tc.warmup_steps, tc.decay_frac, tc.min_lr_ratio)
        shift = timestep_shift(tokens, tc.timestep_shift, tc.timestep_max_shift)
        rows = local_rows(batch.size, ranks.dp_rank, ranks.dp_size)
        last, norm = sharded_step(gen, opt, x0, text, null, step_generator(tc.seed, step), tc, lr, shift, rows, ranks.dp_size, device)
        loss_ema = last if loss_ema is None else 0.98 * loss_ema + 0.02 * last
        position = next_position(batch.position, len(data))
        step += 1
        if telemetry is not None:
            telemetry.log(StepRecord(step, last, norm, lr, batch.size, batch.size * tokens, time.perf_counter() - started))
        if tc.dcp.every and step % tc.dcp.every == 0 and step < end:
            ckpt.save(gen, opt, RunState(step, position, loss_ema, last))
    final = RunState(step, position, loss_ema, last)
    ckpt.save(gen, opt, final)
    ckpt.wait()
    export_checkpoint(gen, out_dir, cfg, data, final, tc.parallel.tp, ranks.rank)
    if telemetry is not None:
        telemetry.finish()
    dist.barrier()
    if created:
        dist.destroy_process_group()
    return out_dir
