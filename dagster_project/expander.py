"""The prompt expander as assets (docs/expander.md): `user_prompts` (a lineage step, dagster_project.assets) ->
`expander_sft` -> `expander_rl` (GDPO with the DiT of `checkpoint` drawing the expansions). Each page leads with
faithfulness, held-out prompt following of the DiT fed short vs expanded prompts, and diversity
(training/expander_eval.py). Their own job (`expander`): minutes on a CPU, outside the demo's `main` budget."""

from __future__ import annotations

import json

import dagster as dg

from dagster_project.resources import KilnResource
from kiln.lineage import code_files, code_version

GROUP = "expander"
DIT = "checkpoint"


def _code(*modules: str) -> str:
    return code_version(tuple(sorted({f for m in modules for f in code_files(m)})))


def report_metadata(report: dict, history) -> dict:
    """The evaluation first (faithfulness, following short -> expanded, diversity), then training means."""
    keys = (
        "faithfulness",
        "faithfulness_wide",
        "following_short",
        "following_expanded",
        "following_gain",
        "diversity",
        "prompts",
        "prompts_wide",
        "following_images",
    )
    md = {k: report[k] for k in keys if k in report}
    md["examples"] = dg.MetadataValue.md(
        "\n".join(f"- `{e['short']}` -> `{e['expanded']}`" for e in report["examples"])
    )
    lines = (
        [json.loads(x) for x in history.read_text().splitlines()]
        if history.exists()
        else []
    )
    for k in ("loss", "reward_faithfulness", "reward_image", "reward_diversity", "kl"):
        vals = [h[k] for h in lines[-10:] if k in h and h[k] == h[k]]
        if vals:
            md[f"last10.{k}"] = round(sum(vals) / len(vals), 6)
    return md


@dg.asset(deps=["user_prompts", DIT], group_name=GROUP, kinds={"pytorch", "safetensors"}, code_version=_code("training.expander", "training.expander_eval"),
          description="The prompt expander after SFT on (user prompt -> long caption), loss on the caption only; faithfulness, prompt following short vs expanded and diversity first.")  # fmt: skip
def expander_sft(kiln: KilnResource) -> dg.MaterializeResult:
    from training.expander import read_pairs, train_sft
    from training.expander_eval import evaluate_expander

    cfg = kiln.config()
    out = train_sft(
        read_pairs(kiln.path("user_prompts")), kiln.path("expander_sft"), cfg, overwrite=True
    )  # the asset owns its folder
    report = evaluate_expander(out, kiln.path(DIT), cfg)
    (out / "expander_eval.json").write_text(json.dumps(report, indent=2) + "\n")
    return dg.MaterializeResult(
        metadata={
            **report_metadata(report, out / "expander_sft_history.jsonl"),
            "path": dg.MetadataValue.path(str(out)),
        }
    )


@dg.asset(deps=["expander_sft", DIT], group_name=GROUP, kinds={"pytorch", "safetensors"}, code_version=_code("training.expander_rl", "training.expander_eval"),
          description="The prompt expander after GDPO (faithfulness, image, diversity rewards; safety gate) from expander_sft; the same evaluation first.")  # fmt: skip
def expander_rl(kiln: KilnResource) -> dg.MaterializeResult:
    from training.expander_eval import evaluate_expander
    from training.expander_rl import train_rl

    cfg = kiln.config()
    out = train_rl(
        kiln.path("expander_sft"), kiln.path(DIT), kiln.path("expander_rl"), cfg, overwrite=True
    )  # the asset owns its folder
    report = evaluate_expander(out, kiln.path(DIT), cfg)
    (out / "expander_eval.json").write_text(json.dumps(report, indent=2) + "\n")
    return dg.MaterializeResult(
        metadata={
            **report_metadata(report, out / "expander_rl_history.jsonl"),
            "path": dg.MetadataValue.path(str(out)),
        }
    )


expander_assets = [expander_sft, expander_rl]
expander_job = dg.define_asset_job(
    "expander",
    selection=dg.AssetSelection.assets(
        "user_prompts", *[a.key for a in expander_assets]
    ),
    description="prompt pairs -> synthetic user prompts -> expander SFT -> expander RL (GDPO), each with its evaluation (docs/expander.md)",
)
