"""Demo corpora of seeds other than 0: the settings tuned on the seed-0 demo are tested on corpora they never saw."""

from __future__ import annotations

import contextlib
from pathlib import Path

HELD_OUT_SEEDS = [1, 2, 3]


def held_out_demo(root: Path, seed: int, until: str = "embed", n: int = 160) -> list[str]:
    """`kiln demo-data --n <n> --seed <seed>` through ingest -> filter -> dedup -> embed (-> cluster) under root;
    returns the config overrides that point at it (its truth table, its own review database)."""
    from assets.demo_corpus import write_demo_corpus
    from kiln.config import load_config
    from kiln.stage import run_stage

    write_demo_corpus(root / "raw", n=n, seed=seed, size=96)
    overrides = [
        f"data.caption.truth={root / 'raw' / 'truth.parquet'}",
        f"data.clustering.review_db={root / 'review.duckdb'}",
        "data.clustering.flag=all",
    ]
    cfg = load_config(overrides)
    steps = [
        ("ingest", "raw", "manifest"),
        ("filter", "manifest", "filtered"),
        ("dedup", "filtered", "deduped"),
        ("embed", "deduped", "embedded"),
        ("cluster", "embedded", "clustered"),
    ]
    # ingested by a relative path, as a clone's data/ is: ids (sha1 of the uri) and every id-ordered sample
    # are then the same on every run, not drawn anew with pytest's temporary folder name
    with contextlib.chdir(root):
        for stage, src, dst in steps[: [s[0] for s in steps].index(until) + 1]:
            run_stage(stage, Path(src), Path(dst), cfg)
    return overrides
