"""Small real inputs for training tests and benchmarks: hand-made TRAIN rows and a micro-model config.

Rows are demo scenes drawn by assets.demo_scenes.render with their true captions, packed the way the
pack stage packs them (one bucket per batch, pre-shuffled order), and written as a pack output folder.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from kiln.config import KilnConfig
from kiln.schemas import TRAIN
from kiln.stage import write_table


def scene_rows(n: int, seed: int = 0, buckets: tuple[tuple[int, int], ...] = ((32, 32),), batch_size: int = 8) -> pa.Table:
    """`n` single-shape scenes; rows cycle through `buckets` and every batch holds one bucket."""
    from assets.demo_scenes import caption_for, render, sample_scene

    rng = np.random.default_rng(seed)
    by_bucket: dict[tuple[int, int], list[dict]] = {b: [] for b in buckets}
    for i in range(n):
        scene = sample_scene(rng, "single_shape")
        h, w = buckets[i % len(buckets)]
        pixels = np.asarray(render(scene, w, h), dtype=np.uint8)
        by_bucket[(h, w)].append({"id": f"row{i:05d}", "caption": caption_for(scene), "bucket": f"{h}x{w}", "height": h, "width": w, "pixels": pixels.tobytes()})
    batches = [rows[k : k + batch_size] for rows in by_bucket.values() for k in range(0, len(rows), batch_size)]
    order = rng.permutation(len(batches))
    out, pos = [], 0
    for b, idx in enumerate(order):
        for r in batches[idx]:
            out.append(r | {"batch": b, "order": pos})
            pos += 1
    return pa.Table.from_pylist(out, schema=TRAIN)


def write_pack_output(folder: Path, table: pa.Table, shard_rows: int = 64) -> Path:
    """A pack-stage-shaped folder: folder/kept/part-*.parquet."""
    for k, start in enumerate(range(0, table.num_rows, shard_rows)):
        write_table(table.slice(start, shard_rows), folder / "kept" / f"part-{k:05d}.parquet")
    return folder


def tiny_config(text_encoder_dir: Path, **train) -> KilnConfig:
    """The micro DiT over a tiny random BERT, and a short, quiet training run."""
    from model.testing import micro_model_config

    from kiln.config import TrainConfig

    fields = {"steps": 30, "batch_size": 8, "lr": 3e-3, "warmup_steps": 3, "holdout": 8, "log_every": 0, "threads": 1}
    fields |= {"sample": {"steps": 4, "n_per_prompt": 2}, "eval": {"steps": 4, "n_per_prompt": 1}}
    fields.update(train)
    return KilnConfig(model=micro_model_config(text_encoder_dir), train=TrainConfig.model_validate(fields))
