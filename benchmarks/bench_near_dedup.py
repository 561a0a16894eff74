"""Near-duplicate search at scale against FAISS's multi-index hashing, same hashes, same radii, same run.

N synthetic hashes with planted duplicates at known distances: pHash bits drawn uniformly (a median-thresholded
DCT sets half of them, roughly independently); a planted copy flips 0..radius pHash bits and 0..color_radius
colour bits of its original. Methods, one thread each, each in its own subprocess (its peak RSS is its own):
- `kiln`: assets.dedup.near_pairs (band tables probed within radius // bands flips, exact by pigeonhole);
- `faiss`: `IndexBinaryMultiHash` over the 144 pHash bits, `nhash` = bands tables of 144 // bands bits probed
  within radius // nhash flips (exact by the same pigeonhole), `range_search` of every hash at the radius
  (FAISS keeps distances strictly below its radius: radius + 1), then the same colour-radius check.
Reports wall time, peak RSS, pairs found and the recall of the planted pairs (both searches are exact: 1.0,
and the two pair sets must be equal). Mirrored copies are not searched (mirror=False) in either. Uses the
library defaults of DedupConfig (web scale), not the demo corpus tuning. `--rounds` interleave (kiln, faiss,
kiln, faiss...) and the figures are medians.

    .venv/bin/python benchmarks/bench_near_dedup.py [--n 1000000] [--planted 10000] [--rounds 1]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from assets.dedup import near_pairs  # noqa: E402
from assets.hashes import COLOR_BYTES, hamming_rows, to_words  # noqa: E402
from kiln.config import DedupConfig  # noqa: E402


def flip_bits(rows: np.ndarray, counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    bits = np.unpackbits(rows, axis=1)
    for r, k in enumerate(counts):
        bits[r, rng.choice(bits.shape[1], int(k), replace=False)] ^= 1
    return np.packbits(bits, axis=1)


def hashes(a: argparse.Namespace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(phash, color, planted pairs as i * n + j) with the copies planted at known distances."""
    rng = np.random.default_rng(0)
    phash = rng.integers(0, 256, (a.n, 18), dtype=np.uint8)
    color = rng.integers(0, 256, (a.n, 8), dtype=np.uint8)
    src = rng.choice(a.n // 2, a.planted, replace=False)
    dst = a.n // 2 + rng.choice(a.n - a.n // 2, a.planted, replace=False)
    phash[dst] = flip_bits(phash[src], rng.integers(0, a.phash_radius + 1, a.planted), rng)
    color[dst] = flip_bits(color[src], rng.integers(0, a.color_radius + 1, a.planted), rng)
    return phash, color, np.minimum(src, dst) * a.n + np.maximum(src, dst)


def faiss_pairs(phash: np.ndarray, color: np.ndarray, phash_radius: int, color_radius: int, nhash: int) -> np.ndarray:
    """The same exact search by FAISS: multi-index hashing on the pHash, then the colour radius on the candidates."""
    import faiss

    faiss.omp_set_num_threads(1)
    index = faiss.IndexBinaryMultiHash(phash.shape[1] * 8, nhash, phash.shape[1] * 8 // nhash)
    index.nflip = phash_radius // nhash
    index.add(phash)
    lims, _, ids = index.range_search(phash, phash_radius + 1)
    i = np.repeat(np.arange(len(phash), dtype=np.int64), np.diff(lims.astype(np.int64)))
    keep = i < ids
    i, j = i[keep], ids[keep]
    cw = to_words(color, COLOR_BYTES)
    close = hamming_rows(cw[i], cw[j]) <= color_radius
    return np.stack([i[close], j[close]], 1)


def one(method: str, a: argparse.Namespace) -> dict:
    phash, color, planted = hashes(a)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if method == "kiln":
        pairs = near_pairs(phash, color, a.phash_radius, a.color_radius, a.bands)
    else:
        pairs = faiss_pairs(phash, color, a.phash_radius, a.color_radius, a.bands)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    keys = np.unique(pairs[:, 0].astype(np.int64) * a.n + pairs[:, 1])
    return {
        "seconds": seconds,
        "peak_rss_gib": peak / 2**20,
        "rss_before_search_gib": rss0 / 2**20,
        "pairs_found": len(keys),
        "recall": float(np.isin(planted, keys).mean()),
        "pairs_digest": hashlib.sha1(keys.tobytes()).hexdigest(),
    }


def main() -> None:
    d = DedupConfig()
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--planted", type=int, default=10_000)
    p.add_argument("--phash-radius", type=int, default=d.phash_radius)
    p.add_argument("--color-radius", type=int, default=d.color_radius)
    p.add_argument("--bands", type=int, default=d.bands)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--one", choices=["kiln", "faiss"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a)))
        return
    runs: dict[str, list[dict]] = {"kiln": [], "faiss": []}
    for r in range(a.rounds):
        for m in ["kiln", "faiss"] if r % 2 == 0 else ["faiss", "kiln"]:
            out = subprocess.run(
                [sys.executable, __file__, "--one", m, *sys.argv[1:]], capture_output=True, text=True, check=True
            )
            runs[m].append(json.loads(out.stdout.strip().splitlines()[-1]))
    res: dict = {
        "bench": "near_dedup",
        "n": a.n,
        "planted": a.planted,
        "phash_radius": a.phash_radius,
        "color_radius": a.color_radius,
        "bands": a.bands,
        "faiss_nhash": a.bands,
        "faiss_bits_per_hash": 144 // a.bands,
        "faiss_nflip": a.phash_radius // a.bands,
        "rounds": a.rounds,
        "threads": 1,
    }
    for m, rs in runs.items():
        res[f"{m}_s"] = round(statistics.median(r["seconds"] for r in rs), 2)
        res[f"{m}_peak_rss_gib"] = round(statistics.median(r["peak_rss_gib"] for r in rs), 3)
        res[f"{m}_rss_before_search_gib"] = round(statistics.median(r["rss_before_search_gib"] for r in rs), 3)
        res[f"{m}_pairs_found"] = rs[0]["pairs_found"]
        res[f"{m}_recall"] = rs[0]["recall"]
    res["ratio_time_faiss_over_kiln"] = round(res["faiss_s"] / res["kiln_s"], 2)
    res["same_pairs"] = runs["kiln"][0]["pairs_digest"] == runs["faiss"][0]["pairs_digest"]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
