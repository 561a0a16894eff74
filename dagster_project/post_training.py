"""Post-training as assets, after `checkpoint` (SFT + PMA): preference pairs -> reward model, Diffusion-DPO,
then Flow-GRPO from the DPO checkpoint (the Krea 2 order). Each checkpoint's page leads with prompt
following per attribute before and after, the reward means, and sample grids before and after.

Its own job (`post_training`): minutes per asset on a CPU, so not part of the demo's `main` budget.
"""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg

from dagster_project.resources import KilnResource
from kiln.ladder import post_base
from kiln.lineage import code_files, code_version, default_config
from kiln.viz import markdown_image

GROUP = "post_training"
BASE = post_base(default_config())  # `checkpoint`, or the merge of the domain SFTs (dagster_project/domains.py)


def compare(before: Path, after: Path, cfg) -> dict:
    """Prompt following (the evaluation's prompts and protocol) of two checkpoints, and their sample grids."""
    from assets.demo_scenes import demo_prompts
    from model.generator import Generator
    from training.evaluate import prompt_following
    from training.plots import sample_grid
    from training.sampling import checkpoint_resolution

    md: dict = {}
    for name, ckpt in (("before", before), ("after", after)):
        gen = Generator.from_pretrained(ckpt)
        h, w = checkpoint_resolution(ckpt, cfg)
        acc, images = prompt_following(gen, cfg, h, w)
        md.update({f"prompt_following_{name}.{k}": v for k, v in acc.items()})
        md[f"samples_{name}"] = dg.MetadataValue.md(markdown_image(sample_grid(images, [s.prompt for s in demo_prompts()]), f"samples {name}"))
    md["prompt_following_gain.all"] = round(md["prompt_following_after.all"] - md["prompt_following_before.all"], 4)
    return md


def _history_means(path: Path, keys: list[str], last: int = 10) -> dict:
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    tail = rows[-last:]
    return {f"last{last}.{k}": round(sum(r[k] for r in tail) / len(tail), 6) for k in keys if tail and all(k in r for r in tail)}


@dg.asset(deps=[BASE], group_name=GROUP, kinds={"pytorch", "parquet"}, code_version=code_version(code_files("training.pairs")),
          description=f"On-policy preference pairs: K samples per prompt from `{BASE}`, scored by the reward mix (post.rewards); best vs worst above post.pair_margin.")  # fmt: skip
def preference_pairs(kiln: KilnResource) -> dg.MaterializeResult:
    from training.pairs import make_pairs

    report = make_pairs(kiln.path(BASE), kiln.path("preference_pairs"), kiln.config())
    return dg.MaterializeResult(metadata={**{k: v for k, v in report.items() if v is not None}, "path": dg.MetadataValue.path(str(kiln.path("preference_pairs")))})


@dg.asset(deps=["preference_pairs"], group_name=GROUP, kinds={"numpy"}, code_version=code_version(code_files("training.reward_model")),
          description="The aesthetic reward model: a Bradley-Terry head on the image embedder, fit on the pairs; held-out pair accuracy first.")  # fmt: skip
def reward_model(kiln: KilnResource) -> dg.MaterializeResult:
    from training.reward_model import train_reward_model

    report = train_reward_model(kiln.path("preference_pairs"), kiln.path("reward_model"), kiln.config())
    md = {"held_out_accuracy": report["held_out_accuracy"]} if report["held_out_accuracy"] is not None else {}
    return dg.MaterializeResult(metadata={**md, **{k: v for k, v in report.items() if k != "held_out_accuracy" and v is not None}})


@dg.asset(deps=[BASE, "preference_pairs"], group_name=GROUP, kinds={"pytorch", "safetensors"}, code_version=code_version(code_files("training.dpo_train")),
          description=f"Diffusion-DPO from `{BASE}` on the pairs, with the divergence guard; prompt following before/after first.")  # fmt: skip
def checkpoint_dpo(kiln: KilnResource) -> dg.MaterializeResult:
    from training.dpo_train import dpo

    cfg = kiln.config()
    out = dpo(kiln.path(BASE), kiln.path("preference_pairs"), kiln.path("checkpoint_dpo"), cfg)
    info = json.loads((out / "dpo.json").read_text())
    md = compare(kiln.path(BASE), out, cfg)
    md |= _history_means(out / "dpo_history.jsonl", ["loss", "winner_loglik", "loser_loglik", "accuracy"])
    md["guard_fired_at"] = dg.MetadataValue.json(info["guard_fired_at"])
    return dg.MaterializeResult(metadata={**md, "path": dg.MetadataValue.path(str(out))})


@dg.asset(deps=["checkpoint_dpo"], group_name=GROUP, kinds={"pytorch", "safetensors"}, code_version=code_version(code_files("training.grpo_train")),
          description="Flow-GRPO from `checkpoint_dpo` on the reward mix, without CFG; prompt following before/after and reward means first.")  # fmt: skip
def checkpoint_grpo(kiln: KilnResource) -> dg.MaterializeResult:
    from training.grpo_train import grpo

    cfg = kiln.config()
    out = grpo(kiln.path("checkpoint_dpo"), kiln.path("checkpoint_grpo"), cfg)
    md = compare(kiln.path("checkpoint_dpo"), out, cfg)
    md |= _history_means(out / "grpo_history.jsonl", ["reward", "kl", "clipped"])
    return dg.MaterializeResult(metadata={**md, "path": dg.MetadataValue.path(str(out))})


post_assets = [preference_pairs, reward_model, checkpoint_dpo, checkpoint_grpo]
