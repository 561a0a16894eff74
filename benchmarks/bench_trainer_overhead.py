"""The full trainer's step rate against a minimal PyTorch loop on the same model and batches.

The reference is the loop a user would write by hand, in its best configuration on this machine: the same
Generator, text embeddings computed once up front, batches already in memory, AdamW, the flow loss (plus the
REPA term when `train.repa` is on, as in the demo), backward, clip, step, and nothing else; torch uses every
core. kiln is `training.core.trainer.train` as the demo runs it (data stream, read-ahead, telemetry, LR schedule,
the exported checkpoint), once per `train.loader_workers` setting. Steady-state step time is the median over
the steps after a warm-up; start-up (config to the first step: model build, text-embedding cache) and the
export are reported apart. Runs are interleaved (ref, kiln w0, kiln w1, ref, ...) so a noisy machine hits them
alike, and each runs in a fresh process, so none inherits another's allocator state (in one process the later
runs were 10% slower); the figure that matters is ref / kiln, the share of the minimal loop's rate the trainer
keeps.

    .venv/bin/python benchmarks/bench_trainer_overhead.py [--steps 60 --repeats 3 --data PACK] [overrides ...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.config import KilnConfig, load_config

WARMUP = 5  # steps left out of the steady-state median (allocator, first-touch, thread start-up)


def synthetic_pack(folder: Path, rows: int, cfg: KilnConfig) -> Path:
    from training.testing import scene_rows, write_pack_output

    side = cfg.data.pack.resolution
    return write_pack_output(folder, scene_rows(rows, seed=0, buckets=((side, side),), batch_size=cfg.train.batch_size))


def minimal_loop(data: Path, cfg: KilnConfig, steps: int) -> dict:
    """The hand-written reference: every step is model work only. It trains the same objective as the trainer:
    with `train.repa` on (the demo's default), the flow loss plus the REPA term through the same projector and
    teacher, whose targets it computes up front like the text embeddings (so its steps never pay a teacher
    cache miss: its best configuration)."""
    from model.autoencoder import from_uint8_nhwc
    from model.flow import interpolate, velocity_target
    from training.core.data import TrainSet
    from training.core.objective import sample_timesteps
    from training.core.repa import build_repa, repa_active
    from training.core.trainer import init_generator

    tc = cfg.train
    torch.set_num_threads(tc.threads or torch.get_num_threads())
    started = time.perf_counter()
    data_set = TrainSet.from_dir(data, tc.batch_size, tc.holdout, cfg.data.rewrite.form_probs)
    gen = init_generator(cfg.model, tc.seed)
    batches = list(itertools.takewhile(lambda b: b.position.epoch == 0, data_set.stream(tc.seed)))  # one epoch, in RAM
    x0s = [gen.autoencoder.encode(b.pixels) for b in batches]
    with torch.no_grad():  # the frozen encoder's output, once per batch, as the trainer's text cache does
        texts = [gen.encode_text(list(b.captions)) for b in batches]
    opt = torch.optim.AdamW([p for p in gen.parameters() if p.requires_grad], lr=tc.lr, weight_decay=tc.weight_decay)
    repa = build_repa(gen, tc.repa, tc.parallel, torch.device("cpu")) if repa_active(tc.repa, 0) else None
    if repa is not None:
        repa_opt = repa.make_optimizer(None, tc)
        images = [from_uint8_nhwc(b.pixels) for b in batches]
        for im in images:
            repa.teacher(im)  # every target computed (and cached) before the first step
    rng = torch.Generator().manual_seed(tc.seed)
    gen.train()
    startup = time.perf_counter() - started
    seconds = []
    for step in range(steps):
        t0 = time.perf_counter()
        i = step % len(batches)
        x0, text = x0s[i], texts[i]
        t = sample_timesteps(x0.shape[0], rng, tc.timestep_mean, tc.timestep_std, 1.0, "cpu")
        eps = torch.randn(x0.shape, generator=rng)
        loss = F.mse_loss(gen(interpolate(x0, eps, t), t, text), velocity_target(x0, eps))
        if repa is not None:
            loss = loss + tc.repa.weight * repa.loss(images[i], tuple(x0.shape[-2:]))
            repa_opt.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(gen.parameters(), tc.grad_clip)
        opt.step()
        if repa is not None:
            repa_opt.step()
        seconds.append(time.perf_counter() - t0)
    return {
        "startup_s": startup,
        "step_s": statistics.median(seconds[WARMUP:]),
        "total_s": time.perf_counter() - started,
    }


def kiln_trainer(data: Path, cfg: KilnConfig, steps: int, workers: int, out: Path) -> dict:
    from training.core.telemetry import read_metrics
    from training.core.trainer import train

    run = cfg.model_copy(
        update={
            "train": cfg.train.model_copy(
                update={"steps": steps, "loader_workers": workers, "log_every": 0, "holdout": 0}
            )
        }
    )
    started = time.perf_counter()
    train(data, out, run, overwrite=True)
    total = time.perf_counter() - started
    seconds = [r["seconds"] for r in read_metrics(out / "metrics.jsonl")]
    return {"startup_s": total - sum(seconds), "step_s": statistics.median(seconds[WARMUP:]), "total_s": total}


def measure_one(args: argparse.Namespace, data: Path, which: str) -> dict:
    """One run, in a fresh process: `which` is "reference" or "kiln wN"."""
    cmd = [
        sys.executable,
        __file__,
        "--one",
        which,
        "--data",
        str(data),
        "--steps",
        str(args.steps),
        "--",
        *args.overrides,
    ]
    out = subprocess.run(
        cmd, check=True, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1]
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data", type=Path, default=None, help="a pack stage output (default: 320 synthetic demo scenes)")
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process: one run, one JSON line
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = load_config(args.overrides)
    if args.one is not None:
        with tempfile.TemporaryDirectory() as tmp:
            one = (
                minimal_loop(args.data, cfg, args.steps)
                if args.one == "reference"
                else kiln_trainer(args.data, cfg, args.steps, int(args.one.removeprefix("kiln w")), Path(tmp) / "run")
            )
        print(json.dumps(one))
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = args.data or synthetic_pack(tmp / "pack", 320, cfg)
        runs: dict[str, list[dict]] = {"reference": []} | {f"kiln w{w}": [] for w in args.workers}
        for r in range(args.repeats):
            for which in runs:
                runs[which].append(measure_one(args, data, which))
            print(
                f"repeat {r + 1}/{args.repeats}: "
                + ", ".join(f"{k} {v[-1]['step_s']:.3f} s/step" for k, v in runs.items()),
                flush=True,
            )
    med = {
        k: {m: statistics.median(x[m] for x in v) for m in ("step_s", "startup_s", "total_s")} for k, v in runs.items()
    }
    ref = med["reference"]["step_s"]
    print(f"\n{'':10} {'s/step':>8} {'ref/kiln':>9} {'start-up s':>11}")
    for k, m in med.items():
        print(f"{k:10} {m['step_s']:8.3f} {ref / m['step_s']:9.2f} {m['startup_s']:11.1f}")
    print(
        json.dumps(
            {
                "threads": torch.get_num_threads(),
                "steps": args.steps,
                "repeats": args.repeats,
                "median": med,
                "ratio": {k: ref / m["step_s"] for k, m in med.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
