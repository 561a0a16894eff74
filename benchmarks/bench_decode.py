"""Decode + every statistic + both hashes (kiln's filter) vs imagehash phash(12) + colorhash alone.

Same JPEGs, same process, one core, interleaved rounds; the figure that matters is the ratio
(the machine is shared, absolute rates are noisy). Two size classes: 256 px and 1024 px.

    .venv/bin/python benchmarks/bench_decode.py [--images 24] [--rounds 3]
"""

from __future__ import annotations

import argparse
import io
import json
import time

import numpy as np
from PIL import Image

from assets.decode import measure
from kiln.config import FilterConfig


def photo_like(seed: int, side: int) -> bytes:
    """Smooth shapes, gradients and fine noise: JPEG-compressible like a photograph, not like noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:side, 0:side] / side
    img = np.stack([80 + 90 * xx, 100 + 80 * yy, 160 - 60 * xx], -1)
    for _ in range(12):
        cx, cy, r = rng.uniform(0, 1, 2).tolist() + [rng.uniform(0.03, 0.25)]
        img[(xx - cx) ** 2 + (yy - cy) ** 2 < r * r] = rng.integers(0, 256, 3)
    img += rng.normal(0, 5, img.shape)
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def kiln_all(data: bytes, side: int, f: FilterConfig) -> None:
    measure(data, side, side, 0, f.decode_size, f.stats_size)


def imagehash_pair(data: bytes, side: int, f: FilterConfig) -> None:
    import imagehash

    im = Image.open(io.BytesIO(data))
    imagehash.phash(im, hash_size=12)
    imagehash.colorhash(im)


def rate(fn, files: list[bytes], side: int, f: FilterConfig) -> float:
    t0 = time.perf_counter()
    for data in files:
        fn(data, side, f)
    return len(files) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--images", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    f = FilterConfig()
    out: dict[str, float | int] = {"images": a.images, "rounds": a.rounds}
    for side in (256, 1024):
        files = [photo_like(i, side) for i in range(a.images)]
        kiln_all(files[0], side, f), imagehash_pair(files[0], side, f)  # warm imports and caches
        k, ih = [], []
        for _ in range(a.rounds):  # interleaved, best of rounds: least disturbed by other load
            k.append(rate(kiln_all, files, side, f))
            ih.append(rate(imagehash_pair, files, side, f))
        out[f"kiln_{side}px_img_per_s"] = round(max(k), 1)
        out[f"imagehash_{side}px_img_per_s"] = round(max(ih), 1)
        out[f"ratio_{side}px"] = round(max(k) / max(ih), 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
