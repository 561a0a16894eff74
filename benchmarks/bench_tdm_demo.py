"""TDM on the demo: the 4-step student against the 50-step teacher and the teacher sampled naively in 4 steps.

Starts from the demo's `checkpoint` (run `make demo` first), distils it with `kiln distill`'s loop
(post.distill.*), then scores three samplers under the evaluation's prompt following
(training.evaluation.evaluate.prompt_following: the 12 demo prompts, the demo rubric judged by the pixel checker, the
evaluation's noise seed) with `--eval-n` images per prompt:

    teacher_50   the teacher, 50 Euler steps, CFG at train.sample.cfg_scale (2 NFE a step)
    teacher_4    the teacher, 4 steps, the same CFG: the naive few-step baseline
    student      the student with its own sampler.json (4 steps, no CFG: 1 NFE a step)

and the wall-clock seconds per image of each (16 images generated again, timed, after a warm-up).
Prints one JSON line: the scores, NFEs, seconds per image, and the ratios the issue asks for (student mean /
teacher_50 mean, student mean - teacher_4 mean, teacher_50 s per image / student s per image).

    .venv/bin/python benchmarks/bench_tdm_demo.py --checkpoint data/checkpoint --iterations 80 --eval-n 4 train.threads=1
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def with_sampler(cfg, steps: int, cfg_scale: float, n: int):
    t = cfg.train
    train = t.model_copy(
        update={
            "sample": t.sample.model_copy(update={"cfg_scale": cfg_scale}),
            "eval": t.eval.model_copy(update={"steps": steps, "n_per_prompt": n}),
        }
    )
    return cfg.model_copy(update={"train": train})


def score(checkpoint: Path, cfg, steps: int, cfg_scale: float, n: int, time_n: int = 16) -> dict:
    """Prompt following (per attribute, `all`, and the attribute mean) and seconds per image of one sampler
    (timed on `time_n` images generated again after a warm-up)."""
    from model.generator import Generator
    from training.evaluation.evaluate import eval_rubric, prompt_following
    from training.evaluation.sampling import checkpoint_resolution, generate, sampling_shift

    gen = Generator.from_pretrained(checkpoint)
    h, w = checkpoint_resolution(checkpoint, cfg)
    run_cfg = with_sampler(cfg, steps, cfg_scale, n)
    with torch.no_grad():
        acc, _ = prompt_following(gen, run_cfg, h, w)
        prompts = [p.prompt for p in eval_rubric(cfg)[0]]
        shift = sampling_shift(gen, h, w, cfg.train)
        timed = [prompts[i % len(prompts)] for i in range(time_n)]  # one sampler batch (16 images) by default
        generate(gen, prompts[:2], 1, h, w, steps, cfg_scale, 0, shift)  # warm-up
        t0 = time.perf_counter()
        generate(gen, timed, 1, h, w, steps, cfg_scale, cfg.train.eval.seed, shift)
        per_image = (time.perf_counter() - t0) / time_n
    mean = round(float(np.mean([v for k, v in acc.items() if k != "all"])), 4)
    nfe = steps * (2 if cfg_scale != 1.0 else 1)
    return {
        "steps": steps,
        "cfg_scale": cfg_scale,
        "nfe": nfe,
        "prompt_following": acc,
        "mean": mean,
        "seconds_per_image": round(per_image, 5),
    }


def main() -> None:
    from kiln.config import load_config
    from training.evaluation.sampling import read_sampler_settings
    from training.post.distill import distill

    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default="data/checkpoint")
    ap.add_argument("--iterations", type=int, default=None, help="post.distill.iterations (default: the config's)")
    ap.add_argument("--eval-n", type=int, default=8, help="images per evaluation prompt")
    ap.add_argument("--teacher-steps", type=int, default=50)
    ap.add_argument("--keep", default=None, help="write the student here (default: a temporary folder)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    ckpt = Path(args.checkpoint)
    cfg = load_config([*([f"post.distill.iterations={args.iterations}"] if args.iterations else []), *args.overrides])
    torch.set_num_threads(cfg.train.threads or os.cpu_count() or 1)  # on a shared CPU, train.threads=1 is often faster
    guidance = cfg.train.sample.cfg_scale
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        student = distill(ckpt, Path(args.keep) if args.keep else Path(tmp) / "student", cfg)
        seconds = time.perf_counter() - t0
        history = [json.loads(x) for x in (student / "tdm_history.jsonl").read_text().splitlines()]
        own = read_sampler_settings(student)
        results = {
            "teacher_50": score(ckpt, cfg, args.teacher_steps, guidance, args.eval_n),
            "teacher_4": score(ckpt, cfg, own.steps, guidance, args.eval_n),
            "student": score(student, cfg, own.steps, own.cfg_scale, args.eval_n),
        }
    s, t50, t4 = results["student"], results["teacher_50"], results["teacher_4"]
    out = {
        "checkpoint": str(ckpt),
        "distill": cfg.post.distill.model_dump(mode="json"),
        "distill_seconds": round(seconds, 1),
        "teacher_gap_first5_last5": [
            round(float(np.mean([h["teacher_gap"] for h in history[:5]])), 4),
            round(float(np.mean([h["teacher_gap"] for h in history[-5:]])), 4),
        ],
        "eval_n": args.eval_n,
        **results,
        "student_over_teacher_50": round(s["mean"] / t50["mean"], 4) if t50["mean"] else None,
        "student_minus_teacher_4": round(s["mean"] - t4["mean"], 4),
        "speedup_vs_teacher_50": round(t50["seconds_per_image"] / s["seconds_per_image"], 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
