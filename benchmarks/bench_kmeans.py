"""The cluster stage's k-means at the product's settings next to scikit-learn's Lloyd KMeans with equal restarts.

Data: N x D float32 drawn around 64 Gaussian centres, L2-normalised (like embeddings). Methods, all with the
same k, iteration cap (`--niter`, the product's 25), restarts (`--nredo`, the product's 5), seed and threads:
- `kiln`: assets.cluster.kmeans as the stage calls it (spherical FAISS, data.clustering.kmeans_tol);
- `kiln_fixed_point`: the same with tol=0, which stops only when an iteration changes nothing;
- `sklearn`: `KMeans(init="random", n_init=nredo, max_iter=niter, algorithm="lloyd")` (its own tol, 1e-4).

Each run is its own subprocess (its peak RSS is its own); rounds interleave the methods (A, B, C, A, B, C...)
and the figures are medians over rounds. Quality, computed the same way for all: the mean cosine of every row
to its nearest centroid (centroids unit-normalised: the spherical objective, higher is better) and the inertia
against those unit centroids (sum of squared distances, lower is better); sklearn's own Euclidean inertia too.
Prints one JSON line; `ratio_*` are sklearn / kiln (above 1: kiln is faster).

    .venv/bin/python benchmarks/bench_kmeans.py [--n 20000] [--dim 768] [--k 128] [--niter 25] [--nredo 5] [--threads 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

METHODS = ("kiln", "kiln_fixed_point", "sklearn")


def data(n: int, dim: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((64, dim), dtype=np.float32)
    x = np.empty((n, dim), np.float32)
    for a in range(0, n, 16384):  # float32 chunks: the data's own footprint is n * dim * 4 bytes
        b = min(n, a + 16384)
        x[a:b] = centres[rng.integers(0, 64, b - a)] + 0.7 * rng.standard_normal((b - a, dim), dtype=np.float32)
        x[a:b] /= np.linalg.norm(x[a:b], axis=1, keepdims=True)
    return x


def quality(x: np.ndarray, centroids: np.ndarray) -> dict:
    c = np.asarray(centroids, np.float32)
    c = c / np.maximum(np.linalg.norm(c, axis=1, keepdims=True), 1e-12)
    best = np.concatenate([(x[a : a + 8192] @ c.T).max(axis=1) for a in range(0, len(x), 8192)])
    return {"mean_cosine": float(best.mean()), "inertia_unit": float((2.0 - 2.0 * best).sum())}


def one(method: str, a: argparse.Namespace) -> dict:
    x = data(a.n, a.dim)
    rss_data = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    from sklearn.cluster import KMeans  # imports before the clock starts
    from threadpoolctl import threadpool_limits

    from assets.cluster import kmeans
    from kiln.config import ClusteringConfig

    extra: dict = {}
    t0, c0 = time.perf_counter(), time.process_time()
    if method in ("kiln", "kiln_fixed_point"):
        tol = ClusteringConfig().kmeans_tol if method == "kiln" else 0.0
        centroids, _ = kmeans(x, a.k, a.niter, seed=0, threads=a.threads, nredo=a.nredo, tol=tol)
        extra["tol"] = tol
    else:
        with threadpool_limits(a.threads):
            km = KMeans(a.k, init="random", n_init=a.nredo, max_iter=a.niter, algorithm="lloyd", random_state=0).fit(x)
        centroids = km.cluster_centers_
        extra = {"sklearn_inertia": float(km.inertia_), "sklearn_n_iter": int(km.n_iter_)}
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before the quality search
    return {
        "seconds": seconds,
        "cpu_s": cpu,
        "peak_rss_mb": peak,
        "data_rss_mb": rss_data,
        **quality(x, centroids),
        **extra,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=20_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--k", type=int, default=128)
    p.add_argument("--niter", type=int, default=25)
    p.add_argument("--nredo", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--one", choices=METHODS, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a)))
        return
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(a.threads),
        "OPENBLAS_NUM_THREADS": str(a.threads),
        "MKL_NUM_THREADS": str(a.threads),
    }
    runs: dict[str, list[dict]] = {m: [] for m in METHODS}
    for r in range(a.rounds):
        for m in METHODS[r % 3 :] + METHODS[: r % 3]:  # interleaved, the order rotating
            out = subprocess.run(
                [sys.executable, __file__, "--one", m, *sys.argv[1:]],
                capture_output=True,
                text=True,
                env=env,
                check=True,
            )
            runs[m].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {m: {key: statistics.median(run[key] for run in rs) for key in rs[0]} for m, rs in runs.items()}
    res: dict = {
        "bench": "kmeans",
        "n": a.n,
        "dim": a.dim,
        "k": a.k,
        "niter": a.niter,
        "nredo": a.nredo,
        "threads": a.threads,
        "rounds": a.rounds,
        "kiln_tol": med["kiln"]["tol"],
    }
    for m in METHODS:
        res[f"{m}_s"] = round(med[m]["seconds"], 2)
        res[f"{m}_cpu_s"] = round(med[m]["cpu_s"], 2)
        res[f"{m}_mean_cosine"] = round(med[m]["mean_cosine"], 6)
        res[f"{m}_inertia_unit"] = round(med[m]["inertia_unit"], 1)
        res[f"{m}_peak_rss_mb"] = round(med[m]["peak_rss_mb"])
    res["sklearn_inertia"] = round(med["sklearn"]["sklearn_inertia"], 1)
    res["sklearn_n_iter"] = med["sklearn"]["sklearn_n_iter"]
    res["data_rss_mb"] = round(med["kiln"]["data_rss_mb"])
    for m in ("kiln", "kiln_fixed_point"):
        res[f"ratio_time_sklearn_over_{m}"] = round(med["sklearn"]["seconds"] / med[m]["seconds"], 2)
        res[f"ratio_cpu_sklearn_over_{m}"] = round(med["sklearn"]["cpu_s"] / med[m]["cpu_s"], 2)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
