"""kiln's filter stage against three references, one thread, the same JPEGs, the same run.

Per image, at each size:
- `kiln_measure`: assets.decode.measure, the stage's decode + every statistic + both hashes;
- `kiln_row`: assets.filters.filter_row on a file, the whole per-row stage (read, md5 and header re-check too);
- `imagehash_full`: imagehash `phash(hash_size=12)` + `colorhash` on a full decode (the untuned baseline);
- `imagehash_draft`: the same on an `Image.draft`-reduced decode to the stage's `decode_size` (the tuned baseline);
- `limit`: that reduced decode alone (open, draft, load): no stage that decodes can go faster.

Ratios are rates over rates, kiln / reference, so above 1 means kiln is faster. Methods are interleaved within
every round (their order rotates) and each figure is the median over rounds of the CPU time of one pass over
the images (`time.process_time`): the machine is shared, and CPU time is the least disturbed by other jobs.

    .venv/bin/python benchmarks/bench_decode.py [--images 12] [--rounds 7] [--sizes 1024x768 3000x2000 256x256]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one thread, before numpy loads

import argparse  # noqa: E402
import hashlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from assets.decode import measure  # noqa: E402
from assets.filters import filter_row  # noqa: E402
from kiln.config import FilterConfig  # noqa: E402
from kiln.imageio import open_header  # noqa: E402


def photo_like(seed: int, width: int, height: int | None = None) -> bytes:
    """Smooth shapes, gradients and fine noise: JPEG-compressible like a photograph, not like noise."""
    height = height or width
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32) / max(width, height)
    img = np.stack([80 + 90 * xx, 100 + 80 * yy, 160 - 60 * xx], -1)
    for _ in range(12):
        cx, cy, r = rng.uniform(0, 1, 2).tolist() + [rng.uniform(0.03, 0.25)]
        img[(xx - cx) ** 2 + (yy - cy) ** 2 < r * r] = rng.integers(0, 256, 3)
    img += rng.normal(0, 5, img.shape).astype(np.float32)
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def reduced_decode(data: bytes, f: FilterConfig) -> Image.Image:
    """The stage's own decode (assets.decode.decode_views): header, DCT-domain reduction to decode_size, load."""
    im = open_header(data)
    im.draft(None, (f.decode_size, f.decode_size))
    im.load()
    return im


def imagehash_pair(im: Image.Image) -> None:
    import imagehash

    imagehash.phash(im, hash_size=12)
    imagehash.colorhash(im)


METHODS = {
    "kiln_measure": lambda item, f: measure(
        item["data"], item["width"], item["height"], 0, f.decode_size, f.stats_size
    ),
    "kiln_row": lambda item, f: filter_row(item["row"], f),
    "imagehash_full": lambda item, f: imagehash_pair(Image.open(io.BytesIO(item["data"]))),
    "imagehash_draft": lambda item, f: imagehash_pair(reduced_decode(item["data"], f)),
    "limit": lambda item, f: reduced_decode(item["data"], f),
}
REFERENCES = ("imagehash_full", "imagehash_draft", "limit")


def corpus(n: int, width: int, height: int, folder: Path) -> list[dict]:
    items = []
    for i in range(n):
        data = photo_like(i, width, height)
        path = folder / f"{width}x{height}_{i}.jpg"
        path.write_bytes(data)
        row = {
            "id": path.stem,
            "uri": str(path),
            "format": "JPEG",
            "width": width,
            "height": height,
            "bytes": len(data),
            "md5": hashlib.md5(data).hexdigest(),
            "exif_orientation": 0,
        }
        items.append({"data": data, "width": width, "height": height, "row": row})
    return items


def pass_seconds(method: str, items: list[dict], f: FilterConfig) -> float:
    fn = METHODS[method]
    t0 = time.process_time()
    for item in items:
        fn(item, f)
    return time.process_time() - t0


def bench_size(items: list[dict], rounds: int, f: FilterConfig) -> dict:
    names = list(METHODS)
    for name in names:  # warm imports, caches and the page cache
        pass_seconds(name, items[:1], f)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order every round
            seconds[name].append(pass_seconds(name, items, f))
    rate = {name: len(items) / statistics.median(s) for name, s in seconds.items()}
    out: dict[str, float] = {f"{name}_img_per_s": round(v, 1) for name, v in rate.items()}
    for kiln in ("kiln_measure", "kiln_row"):
        for ref in REFERENCES:
            out[f"{kiln}_vs_{ref}"] = round(rate[kiln] / rate[ref], 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--images", type=int, default=12)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--sizes", nargs="+", default=["1024x768", "3000x2000", "256x256"])
    a = p.parse_args()
    f = FilterConfig()
    out: dict = {
        "bench": "decode",
        "images": a.images,
        "rounds": a.rounds,
        "timer": "process CPU time, median of rounds",
        "decode_size": f.decode_size,
        "stats_size": f.stats_size,
    }
    with tempfile.TemporaryDirectory() as tmp:
        for size in a.sizes:
            w, h = (int(v) for v in size.split("x"))
            out[size] = bench_size(corpus(a.images, w, h, Path(tmp)), a.rounds, f)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
