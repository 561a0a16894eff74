"""Semantic dedup throughput (pairs compared per second inside leaf clusters) and embedding throughput
of the default (classical) embedder in images per second.

Semdedup: N x D L2-normalised float16-rounded vectors in leaves of about `leaf` rows, with planted
near-copies; the reference is the all-pairs similarity over the same rows, measured in the same run
on the first `ref_n` rows (ratio = leaf pairs/s over all-pairs pairs/s). Embedding: `images` demo
scenes rendered at 96 px, embedded one process, one thread. Prints one JSON line.

    .venv/bin/python benchmarks/bench_semdedup.py [--n 100000] [--dim 768] [--leaf 200] [--images 300]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from assets.semdedup import leaf_pairs


def vectors(n: int, dim: int, leaf: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    leaves = n // leaf
    centres = rng.normal(size=(leaves, dim)).astype(np.float32)
    labels = np.repeat(np.arange(leaves), leaf)[:n]
    x = centres[labels] + rng.normal(size=(n, dim)).astype(np.float32)
    x[1::50] = x[0::50][: len(x[1::50])] + 0.01 * rng.normal(size=(len(x[1::50]), dim)).astype(np.float32)  # planted copies
    labels[1::50] = labels[0::50][: len(labels[1::50])]
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(np.float16).astype(np.float32), labels


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--leaf", type=int, default=200)
    p.add_argument("--threshold", type=float, default=0.95)
    p.add_argument("--ref-n", type=int, default=8000)
    p.add_argument("--images", type=int, default=300)
    a = p.parse_args()

    x, labels = vectors(a.n, a.dim, a.leaf)
    t0 = time.perf_counter()
    pairs, compared = leaf_pairs(x, labels, a.threshold)
    leaf_s = time.perf_counter() - t0
    xr = x[: a.ref_n]
    t0 = time.perf_counter()
    sims = xr @ xr.T
    np.nonzero(np.triu(sims >= a.threshold, 1))
    ref_s = time.perf_counter() - t0
    ref_pairs = a.ref_n * (a.ref_n - 1) // 2

    import torch

    from assets.demo_scenes import render, sample_scene
    from assets.embed import ClassicalEmbedder

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    images = [render(sample_scene(rng, fam, "color"), 96, 96) for fam in
              (["single_shape", "counted_shapes", "two_shapes", "text_sign", "pattern_background"] * a.images)[: a.images]]
    t0 = time.perf_counter()
    ClassicalEmbedder().embed(images)
    embed_s = time.perf_counter() - t0

    print(json.dumps({
        "bench": "semdedup", "n": a.n, "dim": a.dim, "leaf": a.leaf, "threshold": a.threshold,
        "pairs_compared": compared, "pairs_found": len(pairs), "planted": len(x[1::50]),
        "semdedup_s": round(leaf_s, 3), "pairs_per_s": round(compared / leaf_s),
        "all_pairs_ref_pairs_per_s": round(ref_pairs / ref_s), "ratio_vs_all_pairs": round((compared / leaf_s) / (ref_pairs / ref_s), 3),
        "all_pairs_would_take_s": round(a.n * (a.n - 1) / 2 / (ref_pairs / ref_s), 1),
        "embed_images": a.images, "embed_images_per_s": round(a.images / embed_s, 1), "embedder": "classical@64px",
    }))


if __name__ == "__main__":
    main()
