"""The streaming loader's throughput against a bare decode loop over the same shards, with the same workers.

The set: 256-px PNG images (a pool of rendered demo scenes repeated under new ids) in the pack stage's shard
format. The reference is the loop a user would write: every shard read front to back, its images decoded by
`workers` threads (`ThreadPoolExecutor.map`), nothing else. kiln is `TrainSet.work` -> `Prefetcher` with the
same threads doing `TrainSet.read` (ranged reads by index, decode, caption form): the plan, the per-rank
rows, the batching. Both yield uint8 arrays; the figure is kiln / reference in images per second (target >= 0.9).
Runs alternate (ref, kiln, ref, ...) and the best of each is kept.

    .venv/bin/python benchmarks/bench_loader.py [--rows 2048 --workers 2 --repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SIDE, POOL, BATCH = 256, 64, 32


def build_set(root: Path, rows: int) -> Path:
    from kiln.trainshards import Sample, write_train_set
    from training.testing import scene_rows

    pool = scene_rows(POOL, seed=0, buckets=((SIDE, SIDE),), batch_size=BATCH).to_pylist()
    samples = (
        Sample(f"row{k:07d}", r["caption"], r["caption_forms"], 1.0, r["bucket"], SIDE, SIDE, r["image"], k // BATCH)
        for k, r in ((k, pool[k % POOL]) for k in range(rows))
    )
    write_train_set(samples, root, "png", 64_000_000)
    return root


def bare_loop(root: Path, workers: int) -> int:
    from kiln.trainshards import Shard, decode_image, read_manifest

    n = 0
    with ThreadPoolExecutor(workers) as pool:
        for info in read_manifest(root).shards:
            shard = Shard(str(root), info)
            images = [image for _, image in shard.read(range(shard.rows))]
            n += sum(1 for _ in pool.map(decode_image, images))
    return n


def kiln_loader(root: Path, workers: int, rows: int) -> int:
    from training.core.data import TrainSet
    from training.core.loader import Prefetcher

    data = TrainSet.from_dir(root, BATCH)
    batches = -(-rows // BATCH)
    with Prefetcher(data.work(0), data.read, workers) as loader:
        return sum(item.size for item in itertools.islice(loader, batches))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    best = {"reference": 0.0, "kiln": 0.0}
    with tempfile.TemporaryDirectory() as tmp:
        root = build_set(Path(tmp) / "set", args.rows)
        for _ in range(args.repeats):
            for name, run in (
                ("reference", lambda: bare_loop(root, args.workers)),
                ("kiln", lambda: kiln_loader(root, args.workers, args.rows)),
            ):
                t0 = time.perf_counter()
                n = run()
                best[name] = max(best[name], n / (time.perf_counter() - t0))
    out = {k: round(v, 1) for k, v in best.items()} | {
        "kiln_over_reference": round(best["kiln"] / best["reference"], 3)
    }
    print(json.dumps({"rows": args.rows, "side": SIDE, "workers": args.workers, "images_per_s": out}, indent=1))


if __name__ == "__main__":
    main()
