"""Diffusion-DPO on the demo: win rate against the reference under the rewards, the two likelihood curves,
and the divergence guard on a deliberately bad setting.

From the demo's `checkpoint` (run `make demo` first): on-policy pairs on grammar prompts, DPO at the
configured beta, then the same prompts and noise sampled from the DPO checkpoint and from the reference:
a prompt's image is a win when its total reward beats the reference's image of the same noise (ties
apart). The likelihood curves (winner and loser implicit log-likelihood ratios) go to a PNG. A second run
with a tiny beta and a high LR shows the guard firing. Prints one JSON line.

    .venv/bin/python benchmarks/bench_dpo_demo.py --checkpoint data/checkpoint --out /tmp/dpo_bench
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def win_rate(policy_ckpt: Path, reference_ckpt: Path, cfg, prompts, n: int, seed: int) -> dict:
    from model.generator import Generator
    from training.evaluation.rewards import make_reward_mix
    from training.evaluation.sampling import checkpoint_resolution, generate, sampling_shift

    mix = make_reward_mix(cfg.post)
    scores = {}
    for name, ckpt in (("policy", policy_ckpt), ("reference", reference_ckpt)):
        gen = Generator.from_pretrained(ckpt)
        h, w = checkpoint_resolution(ckpt, cfg)
        images = generate(
            gen,
            [p.prompt for p in prompts],
            n,
            h,
            w,
            cfg.train.sample.steps,
            cfg.train.sample.cfg_scale,
            seed,
            sampling_shift(gen, h, w, cfg.train),
        )
        scores[name] = np.stack([mix.score(p, ims)[0] for p, ims in zip(prompts, images, strict=True)])
    a, b = scores["policy"], scores["reference"]
    return {"wins": round(float((a > b).mean()), 4), "ties": round(float((a == b).mean()), 4), "losses": round(float((a < b).mean()), 4),
            "policy_reward": round(float(a.mean()), 4), "reference_reward": round(float(b.mean()), 4)}  # fmt: skip


def curves(history: Path, png: Path) -> None:
    from kiln.viz import line_plot

    rows = [json.loads(x) for x in history.read_text().splitlines()]
    line_plot({"winner": [r["winner_loglik"] for r in rows], "loser": [r["loser_loglik"] for r in rows]}, x=[r["step"] for r in rows],
              title="DPO: implicit log-likelihood ratio to the reference", path=png)  # fmt: skip


def main() -> None:
    from kiln.config import load_config
    from training.evaluation.rubric import demo_rl_prompts
    from training.post.dpo import dpo
    from training.post.pairs import make_pairs

    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default="data/checkpoint")
    ap.add_argument("--out", default="/tmp/dpo_bench")
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    ckpt, out = Path(args.checkpoint), Path(args.out)
    cfg = load_config(args.overrides)
    report: dict = {"checkpoint": str(ckpt), "pairs": make_pairs(ckpt, out / "pairs", cfg)}
    good = dpo(ckpt, out / "pairs", out / "dpo", cfg)
    curves(good / "dpo_history.jsonl", out / "likelihoods.png")
    held = demo_rl_prompts(256, cfg.post.seed)[
        -args.eval_prompts :
    ]  # the same list as the pairs, past the prompts they used
    report["win_rate"] = win_rate(good, ckpt, cfg, held, 2, 4321)
    report["guard_fired_at"] = json.loads((good / "dpo.json").read_text())["guard_fired_at"]
    bad_cfg = load_config([*args.overrides, "post.dpo_beta=0.01", "post.dpo_lr=0.01", "post.guard_patience=10"])
    bad = dpo(ckpt, out / "pairs", out / "dpo_tiny_beta", bad_cfg)
    curves(bad / "dpo_history.jsonl", out / "likelihoods_tiny_beta.png")
    report["tiny_beta_guard_fired_at"] = json.loads((bad / "dpo.json").read_text())["guard_fired_at"][:5]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
