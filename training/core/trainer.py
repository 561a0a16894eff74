"""The trainer: one loop from a laptop CPU to multi-node FSDP2 x TP.

`train(data_dir, out_dir, cfg)` runs plainly in one process (the demo, Dagster's checkpoint asset, `kiln
train`), under torchrun, or as the tasks of a Slurm job (slurm/launcher.py): a launcher's environment
(RANK / WORLD_SIZE / MASTER_ADDR) makes it join the job's process group and build the 2-D
("dp_shard", "tp") mesh; without one there is no group and no mesh, and the same loop runs on one device.

Layers, so each can be tested alone:
  * `setup_runtime` (training.core.runtime): threads, seeds, device;
  * `train_step`: one optimiser step on one rank's rows of a global batch (no data loading, no logging);
  * `train`: data stream and read-ahead, text-embedding cache, parallelism, LR schedule, REPA, telemetry,
    DCP checkpoints (resume), the exported checkpoint folder and its record of the data (`train_data.json`).

Randomness of a step (timesteps, noise, caption dropout) comes from a CPU generator seeded by (seed, step)
and is drawn for the global batch, so a resumed run draws exactly what the uninterrupted run would have
drawn, and N ranks draw what one process draws.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kiln.config import KilnConfig, TrainConfig
from kiln.memory import release_freed_memory
from kiln.progress import log, progress
from training.core.runtime import (
    NonFiniteTraining,
    Runtime,
    init_generator,
    prepare_output,
    require_finite_weights,
    setup_runtime,
    step_generator,
)


@dataclass(frozen=True)
class StepResult:
    loss: float  # global mean flow loss
    grad_norm: float
    repa_loss: float | None = None  # global mean REPA term, when on
    skipped: bool = False  # the loss or grad norm was not finite: no update was applied


@dataclass(frozen=True)
class Learner:
    """What every step trains and how: the model and its optimiser, the stage's settings, the device, and the
    number of data-parallel ranks sharing each global batch. `repa` (training.core.repa.Repa) and its optimiser
    `repa_opt` while REPA is on; `without_repa()` for the steps after `train.repa.steps`."""

    gen: Any
    opt: torch.optim.Optimizer
    cfg: TrainConfig
    runtime: Runtime
    dp_size: int = 1
    repa: Any = None
    repa_opt: torch.optim.Optimizer | None = None

    def without_repa(self) -> Learner:
        return replace(self, repa=None, repa_opt=None)


@dataclass(frozen=True)
class StepBatch:
    """One global batch: the clean inputs `x0` (pixels or latents), their caption embeddings, the empty caption's
    (for caption dropout), and, for REPA, the clean images in [-1, 1] pixels."""

    x0: torch.Tensor
    text: Any
    null_text: Any
    images: torch.Tensor | None = None
    rows: slice | None = None  # set: the tensors are only these rows of a global batch of `size` (a streaming rank's)
    size: int = 0


def train_step(
    learner: Learner, batch: StepBatch, rng: torch.Generator, lr: float, shift: float, rows: slice = slice(None)
) -> StepResult:
    """One optimiser step of rectified-flow v-prediction on this rank's `rows` of a global batch.

    The draws cover the whole batch, the loss is sum / global batch * dp_size (FSDP averages over dp):
    with dp_size=1 and all rows it is the plain single-process step. With `learner.repa` the step adds
    weight x the REPA term on `batch.images`. A non-finite loss or grad norm (the same on every rank: both
    are global) skips the update."""
    from training.core.distributed import all_reduce_sum, grad_norm_and_clip
    from training.core.objective import drop_captions, flow_loss, sample_timesteps

    gen, opt, cfg, runtime, dp_size, repa, repa_opt = (
        learner.gen,
        learner.opt,
        learner.cfg,
        learner.runtime,
        learner.dp_size,
        learner.repa,
        learner.repa_opt,
    )
    x0, text, null_text, images = batch.x0, batch.text, batch.null_text, batch.images
    local = batch.rows is not None  # the tensors hold this rank's rows only; the draws still cover the global batch
    b = batch.size if local else x0.shape[0]
    take, mine = (slice(None), batch.rows) if local else (rows, rows)  # rows of the tensors, rows of the draws
    device = runtime.device
    t = sample_timesteps(b, rng, cfg.timestep_mean, cfg.timestep_std, shift, device)
    eps = torch.randn((b, *x0.shape[1:]), generator=rng).to(device)
    text = drop_captions(text, null_text, cfg.caption_dropout, rng, b, mine if local else slice(None))
    route = None
    if cfg.route.frac > 0:  # drawn last: with routing off every other draw is what it always was
        from model.routing import TokenRoute
        from training.core.objective import num_image_tokens

        n_img = num_image_tokens(x0.shape[-2], x0.shape[-1], gen.dit_cfg.patch_size)
        route = TokenRoute.draw(n_img, cfg.route.frac, cfg.route.start, cfg.route.end, rng)
    for o in (opt, repa_opt):
        for group in o.param_groups if o is not None else ():
            group["lr"] = lr
    with runtime.autocast():
        per_sample = flow_loss(gen, x0[take], eps[mine], t[mine], text[take], route)
        loss_sum = per_sample.sum()
        objective = loss_sum * (dp_size / b)
        repa_sum = torch.zeros(())
        if repa is not None:
            term = repa.loss(images[take], tuple(x0.shape[-2:]))
            repa_sum = term.detach() * per_sample.shape[0]
            objective = objective + repa.cfg.weight * term * (per_sample.shape[0] * dp_size / b)
    opt.zero_grad(set_to_none=True)
    if repa_opt is not None:
        repa_opt.zero_grad(set_to_none=True)
    objective.backward()
    params = [p for p in gen.parameters() if p.requires_grad]
    norm = grad_norm_and_clip(params, cfg.grad_clip)
    total, repa_total = all_reduce_sum([float(loss_sum.detach()), float(repa_sum)], device, dp_size)
    finite = math.isfinite(total) and math.isfinite(norm) and math.isfinite(repa_total)
    if finite:
        opt.step()
        if repa_opt is not None:
            repa_opt.step()
    else:  # NaN / inf gradients would poison the weights and the optimiser's moments
        opt.zero_grad(set_to_none=True)
        if repa_opt is not None:
            repa_opt.zero_grad(set_to_none=True)
    return StepResult(total / b, norm, repa_total / b if repa is not None else None, skipped=not finite)


def _load_init_weights(gen, init_from: str | None) -> None:
    """A chained stage (256 -> 512 -> 1024 -> mid -> SFT) starts from the previous stage's exported weights,
    checked against their checksums first."""
    if init_from:
        from safetensors.torch import load_file

        from training.core.checkpoint import verify_export

        verify_export(Path(init_from))
        gen.load_state_dict(load_file(str(Path(init_from) / "model.safetensors")), strict=True)


DATA_RECORD = "train_data.json"
TRIM_EVERY = 100  # steps between handing freed heap pages back (kiln.memory): a few milliseconds each


def data_record(data_dir: Path | str, data, cfg: KilnConfig, steps: int, version: str | None = None) -> dict:
    """What a checkpoint was trained on: the train set's version (the sha256 the evaluation records too),
    the mix, the caption form probabilities and how often each form was drawn over the `steps` steps,
    and the sampling weights' spread. Deterministic, like everything else in the checkpoint folder."""
    from training.core.data import dataset_version

    return {
        "train_set_version": version or dataset_version(data_dir),
        "mix": cfg.train.mix,
        "caption_form_probs": cfg.data.rewrite.form_probs,
        "caption_forms_drawn": data.form_counts(cfg.train.seed, steps),
        "steps": steps,
        "rows": data.num_rows,
        "weighted": data.weighted,
        "sampling_weight": data.weight_summary(),
        "skipped_shards": data.skipped,
    }


def write_data_record(
    out_dir: Path, data_dir: Path | str, data, cfg: KilnConfig, steps: int, version: str | None = None
) -> None:
    (Path(out_dir) / DATA_RECORD).write_text(
        json.dumps(data_record(data_dir, data, cfg, steps, version), indent=2, sort_keys=True) + "\n"
    )


def train(
    data_dir: Path | str,
    out_dir: Path,
    cfg: KilnConfig,
    resume: bool = False,
    stop_at: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Train on a pack stage output; write the checkpoint folder `out_dir` and return it.

    `resume=True` continues from the newest good DCP checkpoint in `out_dir/dcp` (weights, optimiser,
    data position, RNG, step), if the train set is the one it saw; `stop_at` ends the run early at that
    step, as a pre-emption or a job's time limit would, saving a resumable checkpoint, with the LR schedule
    still planned for `train.steps`. Without either, a folder holding an earlier run's checkpoints is
    refused unless `overwrite=True` (which replaces them). A non-finite loss or grad norm skips the step,
    up to `train.nonfinite_skip` times, then stops the run (NonFiniteTraining), and non-finite weights are
    never saved or exported."""
    import torch.distributed as dist

    from model.autoencoder import from_uint8_nhwc
    from training.core.checkpoint import write_export_manifest
    from training.core.data import (
        DataPosition,
        TrainSet,
        bucket_size,
        check_buckets,
        check_latents,
        dataset_version,
        write_heldout,
    )
    from training.core.dcp import Checkpointer, LoadPolicy, RunState
    from training.core.distributed import build_ranks, export_checkpoint, init_distributed
    from training.core.gpu_settings import attention_context, check_gpu_settings
    from training.core.gpu_telemetry import GpuMonitor, peak_tflops
    from training.core.loader import Prefetcher, latent_encoder, loader_workers
    from training.core.muon import make_optimizer
    from training.core.objective import num_image_tokens, timestep_shift
    from training.core.parallel import parallelize
    from training.core.repa import build_repa, repa_active
    from training.core.schedules import wsd_lr
    from training.core.stragglers import find_stragglers, gather_rank_seconds
    from training.core.telemetry import StepRecord, Telemetry
    from training.core.text_cache import TextCache

    tc = cfg.train
    out_dir = Path(out_dir)
    check_gpu_settings(cfg)  # a GPU-only setting this machine cannot run refuses the run before anything is built
    runtime = setup_runtime(tc)
    device = runtime.device
    created = init_distributed(device.type, tc.parallel.watchdog_timeout_s)
    ckpt = None
    try:
        mesh, ranks = build_ranks(tc.parallel.tp, device.type)
        prepare_output(out_dir, resume, overwrite, ranks.rank)
        version = dataset_version(data_dir)
        data = TrainSet.from_dir(
            data_dir, tc.batch_size, tc.holdout, cfg.data.rewrite.form_probs, tc.init_from, tc.bad_shard
        )  # a ladder rung holds out what its start held out
        if ranks.rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            write_heldout(out_dir, data.held_out)
        gen = init_generator(cfg.model, tc.seed, device)
        check_latents(data.manifest, gen.autoencoder.identity(), data_dir)
        check_buckets(data.buckets, gen.autoencoder.downsample * cfg.model.patch_size, data_dir)
        _load_init_weights(gen, tc.init_from)
        cache = TextCache(gen, tc.text_cache_mb)  # the frozen backbone encodes each step's captions
        texts = data.drawable_texts(tc.text_prefill_rows)  # a small set's: all of them, up front, if they fit
        if texts:
            held = cache.prefill(texts)
            release_freed_memory()  # the encoder's temporaries: glibc would keep them resident through training
            log.info("train: %d of %d caption texts encoded up front (train.text_cache_mb)", held, len(texts))
        null_one = gen.null_text(1)
        flops_per_sample = {
            b: gen.flops_per_sample(*(side // gen.autoencoder.downsample for side in bucket_size(b)))
            for b in data.buckets
        }
        repa = build_repa(gen, tc.repa, tc.parallel, device) if tc.repa.teacher_path else None
        data.with_pixels |= repa is not None  # REPA's encoder sees the images, a latent set's included
        parallelize(gen, mesh, tc.parallel, device.type)
        opt = make_optimizer(gen, tc)
        repa_opt = None
        aux = {}
        if repa is not None:
            repa_opt = repa.make_optimizer(mesh, tc)
            aux = {"repa": (repa.projector, repa_opt)}
        ema = None
        if tc.ema_decay > 0:  # after sharding: each rank averages its own shards
            from training.core.ema import WeightEma

            ema = WeightEma(gen, tc.ema_decay)
            aux["ema"] = (ema, [])
        facts = {"tp": tc.parallel.tp, "world_size": ranks.world, "optimizer": tc.optim.name}
        policy = LoadPolicy(tc.dcp.trust_unsigned, tc.dcp.allow_train_set_change)
        ckpt = Checkpointer(out_dir, tc.dcp.keep, tc.dcp.async_save, facts, aux, version, policy)
        run = (ckpt.load_latest(gen, opt) if resume else None) or RunState(0, DataPosition())
        if ranks.rank == 0:
            log.info(
                "train: %d rows in %d shards, %.2fM params, %d ranks (dp_shard %d x tp %d), %s, steps %d..%d",
                data.num_rows,
                len(data.manifest.shards),
                gen.num_params() / 1e6,
                ranks.world,
                ranks.dp_size,
                tc.parallel.tp,
                tc.optim.name,
                run.step,
                tc.steps,
            )
        tel = tc.telemetry
        telemetry = (
            Telemetry(out_dir, resume_step=run.step, spike_window=tel.spike_window, spike_z=tel.spike_z)
            if ranks.rank == 0
            else None
        )
        gpu = GpuMonitor.open(device.index or 0) if device.type == "cuda" and tel.gpu_every else None
        peak = peak_tflops(device.type, tel.peak_tflops)
        gen.train()
        end = min(tc.steps, stop_at if stop_at is not None else tc.steps)
        step, position, loss_ema, last = run.step, run.position, run.loss_ema, run.last_loss
        skipped = 0  # non-finite steps skipped so far in this process
        work = data.work(tc.seed, run.position, ranks.dp_rank, ranks.dp_size)  # this rank's rows of each batch
        learner = Learner(gen, opt, tc, runtime, ranks.dp_size, repa, repa_opt)
        encode = latent_encoder(gen, cfg.model.latent_cache_dir, pin=device.type == "cuda")
        with Prefetcher(work, lambda w: encode(data.read(w)), loader_workers(tc.loader_workers, device.type)) as loader:
            steps = range(step, end)
            for step in progress(
                steps, desc="train", total=len(steps), unit="step"
            ):  # rank 0's bar only (kiln.progress)
                started = time.perf_counter()
                if step and step % TRIM_EVERY == 0:  # steps of several bucket sizes leave holes glibc keeps resident
                    release_freed_memory()
                item = next(loader)
                batch = item.batch
                x0 = item.x0.to(device, non_blocking=True)
                text = cache.batch(batch.captions, device)
                null = type(null_one)(
                    null_one.hidden.expand(batch.size, -1, -1, -1), null_one.mask.expand(batch.size, -1)
                ).to(device)
                tokens = num_image_tokens(x0.shape[-2], x0.shape[-1], cfg.model.patch_size)
                lr = wsd_lr(step, tc.steps, tc.lr, tc.warmup_steps, tc.decay_frac, tc.min_lr_ratio)
                shift = timestep_shift(tokens, tc.timestep_shift, tc.timestep_max_shift)
                on = repa is not None and repa_active(tc.repa, step)
                images = from_uint8_nhwc(batch.pixels, device) if on else None
                with attention_context(tc.parallel.attention):
                    result = train_step(
                        learner if on else learner.without_repa(),
                        StepBatch(x0, text, null, images, batch.rows, batch.total),
                        step_generator(tc.seed, step),
                        lr,
                        shift,
                    )
                if ema is not None and not result.skipped:
                    ema.update(gen)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                rank_seconds = gather_rank_seconds(time.perf_counter() - started, device) if ranks.world > 1 else None
                if not result.skipped:
                    last = result.loss
                    loss_ema = last if loss_ema is None else 0.98 * loss_ema + 0.02 * last
                position = batch.after
                done = step + 1
                if telemetry is not None:
                    counters = gpu.sample().to_dict() if gpu is not None and done % tel.gpu_every == 0 else {}
                    stragglers = find_stragglers(rank_seconds, tel.straggler_factor) if rank_seconds else []
                    telemetry.log(
                        StepRecord(
                            done,
                            result.loss,
                            result.grad_norm,
                            lr,
                            batch.total,
                            batch.total * tokens,
                            time.perf_counter() - started,
                            flops_per_sample[batch.bucket] * batch.total,
                            ranks.world,
                            peak,
                            result.repa_loss,
                            counters,
                            rank_seconds,
                            stragglers,
                        )
                    )
                    if tc.log_every and done % tc.log_every == 0:
                        log.info(
                            "step %d loss %.4f (ema %.4f) grad %.3f lr %.2e",
                            done,
                            result.loss,
                            loss_ema or math.nan,
                            result.grad_norm,
                            lr,
                        )
                if result.skipped:
                    skipped += 1
                    if skipped > tc.nonfinite_skip:
                        raise NonFiniteTraining(
                            f"step {done}: loss {result.loss}, grad norm {result.grad_norm}: {skipped} non-finite steps, train.nonfinite_skip="
                            f"{tc.nonfinite_skip}; stopped, nothing exported (the last checkpoint in {out_dir / 'dcp'} predates it)"
                        )
                    if ranks.rank == 0:
                        log.warning(
                            "step %d: loss %s, grad norm %s: update skipped (%d of train.nonfinite_skip=%d)",
                            done,
                            result.loss,
                            result.grad_norm,
                            skipped,
                            tc.nonfinite_skip,
                        )
                if tc.dcp.every and done % tc.dcp.every == 0 and done < end:
                    require_finite_weights(gen, device, f"step {done}: saving a checkpoint")
                    ckpt.save(gen, opt, RunState(done, position, loss_ema, last))
                step = done
        final = RunState(step, position, loss_ema, last)
        require_finite_weights(gen, device, f"step {step}: the export")
        ckpt.save(gen, opt, final)
        ckpt.wait()  # the step checkpoint holds the last weights (and the EMA): a resume continues from them
        if tc.final_weights == "ema":
            ema.swap_into(gen)
        export_checkpoint(gen, out_dir, cfg, data, final, tc.parallel.tp, ranks.rank, sharded=mesh is not None)
        if ranks.rank == 0:
            if tc.final_weights == "pma":
                from training.core.pma import export_pma

                export_pma(out_dir, tc.pma_k, tc.dcp.trust_unsigned)
            write_data_record(out_dir, data_dir, data, cfg, final.step, version)
            write_export_manifest(out_dir)  # last: the folder is complete when its checksums are
        if telemetry is not None:
            summary = telemetry.finish()
            log.info(
                "train: done at step %d, final loss %s, %.1f samples/s, %.0f tokens/s, MFU %s",
                step,
                last,
                summary["samples_per_s"],
                summary["tokens_per_s"],
                summary["mfu"],
            )
        if dist.is_initialized():
            dist.barrier()
    except BaseException:
        if ckpt is not None:  # let a pending save of an earlier, good step finish, without collectives
            try:
                ckpt.close()
            except Exception as e:  # the original error matters more
                log.warning("train: the pending checkpoint save failed too: %s", e)
        raise
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
    return out_dir
