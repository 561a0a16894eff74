"""Flow-GRPO on the demo: held-out prompt following before and after, per seed.

Starts from the demo's `checkpoint` (run `make demo` first), runs `kiln grpo`'s loop with the demo rubric
(the pixel checker, a stand-in judge) on prompts drawn from the scene grammar, and measures prompt
following on the evaluation's 12 prompts, whose attribute combinations RL never sees
(training.evaluation.rubric.demo_rl_prompts excludes them). Reference: the starting checkpoint under the same
evaluation (same prompts, seeds, sampler steps), with CFG at the evaluation's scale and without CFG (RL
trains without it). Prints one JSON line.

    .venv/bin/python benchmarks/bench_grpo_demo.py --checkpoint data/checkpoint --iterations 40 --seeds 0 1
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def following(checkpoint: Path, cfg, n: int, seed: int, cfg_scale: float) -> dict[str, float]:
    from components.demo_scenes import demo_prompts
    from model.generator import Generator
    from training.evaluation.prompt_check import accuracy, expected_from_specs
    from training.evaluation.sampling import checkpoint_resolution, generate, sampling_shift

    gen = Generator.from_pretrained(checkpoint)
    h, w = checkpoint_resolution(checkpoint, cfg)
    specs = demo_prompts()
    images = generate(
        gen,
        [s.prompt for s in specs],
        n,
        h,
        w,
        cfg.train.eval.steps,
        cfg_scale,
        seed,
        sampling_shift(gen, h, w, cfg.train),
    )
    acc = accuracy(images, expected_from_specs(specs))
    acc["mean"] = round(float(np.mean([v for k, v in acc.items() if k != "all"])), 4)
    return acc


def main() -> None:
    from kiln.config import load_config
    from training.post.grpo import grpo

    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default="data/checkpoint")
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--eval-n", type=int, default=8, help="images per evaluation prompt")
    ap.add_argument("--eval-seed", type=int, default=1234)
    ap.add_argument(
        "--keep",
        help="keep each seed's run (checkpoint, grpo_history.jsonl) under KEEP/seed<N> instead of a temporary folder",
    )
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    ckpt = Path(args.checkpoint)
    results: dict = {"checkpoint": str(ckpt), "iterations": args.iterations, "eval_n": args.eval_n, "runs": []}
    for seed in args.seeds:
        cfg = load_config([f"post.seed={seed}", f"post.iterations={args.iterations}", *args.overrides])
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            out = grpo(ckpt, Path(args.keep) / f"seed{seed}" if args.keep else Path(tmp) / "rl", cfg, overwrite=True)
            seconds = time.perf_counter() - t0
            history = [json.loads(x) for x in (out / "grpo_history.jsonl").read_text().splitlines()]
            run = {"seed": seed, "seconds": round(seconds, 1), "train_reward_first5": round(float(np.mean([h["reward"] for h in history[:5]])), 4),
                   "train_reward_last5": round(float(np.mean([h["reward"] for h in history[-5:]])), 4)}  # fmt: skip
            for name, scale in (("cfg", cfg.train.sample.cfg_scale), ("no_cfg", 1.0)):
                before = following(ckpt, cfg, args.eval_n, args.eval_seed, scale)
                after = following(out, cfg, args.eval_n, args.eval_seed, scale)
                run[name] = {
                    "before": before,
                    "after": after,
                    "gain_mean": round(after["mean"] - before["mean"], 4),
                    "gain_all": round(after["all"] - before["all"], 4),
                }
        results["runs"].append(run)
        print(json.dumps(run), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
