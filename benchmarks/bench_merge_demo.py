"""Domain SFT and merging on the demo: each domain SFT, the base and the kept merge, scored on every domain.

Run it where `make demo` ran (it needs data/checkpoint, data/rewritten, data/coverage, data/mixes). It
materializes the domain train sets, the domain SFT checkpoints and checkpoint_merged with `kiln run
--select` (the merge search of post.merge keeps the best candidate by the mean domain score, on the
evaluation seed), then scores every checkpoint again on held-out seeds (other prompts drawn from each
domain's scene family, other noise), since the search picked its merge on the first seed. The target
(docs/post-training.md#merging): on each domain, the merge reaches at least 90% of the better single-domain SFT. Prints a
markdown table and one JSON line.

    .venv/bin/python benchmarks/bench_merge_demo.py --heldout-seeds 101 202
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    from kiln.config import load_config
    from kiln.ladder import FINAL, MERGED, domain_rungs
    from training.post.domains import domain_scores

    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data")
    ap.add_argument("--heldout-seeds", type=int, nargs="+", default=[101, 202])
    ap.add_argument("--skip-train", action="store_true", help="score what is already materialized")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    data = Path(args.data)
    cfg = load_config(args.overrides)
    domains = domain_rungs(cfg)
    timings = {}
    if not args.skip_train:
        select = [*(r.train_set for r in domains), *(r.checkpoint for r in domains), MERGED]
        t0 = time.perf_counter()
        subprocess.run(
            [str(Path(sys.executable).parent / "kiln"), "run", "--select", *select, *args.overrides], check=True
        )
        timings["domain_sfts_and_merge_s"] = round(time.perf_counter() - t0, 1)
    search = json.loads((data / MERGED / "merge_search.json").read_text())
    checkpoints = {r.name: data / r.checkpoint for r in domains} | {"base": data / FINAL, "merge": data / MERGED}
    heldout: dict[str, dict[str, float]] = {name: {} for name in checkpoints}
    for seed in args.heldout_seeds:
        scfg = load_config([f"train.eval.seed={seed}", *args.overrides])
        for name, path in checkpoints.items():
            for d, v in domain_scores(path, scfg).items():
                heldout[name].setdefault(d, []).append(v)
    mean = {name: {d: round(sum(v) / len(v), 4) for d, v in r.items()} for name, r in heldout.items()}
    names = [r.name for r in domains]
    ratio = {d: round(mean["merge"][d] / max(mean[n][d] for n in names), 4) for d in names}
    print("| checkpoint | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for name, r in mean.items():
        print(f"| {name} | " + " | ".join(f"{r[d]:.3f}" for d in names) + " |")
    print("| merge / best single | " + " | ".join(f"{ratio[d]:.3f}" for d in names) + " |")
    result = {"heldout_seeds": args.heldout_seeds, "heldout": mean, "merge_vs_best_single": ratio, "target_0.9_met": all(v >= 0.9 for v in ratio.values()),
              "search": [{k: c[k] for k in ("method", "weights", "scale", "density", "mean")} for c in search["candidates"]], "kept": search["kept"], **timings}  # fmt: skip
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
