"""Small real inputs for training tests and benchmarks: hand-made TRAIN rows and a micro-model config.

Rows are demo scenes drawn by components.demo_scenes.render with their true captions, packed the way the
pack stage packs them (one bucket per batch, pre-shuffled order), and written as a train set's shards.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from kiln.config import KilnConfig
from kiln.sampling import FORMS, dump_forms
from kiln.schemas import TRAIN
from kiln.trainshards import encode_image, train_samples, write_train_set


def scene_rows(
    n: int,
    seed: int = 0,
    buckets: tuple[tuple[int, int], ...] = ((32, 32),),
    batch_size: int = 8,
    weights: Sequence[float] | None = None,
) -> pa.Table:
    """`n` single-shape scenes; rows cycle through `buckets` and every batch holds one bucket. Each row
    carries the rule rewriter's caption forms and its sampling weight (`weights[i]`, default 1)."""
    from components.demo_scenes import sample_scene

    rng = np.random.default_rng(seed)
    by_bucket: dict[tuple[int, int], list[dict]] = {b: [] for b in buckets}
    for i in range(n):
        h, w = buckets[i % len(buckets)]
        row = scene_train_row(f"row{i:05d}", sample_scene(rng, "single_shape"), h, w)
        by_bucket[(h, w)].append(row | {"sampling_weight": 1.0 if weights is None else float(weights[i])})
    batches = [rows[k : k + batch_size] for rows in by_bucket.values() for k in range(0, len(rows), batch_size)]
    order = rng.permutation(len(batches))
    out, pos = [], 0
    for b, idx in enumerate(order):
        for r in batches[idx]:
            out.append(r | {"batch": b, "order": pos})
            pos += 1
    return pa.Table.from_pylist(out, schema=TRAIN)


EXPANDER_PAIRS = [  # short user prompt -> the grammar's full caption: a two-row SFT set for the prompt expander
    {
        "id": "a",
        "prompt": "red circle",
        "target": "a large red circle on the left, on a blue background",
        "sampling_weight": 1.0,
    },
    {
        "id": "b",
        "prompt": "green square",
        "target": "a small green square at the top, on a white background",
        "sampling_weight": 1.0,
    },
]


def scene_train_row(row_id: str, scene, height: int, width: int) -> dict:
    """One TRAIN row of a rendered demo scene with its true caption and the rule rewriter's forms (weight 1,
    no batch or order yet: the caller packs it)."""
    from components.demo_scenes import caption_for, render

    pixels = np.asarray(render(scene, width, height), dtype=np.uint8)  # render draws RGB
    caption = caption_for(scene)
    return {
        "id": row_id,
        "caption": caption,
        "caption_forms": rule_caption_forms(caption),
        "sampling_weight": 1.0,
        "bucket": f"{height}x{width}",
        "height": height,
        "width": width,
        "image": encode_image(pixels, "png"),
        "crop_left": 0,
        "crop_top": 0,
    }


def rule_caption_forms(caption: str) -> str:
    """The caption forms the offline rule rewriter (assets.rewrite) writes for one caption, as TRAIN stores them."""
    from components.rule_text import rule_forms

    forms = rule_forms(caption, "", short_words=12)
    return dump_forms({f: getattr(forms, f) for f in FORMS})


def write_pack_output(folder: Path, table: pa.Table, shard_bytes: int = 256_000_000) -> Path:
    """A pack-stage-shaped train set (kiln.trainshards): shards of about `shard_bytes`, cut between batches."""
    write_train_set(train_samples(table), folder, "png", shard_bytes)
    return folder


def tiny_config(text_encoder_dir: Path, **train) -> KilnConfig:
    """The micro DiT over a tiny random BERT, and a short, quiet training run."""
    from kiln.config import PostConfig, TrainConfig
    from model.testing import micro_model_config

    fields = {"steps": 30, "batch_size": 8, "lr": 3e-3, "warmup_steps": 3, "holdout": 8, "log_every": 0, "threads": 1}
    fields |= {"sample": {"steps": 4, "n_per_prompt": 2}, "eval": {"steps": 4, "n_per_prompt": 1}}
    fields.update(train)
    return KilnConfig(
        model=micro_model_config(text_encoder_dir),
        train=TrainConfig.model_validate(fields),
        post=PostConfig(judge="demo_pixel"),
    )


def trained_micro_model(root: Path, rows: int, seed: int, steps: int) -> tuple[Path, KilnConfig]:
    """A micro DiT trained `steps` steps on `rows` scenes under `root` (its text encoder and pack beside it):
    the starting checkpoint of the post-training tests, with the config it was trained under."""
    from model.testing import write_tiny_text_encoder
    from training.core.trainer import train

    cfg = tiny_config(write_tiny_text_encoder(root / "text_encoder"), steps=steps)
    return train(write_pack_output(root / "pack", scene_rows(rows, seed=seed)), root / "checkpoint", cfg), cfg


# ------------------------------------------------------------------ where the caption is learned (docs/training.md)
POSITIONS = ("left", "right", "top", "bottom")
LONG_ONLY = {"long": 1.0, "medium": 0.0, "short": 0.0, "tags": 0.0, "json": 0.0}


def one_shape_in_four_places(n: int = 48) -> pa.Table:
    """A red circle on blue at each position; only the position word tells the captions apart."""
    from components.demo_scenes import Background, Scene, Shape

    rng = np.random.default_rng(5)
    rows = []
    for i in range(n):
        scene = Scene(
            "single_shape",
            Background("blue"),
            (Shape("red", "circle", "large", POSITIONS[i % 4]),),
            layout_seed=int(rng.integers(10**6)),
        )
        rows.append(scene_train_row(f"r{i:03d}", scene, 32, 32) | {"batch": i // 8, "order": i})
    return pa.Table.from_pylist(rows, schema=TRAIN)


def red_centroid_at_pure_noise(gen, caption: str) -> tuple[float, float]:
    """(x, y) in [0, 1] of the red in the model's clean-image estimate at t = 1, over 8 noises."""
    import torch

    gen.eval()
    with torch.no_grad():
        noise = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        x0 = (noise - gen(noise, torch.ones(8), gen.encode_text([caption] * 8))).mean(0)
    redness = x0[0] - x0[2]
    red = (redness - redness.mean()).clamp(min=0)  # where it is redder than on average
    ys, xs = torch.meshgrid(torch.linspace(0, 1, 32), torch.linspace(0, 1, 32), indexing="ij")
    return float((red * xs).sum() / red.sum()), float((red * ys).sum() / red.sum())


def where_the_shape_goes(shift: float, data, folder) -> dict[str, tuple[float, float]]:
    """Train the micro DiT (over the shipped MiniLM: a random tiny BERT's words are too alike) at `shift` (every
    resolution), then the red's centroid at t = 1 per position word."""
    from model.generator import Generator
    from model.text_encoder import default_text_encoder_path
    from training.core.trainer import train

    cfg = tiny_config(default_text_encoder_path(), steps=250, holdout=4, timestep_shift=shift, timestep_max_shift=shift)
    cfg = cfg.model_copy(
        update={
            "data": cfg.data.model_copy(
                update={"rewrite": cfg.data.rewrite.model_copy(update={"form_probs": LONG_ONLY})}
            )
        }
    )
    gen = Generator.from_pretrained(train(data, folder, cfg))
    phrases = ("on the left", "on the right", "at the top", "at the bottom")
    return {
        p: red_centroid_at_pure_noise(gen, f"a large red circle {phrase}, on a blue background")
        for p, phrase in zip(POSITIONS, phrases)
    }


def follows_the_caption(where: dict[str, tuple[float, float]]) -> bool:
    """Every position's red is within 0.08 of where the renderer draws it (a quarter in from the side)."""
    from components.demo_scenes import POSITION_XY

    return all(abs(np.subtract(where[p], POSITION_XY[p])).max() < 0.08 for p in POSITIONS)
