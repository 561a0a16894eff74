"""FAISS k-means (the cluster stage's engine) next to scikit-learn's MiniBatchKMeans, same data, same settings.

Data: N x D float32 drawn around 64 Gaussian centres, L2-normalised (like embeddings). Each method runs
in its own subprocess so that its peak RSS is its own; both get the same threads, k, iterations and
seed. Quality: the mean squared distance of every row to its nearest centroid (lower is better),
computed the same way for both. Prints one JSON line; `ratio_*` are sklearn / faiss.

    .venv/bin/python benchmarks/bench_kmeans.py [--n 200000] [--dim 768] [--k 256] [--niter 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np


def data(n: int, dim: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((64, dim), dtype=np.float32)
    x = np.empty((n, dim), np.float32)
    for a in range(0, n, 16384):  # float32 chunks: the data's own footprint is n * dim * 4 bytes
        b = min(n, a + 16384)
        x[a:b] = centres[rng.integers(0, 64, b - a)] + 0.7 * rng.standard_normal((b - a, dim), dtype=np.float32)
        x[a:b] /= np.linalg.norm(x[a:b], axis=1, keepdims=True)
    return x


def mse(x: np.ndarray, centroids: np.ndarray) -> float:
    import faiss

    index = faiss.IndexFlatL2(x.shape[1])
    index.add(np.ascontiguousarray(centroids, np.float32))
    d, _ = index.search(x, 1)
    return float(d.mean())


def one(method: str, a: argparse.Namespace) -> dict:
    x = data(a.n, a.dim)
    rss_data = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    if method == "faiss":
        import faiss

        faiss.omp_set_num_threads(a.threads)
        km = faiss.Kmeans(a.dim, a.k, niter=a.niter, seed=0, verbose=False, max_points_per_centroid=1 << 30)
        km.train(x)
        centroids = km.centroids
    else:
        from sklearn.cluster import MiniBatchKMeans
        from threadpoolctl import threadpool_limits

        with threadpool_limits(a.threads):
            km = MiniBatchKMeans(a.k, max_iter=a.niter, n_init=1, batch_size=4096, random_state=0).fit(x)
        centroids = km.cluster_centers_
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"seconds": seconds, "peak_rss_mb": peak,
            "data_rss_mb": rss_data, "mse": mse(x, centroids)}  # peak measured before the mse search


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--k", type=int, default=256)
    p.add_argument("--niter", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--one", choices=["faiss", "sklearn"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    res = {}
    for method in ("faiss", "sklearn"):
        out = subprocess.run([sys.executable, __file__, "--one", method, *sys.argv[1:]], capture_output=True, text=True, env=env, check=True)
        res[method] = json.loads(out.stdout.strip().splitlines()[-1])
    f, s = res["faiss"], res["sklearn"]
    print(json.dumps({
        "bench": "kmeans", "n": a.n, "dim": a.dim, "k": a.k, "niter": a.niter, "threads": a.threads,
        "faiss_s": round(f["seconds"], 2), "sklearn_minibatch_s": round(s["seconds"], 2),
        "ratio_time": round(s["seconds"] / f["seconds"], 2),
        "faiss_peak_rss_mb": round(f["peak_rss_mb"]), "sklearn_peak_rss_mb": round(s["peak_rss_mb"]),
        "data_rss_mb": round(f["data_rss_mb"]),  # RSS once the data exists; peak - data = the method's own
        "faiss_mse": round(f["mse"], 5), "sklearn_mse": round(s["mse"], 5), "ratio_mse": round(s["mse"] / f["mse"], 3),
    }))


if __name__ == "__main__":
    main()
