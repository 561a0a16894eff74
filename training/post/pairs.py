"""Preference pairs: on-policy samples scored by the reward mix, and human labels, in one Parquet schema.

For each prompt, `pair_k` images are sampled from the checkpoint (the evaluation's ODE sampler with CFG:
the images users would see), scored by the configured rewards, and the best and worst form a pair when
their reward margin is at least `pair_margin`. Each pair records both images, their reward vectors, the
sampling seed and noise index of each, so any pair can be regenerated. Human labels (the annotation
page) become pairs with `source = "human"`, which calibration trains on alone.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kiln.config import KilnConfig

PAIRS = pa.schema([
    ("pair_id", pa.string()), ("prompt", pa.string()), ("source", pa.string()),
    ("winner_png", pa.binary()), ("loser_png", pa.binary()),
    ("winner_reward", pa.float64()), ("loser_reward", pa.float64()),
    ("winner_rewards", pa.string()), ("loser_rewards", pa.string()),  # JSON {reward name: score}
    ("seed", pa.int64()), ("winner_index", pa.int64()), ("loser_index", pa.int64()),
])  # fmt: skip
PAIRS_FILE = "pairs.parquet"


def png(image: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


def decode_png(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def pick_pair(total: np.ndarray, margin: float) -> tuple[int, int] | None:
    """(winner, loser) indices: the highest and lowest total reward, if they differ by at least `margin`
    (ties broken by the lower index, so the choice is deterministic)."""
    ok = np.flatnonzero(~np.isnan(total))
    if len(ok) < 2:
        return None
    w = int(ok[np.argmax(total[ok])])
    lo = int(ok[np.argmin(total[ok])])
    return (w, lo) if total[w] - total[lo] >= margin and w != lo else None


def reward_vector(parts: dict[str, np.ndarray], i: int) -> str:
    """One image's score under each reward, as JSON (null where a reward did not score it)."""
    return json.dumps(
        {k: (None if np.isnan(v[i]) else round(float(v[i]), 6)) for k, v in parts.items()}, sort_keys=True
    )


def make_pairs(checkpoint: Path, out: Path, cfg: KilnConfig) -> dict:
    """On-policy pairs from `checkpoint` into OUT/pairs.parquet; returns counts and mean rewards."""
    from model.generator import Generator
    from training.evaluation.rewards import configured_reward_mix
    from training.evaluation.sampling import checkpoint_resolution, generate, sampling_shift
    from training.post.grpo import check_post_config, rl_prompts

    check_post_config(cfg)
    post = cfg.post
    gen = Generator.from_pretrained(checkpoint)
    h, w = checkpoint_resolution(Path(checkpoint), cfg)
    prompts = rl_prompts(cfg)[: post.pair_prompts]
    mix = configured_reward_mix(cfg)
    rows: dict[str, list] = {f.name: [] for f in PAIRS}
    seed = post.seed
    images = generate(
        gen,
        [p.prompt for p in prompts],
        post.pair_k,
        h,
        w,
        cfg.train.sample.steps,
        cfg.train.sample.cfg_scale,
        seed,
        sampling_shift(gen, h, w, cfg.train),
    )
    considered = 0
    for p_i, (rp, ims) in enumerate(zip(prompts, images, strict=True)):
        total, parts = mix.score(rp, ims)
        considered += 1
        chosen = pick_pair(total, post.pair_margin)
        if chosen is None:
            continue
        wi, li = chosen
        rows["pair_id"].append(f"{seed}:{p_i}:{wi}:{li}")
        rows["prompt"].append(rp.prompt)
        rows["source"].append("on_policy")
        rows["winner_png"].append(png(ims[wi]))
        rows["loser_png"].append(png(ims[li]))
        rows["winner_reward"].append(float(total[wi]))
        rows["loser_reward"].append(float(total[li]))
        rows["winner_rewards"].append(reward_vector(parts, wi))
        rows["loser_rewards"].append(reward_vector(parts, li))
        rows["seed"].append(seed)
        rows["winner_index"].append(p_i * post.pair_k + wi)  # generate()'s noise index: (seed, index) regenerates it
        rows["loser_index"].append(p_i * post.pair_k + li)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table = pa.table(rows, schema=PAIRS)
    pq.write_table(table, out / PAIRS_FILE)
    report = {"prompts": considered, "pairs": table.num_rows, "kept_share": round(table.num_rows / max(considered, 1), 4),
              "winner_reward_mean": float(np.mean(rows["winner_reward"])) if rows["winner_reward"] else None,
              "loser_reward_mean": float(np.mean(rows["loser_reward"])) if rows["loser_reward"] else None}  # fmt: skip
    (out / "pairs.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return report


def read_pairs(folder: Path, source: str | None = None) -> pa.Table:
    """The pairs of a pairs folder, schema-checked; `source` keeps only one kind (calibration: "human")."""
    from kiln.schemas import check_schema

    table = check_schema(pq.read_table(Path(folder) / PAIRS_FILE), PAIRS, f"preference pairs {folder}")
    if source is not None:
        table = table.filter(pa.compute.equal(table.column("source"), source))
    return table
