"""The single-process trainer.

Three separable layers, so the FSDP2 + TP trainer can replace the outer two and keep the middle one:
  * `setup_runtime`: threads, seeds, device, autocast (bf16 only on a GPU; weights stay fp32);
  * `train_step`: one optimiser step on prepared tensors (no data loading, no logging);
  * `train`: the loop: data stream, text-embedding cache, LR schedule, telemetry, checkpoint.

Randomness of a step (timesteps, noise, caption dropout) comes from a CPU generator seeded by
(seed, step), so a resumed run draws exactly what the uninterrupted run would have drawn.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kiln.config import KilnConfig, ModelConfig, TrainConfig
from kiln.progress import log, progress
from training.checkpoint import TrainState, load_optimizer, read_train_state, save_checkpoint
from training.data import Batch, DataPosition, TrainSet, next_position
from training.objective import drop_captions, flow_loss, num_image_tokens, sample_timesteps, timestep_shift
from training.schedules import wsd_lr
from training.telemetry import StepRecord, Telemetry
from training.text_cache import TextCache


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    autocast_dtype: torch.dtype | None  # None: full fp32

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)


def setup_runtime(cfg: TrainConfig) -> Runtime:
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed % 2**32)
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"train.device={cfg.device} but no CUDA device is available")
    return Runtime(device, torch.bfloat16 if device.type == "cuda" else None)


def step_generator(seed: int, step: int) -> torch.Generator:
    """The RNG of one step, a pure function of (seed, step)."""
    state = np.random.SeedSequence([seed, step]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state) & (2**63 - 1))


def init_generator(model: ModelConfig, seed: int, device: torch.device | str = "cpu"):
    """The Generator at initialisation, seeded: the trainer's starting point and the evaluation's baseline."""
    from model.generator import Generator

    torch.manual_seed(seed)
    return Generator.build(model).to(device)


def make_optimizer(gen: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW on the fp32 weights; no weight decay on gains, biases and other 1-D parameters."""
    decay = [p for p in gen.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in gen.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


@dataclass(frozen=True)
class StepResult:
    loss: float
    grad_norm: float


def train_step(gen, opt: torch.optim.Optimizer, x0: torch.Tensor, text, null_text, rng: torch.Generator, cfg: TrainConfig, lr: float, shift: float, runtime: Runtime) -> StepResult:
    """One optimiser step of rectified-flow v-prediction on a batch already on the device."""
    b = x0.shape[0]
    t = sample_timesteps(b, rng, cfg.timestep_mean, cfg.timestep_std, shift, runtime.device)
    eps = torch.randn(x0.shape, generator=rng).to(runtime.device)
    text = drop_captions(text, null_text, cfg.caption_dropout, rng)
    for group in opt.param_groups:
        group["lr"] = lr
    with runtime.autocast():
        loss = flow_loss(gen, x0, eps, t, text).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(gen.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
    opt.step()
    return StepResult(float(loss.detach()), float(grad_norm))


def batch_tensors(gen, batch: Batch, cache: TextCache, device: torch.device):
    x0 = gen.autoencoder.encode(batch.pixels).to(device)
    return x0, cache.batch(batch.captions, device)


def train(data_dir: Path, out_dir: Path, cfg: KilnConfig, resume: bool = False, stop_at: int | None = None) -> Path:
    """Train on a pack stage output; write the checkpoint folder `out_dir` and return it.

    `resume=True` continues from the checkpoint already in `out_dir` (weights, AdamW state, data position,
    step); `stop_at` ends the run early at that step, as a pre-emption or a job's time limit would, with
    the LR schedule still planned for `train.steps`. Resuming then gives the uninterrupted run's weights."""
    tc = cfg.train
    runtime = setup_runtime(tc)
    data = TrainSet.from_dir(Path(data_dir), tc.batch_size, tc.holdout)
    gen = init_generator(cfg.model, tc.seed, runtime.device)
    opt = make_optimizer(gen, tc)
    step, position, loss_ema, last_loss = 0, DataPosition(), None, None
    if resume and (Path(out_dir) / "train_state.json").exists():
        from safetensors.torch import load_file

        prior = read_train_state(Path(out_dir))
        gen.load_state_dict(load_file(str(Path(out_dir) / "model.safetensors")), strict=True)
        load_optimizer(gen, opt, Path(out_dir))
        step, position, loss_ema, last_loss = prior.step, prior.position, prior.loss_ema, prior.final_loss
    log.info("train: %d rows in %d batches, %d captions, %.2fM params, %d steps from step %d", data.num_rows, len(data), len(data.captions()), gen.num_params() / 1e6, tc.steps, step)

    cache = TextCache.build(gen, data.captions())
    telemetry = Telemetry(Path(out_dir), append=step > 0)
    stream = data.stream(tc.seed, position)
    patch = cfg.model.patch_size * gen.autoencoder.downsample
    beta = 0.98
    gen.train()
    end = min(tc.steps, stop_at if stop_at is not None else tc.steps)
    done = step
    for step in progress(range(step, end), desc="train", total=max(end - step, 0), unit="step"):
        batch = next(stream)
        started = time.perf_counter()
        x0, text = batch_tensors(gen, batch, cache, runtime.device)
        h, w = batch.pixels.shape[1:3]
        tokens = num_image_tokens(h, w, patch)
        lr = wsd_lr(step, tc.steps, tc.lr, tc.warmup_steps, tc.decay_frac, tc.min_lr_ratio)
        shift = timestep_shift(tokens, tc.timestep_shift, tc.timestep_max_shift)
        result = train_step(gen, opt, x0, text, gen.null_text(batch.size), step_generator(tc.seed, step), tc, lr, shift, runtime)
        if runtime.device.type == "cuda":
            torch.cuda.synchronize()
        last_loss = result.loss
        loss_ema = result.loss if loss_ema is None else beta * loss_ema + (1 - beta) * result.loss
        telemetry.log(StepRecord(step + 1, result.loss, result.grad_norm, lr, batch.size, batch.size * tokens, time.perf_counter() - started))
        position = next_position(batch.position, len(data))
        done = step + 1
        if tc.log_every and (step + 1) % tc.log_every == 0:
            log.info("step %d loss %.4f (ema %.4f) grad %.3f lr %.2e", step + 1, result.loss, loss_ema, result.grad_norm, lr)

    state = TrainState(
        step=done,
        position=position,
        final_loss=last_loss,
        loss_ema=loss_ema,
        bucket=data.main_bucket(),
        rows=data.num_rows,
        holdout=tc.holdout,
        num_params=gen.num_params(),
        config=cfg.model_dump(mode="json"),
    )
    save_checkpoint(gen, opt, Path(out_dir), state)
    summary = telemetry.finish()
    log.info("train: done, final loss %s, %.1f samples/s, %.0f tokens/s", state.final_loss, summary["samples_per_s"], summary["tokens_per_s"])
    return Path(out_dir)

