"""Near-duplicate search at scale: N synthetic hashes with planted duplicates at known distances.

pHash bits are drawn uniformly (a median-thresholded DCT sets half of them, roughly independently);
a planted copy flips 0..radius pHash bits and 0..color_radius colour bits of its original. Reports
wall time, peak RSS and the recall of the planted pairs (the search is exact, so it must be 1.0).
Uses the library defaults of DedupConfig (web scale), not the demo corpus tuning.

    .venv/bin/python benchmarks/bench_near_dedup.py [--n 1000000] [--planted 10000]
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import numpy as np

from assets.dedup import near_pairs
from kiln.config import DedupConfig


def flip_bits(rows: np.ndarray, counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    bits = np.unpackbits(rows, axis=1)
    for r, k in enumerate(counts):
        bits[r, rng.choice(bits.shape[1], int(k), replace=False)] ^= 1
    return np.packbits(bits, axis=1)


def main() -> None:
    d = DedupConfig()
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--planted", type=int, default=10_000)
    p.add_argument("--phash-radius", type=int, default=d.phash_radius)
    p.add_argument("--color-radius", type=int, default=d.color_radius)
    p.add_argument("--bands", type=int, default=d.bands)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    phash = rng.integers(0, 256, (a.n, 18), dtype=np.uint8)
    color = rng.integers(0, 256, (a.n, 8), dtype=np.uint8)
    src = rng.choice(a.n // 2, a.planted, replace=False)
    dst = a.n // 2 + rng.choice(a.n - a.n // 2, a.planted, replace=False)
    phash[dst] = flip_bits(phash[src], rng.integers(0, a.phash_radius + 1, a.planted), rng)
    color[dst] = flip_bits(color[src], rng.integers(0, a.color_radius + 1, a.planted), rng)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    pairs = near_pairs(phash, color, a.phash_radius, a.color_radius, a.bands)
    seconds = time.perf_counter() - t0
    found = set((pairs[:, 0] * a.n + pairs[:, 1]).tolist())
    planted = np.minimum(src, dst) * a.n + np.maximum(src, dst)
    recall = float(np.mean([int(c) in found for c in planted]))
    print(json.dumps({
        "n": a.n, "planted": a.planted, "phash_radius": a.phash_radius, "color_radius": a.color_radius,
        "bands": a.bands, "seconds": round(seconds, 2), "hashes_per_s": round(a.n / seconds),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        "rss_before_search_gib": round(rss0 / 2**20, 3), "pairs_found": len(pairs), "recall": recall,
    }))


if __name__ == "__main__":
    main()
