"""Peak memory of the pack stage against the number of rows: it must not hold the images it writes.

Each size is a REWRITTEN table of `rows` rows whose images are a pool of 64 rendered demo scenes (512 x 384
PNG files; a larger table repeats the pool's files under new ids: the stage neither knows nor cares), packed
at 256 px into the train set's shards by `run_stage("pack", ...)` in a fresh process. Reported: the child's
peak RSS, the train set's bytes (what a pack that held its encoded images, as kiln's did before, would have
held at the end), and the ratio of the largest size's peak to the smallest's (target: within 1.15; the rows'
metadata, about 1 KB a row, is all that may grow).

    .venv/bin/python benchmarks/bench_pack_memory.py [--rows 500 5000] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

POOL, W, H = 64, 512, 384

CHILD = """
import sys
from kiln.config import load_config
from kiln.stage import run_stage
run_stage("pack", sys.argv[1], sys.argv[2], load_config(["data.pack.resolution=256", f"cluster.workers={sys.argv[3]}"]))
"""


def build_input(root: Path, rows: int) -> Path:
    import numpy as np
    import pyarrow as pa

    from components.demo_scenes import caption_for, render, sample_scene
    from kiln.schemas import REWRITTEN
    from kiln.stage import write_table

    rng = np.random.default_rng(0)
    pool = []
    for k in range(POOL):
        scene = sample_scene(rng, "single_shape")
        path = root / "img" / f"{k:03d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        render(scene, W, H).save(path)
        pool.append((str(path), caption_for(scene)))
    out = []
    for i in range(rows):
        uri, caption = pool[i % POOL]
        out.append({
            "id": f"row{i:08d}", "uri": uri, "bytes": 0, "md5": "", "format": "PNG", "width": W, "height": H,
            "mode": "RGB", "exif_orientation": 1, "n_frames": 1, "aspect": W / H, "laplacian_var": 300.0,
            "entropy": 5.5, "white_ratio": 0.0, "black_ratio": 0.0, "border_share": 0.0, "flat_share": 0.2,
            "phash": bytes(18), "colorhash": bytes(8), "dup_group": f"row{i:08d}", "ocr_text": "", "ocr_boxes": "[]",
            "ocr_engine": "bench", "contains_text": False, "text_area_share": 0.0, "text_density": 0.0,
            "text_complexity": 0.0, "min_text_height": 0.0, "caption": caption, "caption_source": "bench",
            "caption_decoding": "{}", "caption_short": caption[:40], "caption_medium": caption[:80],
            "caption_long": caption, "caption_tags": "", "caption_json": "{}", "rewrite_source": "bench",
            "rewrite_decoding": "{}",
        })  # fmt: skip
    write_table(pa.Table.from_pylist(out, schema=REWRITTEN), root / "rewritten" / "part-00000.parquet")
    return root / "rewritten"


def peak_rss_mb(args: list[str]) -> tuple[float, float]:
    """(ru_maxrss in MB, seconds) of the pack stage run as the only child of a fresh interpreter."""
    probe = (
        "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True,"
        " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL);"
        " print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", probe, sys.executable, "-c", CHILD, *args], capture_output=True, text=True, check=True
    )
    return int(out.stdout.split()[-1]) / 1024, time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[500, 5000])
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for rows in args.rows:
            root = Path(tmp) / f"n{rows}"
            inp = build_input(root, rows)
            peak, seconds = peak_rss_mb([str(inp), str(root / "train_set"), str(args.workers)])
            shards = sum(p.stat().st_size for p in (root / "train_set" / "shards").glob("*.tar"))
            results.append(
                {
                    "rows": rows,
                    "peak_rss_mb": round(peak),
                    "seconds": round(seconds, 1),
                    "train_set_mb": round(shards / 1e6, 1),
                }
            )
            print(
                f"{rows:>8} rows: peak {peak:7.0f} MB, {seconds:6.1f} s, train set {shards / 1e6:8.1f} MB", flush=True
            )
    ratio = results[-1]["peak_rss_mb"] / results[0]["peak_rss_mb"]
    print(json.dumps({"sizes": results, "largest_over_smallest": round(ratio, 3)}, indent=1))


if __name__ == "__main__":
    main()
