"""The prompt expander on the demo: the DiT fed expanded vs short prompts, faithfulness, and diversity after
SFT and after RL (GDPO).

From the demo's `rewritten` captions (run `make demo` first): prompt pairs -> rule-written user prompts ->
expander SFT (the tiny word-level LM of conf/expander/demo.yaml) -> RL with faithfulness, image (the demo
DiT `checkpoint` + the pixel judge on the short prompt's requirements) and diversity rewards. Both expanders
are evaluated on the evaluation's 12 held-out prompts made short (training/expander/evaluate.py): faithfulness of
the greedy expansion, prompt following of the DiT fed the short prompt vs the expansion (same noise), and
the image-embedding spread of `group` sampled expansions per prompt. Prints one JSON line.

    .venv/bin/python benchmarks/bench_expander_demo.py --data data --out /tmp/bench_expander --rl-iterations 10
    ... --sft /tmp/bench_expander/sft    # reuse an SFT expander trained earlier
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    from assets.prompt_pairs import prompt_pair_rows
    from assets.user_prompts import user_prompts_stage
    from kiln.config import load_config
    from kiln.stage import read_dataset
    from training.expander.evaluate import evaluate_expander
    from training.expander.rl import train_rl
    from training.expander.sft import train_sft

    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--data",
        default="data",
        help="the demo's data folder (rewritten/, checkpoint/)",
    )
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--sft",
        default=None,
        help="an SFT expander folder to start RL from (default: train one)",
    )
    ap.add_argument("--rl-iterations", type=int, default=10)
    ap.add_argument("--images", type=int, default=2, help="images per held-out prompt and form")
    ap.add_argument(
        "--group",
        type=int,
        default=4,
        help="sampled expansions per prompt for diversity",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the figures in docs/expander.md: 1)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    data, out = Path(args.data), Path(args.out)
    cfg = load_config([f"expander.rl_iterations={args.rl_iterations}", *args.overrides])
    checkpoint = data / "checkpoint"
    t0 = time.perf_counter()
    sft = Path(args.sft) if args.sft else None
    if sft is None:
        pairs = prompt_pair_rows(
            read_dataset(data / "rewritten" / "kept"),
            cfg.data.rewrite.pair_drop,
            cfg.data.rewrite.seed,
        ).kept
        rows = user_prompts_stage(pairs, cfg).kept.to_pylist()
        sft = train_sft(rows, out / "sft", cfg)
    t_sft = time.perf_counter() - t0
    rl = train_rl(sft, checkpoint, out / "rl", cfg)
    t_rl = time.perf_counter() - t0 - t_sft
    report = {
        "rl_iterations": args.rl_iterations,
        "sft_seconds": round(t_sft),
        "rl_seconds": round(t_rl),
        "threads": args.threads,
    }
    for name, folder in (("sft", sft), ("rl", rl)):
        r = evaluate_expander(folder, checkpoint, cfg, n_images=args.images, group=args.group)
        report[name] = {k: v for k, v in r.items() if k != "examples"}
        report[f"{name}_examples"] = r["examples"]
    print(json.dumps(report, sort_keys=True))


if __name__ == "__main__":
    main()
