"""A first evaluation of a checkpoint, written to out/metrics.json.

heldout_loss    flow-matching loss on the rows the trainer held out, at fixed timesteps with fixed
                noise per row (seeded by the row id): deterministic and comparable across checkpoints
prompt_following per-attribute accuracy of generated images under the rubric (post.eval_prompts, post.judge; training.evaluation.rubric)
baseline        the same two measures for the untrained model (same config, same init seed), so the
                numbers show what training bought
throughput      the training run's samples/s and tokens/s (throughput.json), next to the quality
distribution    FID / CMMD / DINO-MMD of trained and untrained samples against the dataset's reference
                images (training.evaluation.protocol), for the extractors configured in `metrics.*`; the
                protocol's setup (prompts, seed, steps, CFG, dataset version, extractors) is recorded
history         one row per checkpoint step in out/history.csv (+ history.png, + the kept copy at
                `metrics.history`)
headline        out/headline.json: the few numbers `dvc metrics show` prints (a subset of metrics.json),
                and out/prompt_following.png, the per-attribute bars beside the baseline
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from kiln.config import KilnConfig
from kiln.progress import log
from training.core.checkpoint import read_train_state
from training.core.data import decode_pixels, holdout_ids, read_heldout, read_train_rows, train_ids
from training.core.objective import flow_loss
from training.core.plots import sample_grid
from training.evaluation.protocol import evaluate_distribution, record
from training.evaluation.sampling import (
    checkpoint_resolution,
    generate,
    read_sampler_settings,
    sampling_shift,
    with_sampler_settings,
)


def row_noise(row_id: str, seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Noise for one row that depends only on (row id, seed): the same row gets the same noise in every eval."""
    s = int.from_bytes(hashlib.sha1(f"{seed}:{row_id}".encode()).digest()[:8], "little") & (2**63 - 1)
    return torch.randn(shape, generator=torch.Generator().manual_seed(s))


def heldout_rows(data_dir: Path, n: int, checkpoint: Path | None = None) -> tuple[pa.Table, bool]:
    """The rows the checkpoint's run held out (its heldout.json: inherited down a ladder, so `data_dir` may be
    an earlier rung's train set), else the trainer's rule with the same n; when nothing was held out, the
    same-rule rows of the training set, flagged as not held out."""
    recorded = read_heldout(checkpoint)
    if recorded:
        chosen, held = {i for i in train_ids(data_dir) if i in recorded}, True
    else:
        chosen, held = holdout_ids(train_ids(data_dir), n if n > 0 else 32), n > 0
    if not chosen:
        raise ValueError(
            f"none of the rows {checkpoint} held out are in {data_dir}: evaluate on the first ladder rung's train set"
        )
    return read_train_rows(data_dir, chosen).sort_by("id"), held


@torch.no_grad()
def heldout_loss(gen, rows: pa.Table, timesteps: list[float], seed: int) -> dict[str, float]:
    """Mean v-prediction MSE over rows x fixed timesteps (captions kept), and per timestep."""
    device = gen.device
    gen.eval()
    per_t: dict[float, list[float]] = {t: [] for t in timesteps}
    for bucket in sorted(set(rows.column("bucket").to_pylist())):
        part = rows.filter(pc.equal(rows.column("bucket"), bucket))
        x0 = gen.autoencoder.encode(decode_pixels(part)).to(device)
        text = gen.encode_text(part.column("caption").to_pylist())
        eps = torch.stack([row_noise(i, seed, tuple(x0.shape[1:])) for i in part.column("id").to_pylist()]).to(device)
        for t in timesteps:
            tt = torch.full((x0.shape[0],), t, device=device)
            per_t[t].extend(flow_loss(gen, x0, eps, tt, text).cpu().tolist())
    out = {f"t={t:g}": round(float(np.mean(v)), 6) for t, v in per_t.items()}
    out["mean"] = round(float(np.mean([x for v in per_t.values() for x in v])), 6)
    return out


def eval_rubric(cfg: KilnConfig):
    """The evaluation's prompt set and judge: `post.eval_prompts` (a rubric JSONL) or the 12 demo prompts,
    judged by `post.judge` (the demo profile's: the pixel checker, named demo_pixel_checker)."""
    from components.demo_scenes import demo_prompts
    from training.evaluation.rewards import make_judge
    from training.evaluation.rubric import demo_prompt_set, read_prompt_set

    prompts = read_prompt_set(Path(cfg.post.eval_prompts)) if cfg.post.eval_prompts else demo_prompt_set(demo_prompts())
    return prompts, make_judge(cfg.post)


def prompt_following(gen, cfg: KilnConfig, height: int, width: int, rubric=None) -> tuple[dict[str, float], np.ndarray]:
    """Per-requirement-attribute accuracy and `all` (every requirement met) of generated images: the rubric.
    `rubric`: eval_rubric(cfg) when the caller already has it (a VLM judge is loaded once, not per model)."""
    from training.evaluation.rubric import rubric_scores

    prompts, judge = rubric or eval_rubric(cfg)
    ec = cfg.train.eval
    images = generate(
        gen,
        [p.prompt for p in prompts],
        ec.n_per_prompt,
        height,
        width,
        ec.steps,
        cfg.train.sample.cfg_scale,
        ec.seed,
        sampling_shift(gen, height, width, cfg.train),
    )
    return rubric_scores(judge, prompts, images)[1], images


def score(gen, rows: pa.Table, cfg: KilnConfig, height: int, width: int, rubric=None) -> tuple[dict, np.ndarray]:
    loss = heldout_loss(gen, rows, cfg.train.eval.loss_timesteps, cfg.train.eval.seed)
    acc, images = prompt_following(gen, cfg, height, width, rubric)
    return {"heldout_loss": loss, "prompt_following": acc}, images


def sampling_cost(cfg: KilnConfig) -> int:
    """Network evaluations per image under the evaluation's sampler: one per step, two with CFG."""
    return cfg.train.eval.steps * (2 if cfg.train.sample.cfg_scale != 1.0 else 1)


def evaluation_row(checkpoint: Path, data_dir: Path, cfg: KilnConfig, rubric=None) -> tuple[dict, np.ndarray]:
    """One checkpoint of the post-training ladder under the evaluation protocol (its own sampler settings for
    a distilled student): prompt following per attribute, held-out loss on `data_dir`'s held-out rows,
    FID / CMMD / DINO-MMD when extractors are set (None otherwise), and the sampling cost: NFEs and
    seconds per image. `rubric`: eval_rubric(cfg), when the caller scores several checkpoints. Returns (row,
    the prompt-following images)."""
    import time

    from model.generator import Generator

    checkpoint = Path(checkpoint)
    cfg = with_sampler_settings(cfg, read_sampler_settings(checkpoint))
    gen = Generator.from_pretrained(checkpoint).eval()
    height, width = checkpoint_resolution(checkpoint, cfg)
    rows, _ = heldout_rows(Path(data_dir), read_train_state(checkpoint).holdout, checkpoint)
    t0 = time.perf_counter()
    acc, images = prompt_following(gen, cfg, height, width, rubric)
    seconds = (time.perf_counter() - t0) / max(images.shape[0] * images.shape[1], 1)
    distribution, _ = evaluate_distribution({"model": gen}, cfg, Path(data_dir), height, width)
    row = {
        "prompt_following": acc,
        "heldout_loss": heldout_loss(gen, rows, cfg.train.eval.loss_timesteps, cfg.train.eval.seed)["mean"],
        "distribution": distribution["model"],
        "nfe_per_image": sampling_cost(cfg),
        "seconds_per_image": round(seconds, 4),
        "sampler": {"steps": cfg.train.eval.steps, "cfg_scale": cfg.train.sample.cfg_scale},
    }
    return row, images


def evaluate(checkpoint: Path, data_dir: Path, out: Path, cfg: KilnConfig) -> dict:
    """Score the checkpoint and its untrained baseline; write out/metrics.json (+ eval_samples.png) and return the metrics."""
    from kiln.config import ModelConfig
    from model.generator import Generator
    from training.core.runtime import init_generator, setup_runtime

    checkpoint, out = Path(checkpoint), Path(out)
    cfg = with_sampler_settings(cfg, read_sampler_settings(checkpoint))  # a distilled student: its own steps, no CFG
    runtime = setup_runtime(cfg.train)
    state = read_train_state(checkpoint)
    trained_model = ModelConfig.model_validate(
        state.config["model"]
    )  # what the checkpoint was trained from: same model,
    init_seed = int(state.config["train"]["seed"])  # same init seed
    height, width = checkpoint_resolution(checkpoint, cfg)
    rows, is_heldout = heldout_rows(Path(data_dir), state.holdout, checkpoint)

    trained = Generator.from_pretrained(checkpoint, device=runtime.device)
    prompts, judge = rubric = eval_rubric(cfg)  # one judge for both models; its prompts name the grid
    trained_scores, images = score(trained, rows, cfg, height, width, rubric)
    untrained = init_generator(trained_model, init_seed, runtime.device)
    baseline_scores, _ = score(untrained, rows, cfg, height, width, rubric)
    distribution, distribution_setup = evaluate_distribution(
        {"trained": trained, "baseline": untrained}, cfg, Path(data_dir), height, width, str(runtime.device)
    )
    trained_scores["distribution"], baseline_scores["distribution"] = distribution["trained"], distribution["baseline"]

    throughput_file = checkpoint / "throughput.json"
    metrics = {
        "checkpoint": {
            "step": state.step,
            "final_loss": state.final_loss,
            "loss_ema": state.loss_ema,
            "num_params": state.num_params,
            "bucket": state.bucket,
        },
        "heldout": {
            "rows": rows.num_rows,
            "held_out": is_heldout,
            "timesteps": list(cfg.train.eval.loss_timesteps),
            "seed": cfg.train.eval.seed,
        },
        "distribution_setup": distribution_setup,
        "prompt_following_setup": {
            "prompts": images.shape[0],
            "per_prompt": images.shape[1],
            "steps": cfg.train.eval.steps,
            "cfg_scale": cfg.train.sample.cfg_scale,
            "seed": cfg.train.eval.seed,
            "prompt_set": cfg.post.eval_prompts or "demo prompts (components.demo_scenes.demo_prompts)",
            "judge": judge.name,
        },
        **trained_scores,
        "baseline": baseline_scores,
        "throughput": json.loads(throughput_file.read_text()) if throughput_file.exists() else None,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(
        json.dumps({k: v for k, v in metrics.items() if k != "throughput"}, indent=2, sort_keys=True) + "\n"
    )
    (out / "throughput.json").write_text(
        json.dumps(metrics["throughput"], indent=2, sort_keys=True) + "\n"
    )  # wall-clock: outside the hashes
    sample_grid(images, [p.prompt for p in prompts]).save(out / "eval_samples.png", format="PNG")
    record(metrics, out, cfg)
    log.info(
        "eval: held-out loss %.4f (untrained %.4f), prompt following %s (untrained %s)",
        trained_scores["heldout_loss"]["mean"],
        baseline_scores["heldout_loss"]["mean"],
        trained_scores["prompt_following"],
        baseline_scores["prompt_following"],
    )
    return metrics
