"""Style references on the demo: train the pathway on a demo checkpoint, then transfer accuracy and content
leakage per strength.

Style is the background (and palette), content the shape the prompt names. The target (docs/style.md):
transfer accuracy rises monotonically over >= 4 strengths, and content leakage (the reference's shape
drawn instead of the prompt's) stays at or under `style.leakage_bound` at every strength. Prints a
markdown table and one JSON line (also written to OUT/bench_style.json).

    .venv/bin/python benchmarks/bench_style_demo.py --checkpoint data/checkpoint --out /tmp/style_bench style.steps=300
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    from kiln.config import load_config
    from training.style.evaluate import evaluate_style_checkpoint
    from training.style.train import style_train

    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--checkpoint", default="data/checkpoint", help="a demo checkpoint (with or without the reference pathway)"
    )
    ap.add_argument("--out", default="data/bench_style")
    ap.add_argument("--skip-train", action="store_true", help="evaluate OUT as it is")
    ap.add_argument(
        "overrides", nargs="*", help="Hydra overrides, e.g. style.steps=300 model.reference.encoder=classical"
    )
    args = ap.parse_args()
    cfg = load_config(args.overrides)
    out, timings = Path(args.out), {}
    if not args.skip_train:
        t0 = time.perf_counter()
        style_train(Path(args.checkpoint), out, cfg, resume=(out / "dcp").exists())
        timings["train_s"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    report = evaluate_style_checkpoint(out, cfg)
    timings["eval_s"] = round(time.perf_counter() - t0, 1)
    print("| strength | transfer | leakage | content | colour |\n|---|---|---|---|---|")
    for r in report["per_strength"]:
        print(
            f"| {r['strength']:.2f} | {r['transfer']:.3f} | {r['leakage']:.3f} | {r['content']:.3f} | {r['color']:.3f} |"
        )
    result = report | {
        "checkpoint": args.checkpoint,
        "steps": cfg.style.steps,
        "encoder": cfg.model.reference.encoder,
        **timings,
    }
    result["targets_met"] = bool(report["transfer_monotone"] and report["leakage_ok"] and len(report["strengths"]) >= 4)
    (out / "bench_style.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
