"""Peak memory of `kiln train` against the number of rows in the train set: it must not grow with the data.

Each size is a train set of 128-px images in the pack stage's shard format (kiln.trainshards), built from a
pool of 400 rendered demo scenes (a larger set repeats the pool's images under new ids: the reader neither
knows nor cares), trained for 12 steps in a fresh process with the demo's model settings. Reported: the
process's peak RSS (ru_maxrss of the child), and, to say where the memory goes, the RSS of a process that only
runs the same steps on random tensors already in memory (the floor every run pays: imports, weights,
optimiser state, activations), and at the smallest size the same run with REPA off and with no caption
prefill (what each adds). The figure that matters is the ratio of the largest set's peak to the smallest's
(target: within 1.15).

    .venv/bin/python benchmarks/bench_train_memory.py [--rows 400 10000 100000] [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from kiln.config import load_config

SIDE = 128
POOL = 400
VARIANTS = {"repa_off": ["train.repa.teacher_path=null"], "no_prefill": ["train.text_prefill_rows=0"]}


def build_set(root: Path, rows: int) -> Path:
    from kiln.trainshards import Sample, write_train_set
    from training.testing import scene_rows

    pool = scene_rows(POOL, seed=0, buckets=((SIDE, SIDE),), batch_size=32).to_pylist()

    def samples():
        for k in range(rows):
            r = pool[k % POOL]
            yield Sample(
                f"row{k:07d}", r["caption"], r["caption_forms"], 1.0, r["bucket"], SIDE, SIDE, r["image"], k // 32
            )

    write_train_set(samples(), root, "png", 256_000_000)
    return root


def peak_rss_mb(cmd: list[str]) -> float:
    """ru_maxrss of `cmd`, run as the only child of a fresh interpreter (so no other child's peak counts)."""
    probe = (
        "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True,"
        " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL);"
        " print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    out = subprocess.run([sys.executable, "-c", probe, *cmd], capture_output=True, text=True, check=True)
    return int(out.stdout.strip()) / 1024


def floor_mb(overrides: list[str], steps: int, batch: int) -> float:
    """The same model's steps on one batch of random 128-px tensors already in memory, no data at all: what the
    step itself costs (weights, optimiser state, activations). REPA off: its teacher would need real images."""
    code = (
        "import sys, torch; from kiln.config import load_config; from training.core.muon import make_optimizer;"
        " from training.core.trainer import Learner, StepBatch, init_generator, setup_runtime, step_generator, train_step;"
        " cfg = load_config(sys.argv[3:]); rt = setup_runtime(cfg.train); gen = init_generator(cfg.model, 0);"
        " opt = make_optimizer(gen, cfg.train); b = int(sys.argv[2]);"
        f" x0 = torch.randn(b, 3, {SIDE}, {SIDE}); text = gen.encode_text(['a red circle on the left'] * b);"
        " [train_step(Learner(gen, opt, cfg.train, rt), StepBatch(x0, text, gen.null_text(b)), step_generator(0, s), 1e-3, 1.0)"
        " for s in range(int(sys.argv[1]))]"
    )
    return peak_rss_mb([sys.executable, "-c", code, str(steps), str(batch), *overrides])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[400, 10_000, 100_000])
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    overrides = [f"train.steps={args.steps}", "train.log_every=0", "train.holdout=8", "train.dcp.every=0"]
    kiln = str(Path(sys.executable).parent / "kiln")
    batch = load_config(overrides).train.batch_size
    results = {"floor_mb": round(floor_mb(overrides, args.steps, batch), 1), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rows in args.rows:
            data = build_set(Path(tmp) / f"set-{rows}", rows)
            shard_mb = sum(f.stat().st_size for f in (data / "shards").glob("*.tar")) / 1e6
            cmd = [kiln, "train", "--data", str(data), "--out", str(Path(tmp) / f"ckpt-{rows}"), *overrides]
            peak = peak_rss_mb(cmd)
            results["runs"].append({"rows": rows, "shards_mb": round(shard_mb, 1), "peak_rss_mb": round(peak, 1)})
            print(f"{rows:>8} rows ({shard_mb:8.1f} MB of shards): peak RSS {peak:8.1f} MB", flush=True)
        smallest = Path(tmp) / f"set-{args.rows[0]}"
        for name, extra in VARIANTS.items():
            cmd = [kiln, "train", "--data", str(smallest), "--out", str(Path(tmp) / name), *overrides, *extra]
            results[f"{name}_mb"] = round(peak_rss_mb(cmd), 1)
            print(f"{args.rows[0]:>8} rows, {name}: peak RSS {results[f'{name}_mb']:8.1f} MB", flush=True)
    runs = results["runs"]
    results["largest_over_smallest"] = round(runs[-1]["peak_rss_mb"] / runs[0]["peak_rss_mb"], 3)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
