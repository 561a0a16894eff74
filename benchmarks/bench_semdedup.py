"""Semantic dedup (pairs at cosine >= threshold inside leaf clusters) against FAISS range search at the same
threshold, on the same vectors in the same run; and the default (classical) embedder's images per second.

Vectors: N x D L2-normalised, float16-rounded, in leaves of about `leaf` rows, with planted near-copies.
- `kiln`: assets.semdedup.leaf_pairs, the stage's search (one matrix product per leaf);
- `faiss_leaf`: FAISS `IndexFlatIP.range_search` inside each leaf: the same pairs, FAISS's engine;
- `faiss_all`: FAISS range search over all N rows: every pair at the threshold, leaves or not. Its pairs
  measure what restricting the search to leaves costs (`kiln_recall_of_all_pairs`).
FAISS keeps similarities strictly above its radius, so the radius is the float32 just below the threshold
(the stage keeps >=). One thread each; `--rounds` interleaved repeats, medians. Embedding: `images` demo
scenes rendered at 96 px, one thread. Prints one JSON line.

    .venv/bin/python benchmarks/bench_semdedup.py [--n 20000] [--dim 768] [--leaf 200] [--rounds 3] [--images 300]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one thread, before numpy loads

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from assets.semdedup import leaf_pairs  # noqa: E402


def vectors(n: int, dim: int, leaf: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    leaves = n // leaf
    centres = rng.normal(size=(leaves, dim)).astype(np.float32)
    labels = np.repeat(np.arange(leaves), leaf)[:n]
    x = centres[labels] + rng.normal(size=(n, dim)).astype(np.float32)
    x[1::50] = x[0::50][: len(x[1::50])] + 0.01 * rng.normal(size=(len(x[1::50]), dim)).astype(
        np.float32
    )  # planted copies
    labels[1::50] = labels[0::50][: len(labels[1::50])]
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(np.float16).astype(np.float32), labels


def range_pairs(x: np.ndarray, threshold: float) -> np.ndarray:
    """(i < j) pairs of rows of x at inner product >= threshold, by FAISS range search (one thread)."""
    import faiss

    faiss.omp_set_num_threads(1)
    index = faiss.IndexFlatIP(x.shape[1])
    index.add(x)
    lims, _, ids = index.range_search(x, float(np.nextafter(np.float32(threshold), np.float32(-1))))
    rows = np.repeat(np.arange(len(x)), np.diff(lims.astype(np.int64)))
    keep = rows < ids
    return np.stack([rows[keep], ids[keep]], 1)


def faiss_leaf_pairs(x: np.ndarray, leaf: np.ndarray, threshold: float) -> np.ndarray:
    order = np.argsort(leaf, kind="stable")
    bounds = [0, *(np.flatnonzero(np.diff(leaf[order])) + 1).tolist(), len(order)]
    found = [
        order[a:b][range_pairs(np.ascontiguousarray(x[order[a:b]]), threshold)]
        for a, b in zip(bounds[:-1], bounds[1:])
        if b - a > 1
    ]
    return np.concatenate(found) if found else np.empty((0, 2), np.int64)


def as_set(pairs: np.ndarray, n: int) -> set[int]:
    p = np.sort(pairs, axis=1)
    return set((p[:, 0].astype(np.int64) * n + p[:, 1]).tolist())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=20_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--leaf", type=int, default=200)
    p.add_argument("--threshold", type=float, default=0.95)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--images", type=int, default=300)
    a = p.parse_args()

    x, labels = vectors(a.n, a.dim, a.leaf)
    methods = {
        "kiln": lambda: leaf_pairs(x, labels, a.threshold)[0],
        "faiss_leaf": lambda: faiss_leaf_pairs(x, labels, a.threshold),
        "faiss_all": lambda: range_pairs(x, a.threshold),
    }
    seconds: dict[str, list[float]] = {m: [] for m in methods}
    found: dict[str, np.ndarray] = {}
    names = list(methods)
    for r in range(a.rounds):
        for m in names[r % 3 :] + names[: r % 3]:  # interleaved, the order rotating
            t0 = time.perf_counter()
            found[m] = methods[m]()
            seconds[m].append(time.perf_counter() - t0)
    med = {m: statistics.median(s) for m, s in seconds.items()}
    sets = {m: as_set(v, a.n) for m, v in found.items()}
    src = 50 * np.arange(len(x[1::50]))
    planted = as_set(np.stack([src, src + 1], 1), a.n)
    compared = sum(c * (c - 1) // 2 for c in np.bincount(labels).tolist())

    import torch

    from components.demo_scenes import render, sample_scene
    from model.image_encoders import ClassicalEmbedder

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    images = [
        render(sample_scene(rng, fam, "color"), 96, 96)
        for fam in (["single_shape", "counted_shapes", "two_shapes", "text_sign", "pattern_background"] * a.images)[
            : a.images
        ]
    ]
    t0 = time.perf_counter()
    ClassicalEmbedder().embed(images)
    embed_s = time.perf_counter() - t0

    print(
        json.dumps(
            {
                "bench": "semdedup",
                "n": a.n,
                "dim": a.dim,
                "leaf": a.leaf,
                "threshold": a.threshold,
                "rounds": a.rounds,
                "pairs_compared_in_leaves": int(compared),
                "planted": len(planted),
                "kiln_s": round(med["kiln"], 3),
                "faiss_leaf_s": round(med["faiss_leaf"], 3),
                "faiss_all_s": round(med["faiss_all"], 3),
                "ratio_faiss_leaf_over_kiln": round(med["faiss_leaf"] / med["kiln"], 2),
                "ratio_faiss_all_over_kiln": round(med["faiss_all"] / med["kiln"], 2),
                "kiln_pairs": len(sets["kiln"]),
                "faiss_leaf_pairs": len(sets["faiss_leaf"]),
                "faiss_all_pairs": len(sets["faiss_all"]),
                "kiln_equals_faiss_leaf": sets["kiln"] == sets["faiss_leaf"],
                "kiln_recall_of_all_pairs": round(
                    len(sets["kiln"] & sets["faiss_all"]) / max(len(sets["faiss_all"]), 1), 4
                ),
                "planted_found_kiln": round(len(planted & sets["kiln"]) / len(planted), 4),
                "embed_images": a.images,
                "embed_images_per_s": round(a.images / embed_s, 1),
                "embedder": "classical@64px",
            }
        )
    )


if __name__ == "__main__":
    main()
