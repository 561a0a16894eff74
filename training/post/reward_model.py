"""The aesthetic reward model: a Bradley-Terry head (training/evaluation/rewards.py) on the configured image embedder,
fit on preference pairs, with its accuracy on held-out pairs reported.

Pairs are split by a hash of their id (a fifth held out), so the split does not move when pairs are added.
On the demo the embedder is the offline descriptor (a stand-in, named in the demo profile); a real profile
uses `data.embed.path` (SigLIP / DINO class), the same embedder the curation stages use.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from kiln.config import KilnConfig
from training.evaluation.rewards import BradleyTerry
from training.post.pairs import decode_png, read_pairs


def held_out(pair_id: str, share: float = 0.2) -> bool:
    return int(hashlib.sha1(pair_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < share


def train_reward_model(pairs: Path, out: Path, cfg: KilnConfig, source: str | None = None) -> dict:
    from PIL import Image

    from model.image_encoders import make_embedder

    table = read_pairs(Path(pairs), source)
    if table.num_rows < 2:
        raise ValueError(f"{pairs}: {table.num_rows} pairs; a reward model needs at least 2")
    embedder = make_embedder(cfg.data.embed)
    emb = lambda col: embedder.embed([Image.fromarray(decode_png(b)) for b in table.column(col).to_pylist()])  # noqa: E731
    winners, losers = emb("winner_png"), emb("loser_png")
    test = np.array([held_out(i) for i in table.column("pair_id").to_pylist()])
    if test.all() or not test.any():  # too few pairs for a split: train on all, report no held-out figure
        test = np.zeros(len(test), bool)
    model = BradleyTerry.fit(winners[~test], losers[~test], embedder.name)
    model.save(Path(out))
    report = {
        "pairs": int(table.num_rows),
        "train_pairs": int((~test).sum()),
        "held_out_pairs": int(test.sum()),
        "train_accuracy": round(float(model.prefers(winners[~test], losers[~test]).mean()), 4),
        "held_out_accuracy": round(float(model.prefers(winners[test], losers[test]).mean()), 4) if test.any() else None,
        "embedder": embedder.name,
    }
    (Path(out) / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return report
