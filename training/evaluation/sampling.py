"""Samples from a checkpoint: a labelled grid to look at and a Parquet of PNGs to keep.

    out/grid.png         one row per prompt (prompt written at the left), n_per_prompt columns,
                         upscaled nearest-neighbour so 32 px samples are visible
    out/samples.parquet  prompt, seed, index, png: (seed, index) fixes the initial noise of that image

A checkpoint with its own sampler settings (a distilled student: CHECKPOINT/sampler.json, `SamplerSettings`)
is sampled with them instead of train.sample's steps and CFG scale.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from PIL import Image

from kiln.config import KilnConfig, TrainConfig
from kiln.stage import write_table
from training.core.data import bucket_size
from training.core.objective import num_image_tokens, timestep_shift
from training.core.plots import sample_grid

SAMPLES = pa.schema([("prompt", pa.string()), ("seed", pa.int64()), ("index", pa.int64()), ("png", pa.binary())])


def demo_prompt_texts() -> list[str]:
    from components.demo_scenes import demo_prompts

    return [p.prompt for p in demo_prompts()]


def read_prompts(prompts_file: str | Path | None) -> list[str]:
    """One prompt a line (blank lines and #-comments skipped); None = the demo prompts."""
    if prompts_file is None:
        return demo_prompt_texts()
    lines = Path(prompts_file).read_text().splitlines()
    prompts = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    if not prompts:
        raise ValueError(f"{prompts_file}: no prompts")
    return prompts


def checkpoint_resolution(checkpoint: Path, cfg: KilnConfig) -> tuple[int, int]:
    """(height, width) the checkpoint was trained at: its main bucket, else the pack resolution."""
    from training.core.checkpoint import STATE_FILE, read_train_state

    if (Path(checkpoint) / STATE_FILE).exists():
        return bucket_size(read_train_state(Path(checkpoint)).bucket)
    return cfg.data.pack.resolution, cfg.data.pack.resolution


def sampling_shift(gen, height: int, width: int, train: TrainConfig) -> float:
    """train.sample.shift when set (an inference shift apart from the training one), else the same
    resolution-dependent shift the trainer drew timesteps with."""
    if train.sample.shift is not None:
        return train.sample.shift
    p = gen.dit_cfg.patch_size * gen.autoencoder.downsample
    return timestep_shift(num_image_tokens(height, width, p), train.timestep_shift, train.timestep_max_shift)


SAMPLER_FILE = "sampler.json"


@dataclass(frozen=True)
class SamplerSettings:
    """How a checkpoint is meant to be sampled when that differs from the config (a distilled student):
    Euler steps, CFG scale (1 = no CFG) and the timestep shift it was trained for (None = from the config)."""

    steps: int
    cfg_scale: float = 1.0
    shift: float | None = None


def write_sampler_settings(checkpoint: Path, settings: SamplerSettings, **facts) -> Path:
    """CHECKPOINT/sampler.json: the settings, plus `facts` (provenance) that readers ignore."""
    path = Path(checkpoint) / SAMPLER_FILE
    path.write_text(json.dumps(asdict(settings) | facts, indent=2, sort_keys=True) + "\n")
    return path


def read_sampler_settings(checkpoint: Path) -> SamplerSettings | None:
    """The checkpoint's own sampler settings, or None when it has none (sample it as the config says)."""
    path = Path(checkpoint) / SAMPLER_FILE
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    try:
        settings = SamplerSettings(
            int(raw["steps"]),
            float(raw.get("cfg_scale", 1.0)),
            None if raw.get("shift") is None else float(raw["shift"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not sampler settings ({e!r}); expected steps, cfg_scale, shift") from None
    if settings.steps < 1 or settings.cfg_scale < 0 or (settings.shift is not None and settings.shift <= 0):
        raise ValueError(f"{path}: steps must be >= 1, cfg_scale >= 0 and shift > 0, got {settings}")
    return settings


def with_sampler_settings(cfg: KilnConfig, own: SamplerSettings | None) -> KilnConfig:
    """`cfg` with a checkpoint's own steps and CFG scale in train.sample and train.eval, where the evaluation
    reads them (its shift still comes from train: the same as the student's under the config it was made with)."""
    if own is None:
        return cfg
    t = cfg.train
    train = t.model_copy(
        update={
            "sample": t.sample.model_copy(update={"steps": own.steps, "cfg_scale": own.cfg_scale}),
            "eval": t.eval.model_copy(update={"steps": own.steps}),
        }
    )
    return cfg.model_copy(update={"train": train})


def generate(
    gen,
    prompts: Sequence[str],
    n_per_prompt: int,
    height: int,
    width: int,
    steps: int,
    cfg_scale: float,
    seed: int,
    shift: float,
) -> np.ndarray:
    """uint8 [P, N, H, W, 3]: image j of prompt i uses noise row i * N + j of `seed`."""
    from model.sampler import sample

    flat = [p for p in prompts for _ in range(n_per_prompt)]
    images = sample(gen, flat, height, width, steps=steps, cfg_scale=cfg_scale, seed=seed, shift=shift)
    return images.reshape(len(prompts), n_per_prompt, height, width, 3)


def png(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


def samples_table(
    images: np.ndarray, prompts: Sequence[str], seed: int, expanded: Sequence[str] | None = None
) -> pa.Table:
    """One row per image; with `expanded` (the prompt expander's output per prompt, what the DiT was fed) an
    `expanded_prompt` column beside the prompt as typed."""
    p, n = images.shape[:2]
    rows = {"prompt": [], "seed": [], "index": [], "png": []}
    for i in range(p):
        for j in range(n):
            rows["prompt"].append(prompts[i])
            rows["seed"].append(seed)
            rows["index"].append(i * n + j)
            rows["png"].append(png(images[i, j]))
    if expanded is None:
        return pa.table(rows, schema=SAMPLES)
    rows["expanded_prompt"] = [expanded[i] for i in range(p) for _ in range(n)]
    return pa.table(rows, schema=SAMPLES.append(pa.field("expanded_prompt", pa.string())))


def sample_to_dir(
    checkpoint: Path,
    out: Path,
    cfg: KilnConfig,
    prompts: str | None = None,
    expand: Callable[[list[str]], list[str]] | None = None,
) -> Path:
    """Generate `cfg.train.sample.n_per_prompt` images per prompt at the training resolution; return grid.png.
    `prompts`: a text file, one prompt a line (default: the demo prompts). `expand`: a prompt expander
    (training.expander.sft.expander_from: `kiln sample --expand DIR`); each prompt is expanded first, the DiT
    draws the expansion, and samples.parquet records it (`expanded_prompt`)."""
    from model.generator import Generator
    from training.core.runtime import setup_runtime

    sc = cfg.train.sample
    runtime = setup_runtime(cfg.train)
    gen = Generator.from_pretrained(Path(checkpoint), device=runtime.device)
    prompts = read_prompts(prompts)
    height, width = checkpoint_resolution(Path(checkpoint), cfg)
    own = read_sampler_settings(Path(checkpoint))
    steps, cfg_scale = (own.steps, own.cfg_scale) if own else (sc.steps, sc.cfg_scale)
    shift = own.shift if own and own.shift is not None else sampling_shift(gen, height, width, cfg.train)
    expanded = expand(prompts) if expand is not None else None
    with torch.no_grad():
        images = generate(gen, expanded or prompts, sc.n_per_prompt, height, width, steps, cfg_scale, sc.seed, shift)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_table(samples_table(images, prompts, sc.seed, expanded), out / "samples.parquet")
    grid_path = out / "grid.png"
    sample_grid(images, prompts).save(grid_path, format="PNG")
    return grid_path
