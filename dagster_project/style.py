"""Style references as an asset (docs/style.md): `checkpoint_style` is `checkpoint` with the reference pathway,
trained self-supervised (training/style_train.py), and its page leads with transfer accuracy and content
leakage per strength (training/style_eval.py). In the `style` group, outside the demo's `main` job."""

from __future__ import annotations

import json

import dagster as dg

from dagster_project.pages import checkpoint_page
from dagster_project.resources import KilnResource
from kiln.lineage import code_files, code_version

GROUP = "style"
BASE = "checkpoint"


def style_metadata(report: dict) -> dict:
    """Transfer / leakage / content per strength, whether transfer rises monotonically, and leakage against its bound."""
    md: dict = {}
    for r in report["per_strength"]:
        for k in ("transfer", "leakage", "content", "color"):
            md[f"{k}@{r['strength']:g}"] = r[k]
    md["transfer_monotone"] = report["transfer_monotone"]
    md["max_leakage"], md["leakage_bound"], md["leakage_ok"] = report["max_leakage"], report["leakage_bound"], report["leakage_ok"]
    md["eval_cases"] = report["cases"]
    return md


@dg.asset(deps=[BASE], group_name=GROUP, kinds={"pytorch", "safetensors"},
          code_version=code_version(tuple(sorted(set(code_files("training.style_train")) | set(code_files("training.style_eval"))))),
          description="`checkpoint` with style references (model.reference), trained on same-style-family pairs (style); transfer accuracy and leakage per strength first.")  # fmt: skip
def checkpoint_style(kiln: KilnResource) -> dg.MaterializeResult:
    from training.style_eval import evaluate_style_checkpoint
    from training.style_train import style_train

    cfg = kiln.config()
    out = style_train(kiln.path(BASE), kiln.path("checkpoint_style"), cfg, overwrite=True)  # the asset owns its folder
    report = evaluate_style_checkpoint(out, cfg)
    (out / "style_eval.json").write_text(json.dumps(report, indent=2) + "\n")
    history = [json.loads(x) for x in (out / "style_history.jsonl").read_text().splitlines()]
    md = style_metadata(report)
    if history:
        tail = history[-10:]
        md["last10.loss"] = round(sum(h["loss"] for h in tail) / len(tail), 6)
    return dg.MaterializeResult(metadata=checkpoint_page(out, headline=md, curve=(out / "style_history.jsonl", "loss")))


style_assets = [checkpoint_style]
