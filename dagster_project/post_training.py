"""Post-training as assets, after `checkpoint` (SFT + PMA) or the merge of the domain SFTs: preference pairs ->
reward model, Diffusion-DPO, then Flow-GRPO from the DPO checkpoint, then the few-step TDM student (the Krea 2 order). Each checkpoint's page leads with prompt
following per attribute before and after, the reward means, and sample grids before and after.

Its own job (`post_training`): minutes per asset on a CPU, so not part of the demo's `main` budget.
"""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg

from dagster_project.assets import EVAL_SET
from dagster_project.pages import checkpoint_page
from dagster_project.resources import KilnResource
from kiln.ladder import post_base
from kiln.lineage import code_files, code_version, default_config
from kiln.viz import markdown_image

GROUP = "post_training"
BASE = post_base(default_config())  # `checkpoint`, or the merge of the domain SFTs (dagster_project/domains.py)


def evaluation_metadata(name: str, row: dict) -> dict:
    """A checkpoint's evaluation row as metadata: prompt following per attribute, held-out loss, distribution
    metrics (or why they are missing) and the sampling cost."""
    md = {f"prompt_following_{name}.{k}": v for k, v in row["prompt_following"].items()}
    md[f"heldout_loss_{name}"] = row["heldout_loss"]
    md |= {f"{m}_{name}": v for m, v in row["distribution"].items() if v is not None}
    md[f"nfe_per_image_{name}"], md[f"seconds_per_image_{name}"] = row["nfe_per_image"], row["seconds_per_image"]
    return md


def compare(before: Path, after: Path, cfg, data_dir: Path) -> dict:
    """Both checkpoints under the evaluation protocol (training.evaluate.evaluation_row, held-out rows of
    `data_dir`), with their sample grids and the configured reward mix's means on the evaluation's images;
    the gain in prompt following first."""
    from training.evaluate import eval_rubric, evaluation_row
    from training.plots import sample_grid
    from training.rewards import configured_reward_mix, reward_means

    rows, md = {}, {}
    rubric = eval_rubric(cfg)  # one judge for both
    mix = configured_reward_mix(cfg, judge=rubric[1])
    prompts = [p.prompt for p in rubric[0]]
    for name, ckpt in (("before", before), ("after", after)):
        rows[name], images = evaluation_row(ckpt, data_dir, cfg, rubric)
        md |= evaluation_metadata(name, rows[name])
        md |= {f"reward_mean_{name}.{k}": v for k, v in reward_means(mix, rubric[0], images).items() if v is not None}
        md[f"samples_{name}"] = dg.MetadataValue.md(markdown_image(sample_grid(images, prompts), f"samples {name}"))
    gain = {"prompt_following_gain.all": round(rows["after"]["prompt_following"]["all"] - rows["before"]["prompt_following"]["all"], 4)}
    if all(v is None for r in rows.values() for v in r["distribution"].values()):
        md["distribution_metrics"] = "skipped: no extractor is set (metrics.fid_extractor, metrics.clip_extractor, metrics.dino_extractor)"
    return gain | md


def post_page(out: Path, md: dict, curve: tuple[Path, str]) -> dict:
    """A post-training checkpoint's page (dagster_project.pages.checkpoint_page): the gain and prompt following
    before/after first, then its own training curve and the "after" samples, the rest, the config as one entry."""
    head = {k: v for k, v in md.items() if k.startswith(("prompt_following_gain", "student_vs_teacher", "speedup", "prompt_following_after.all", "prompt_following_before.all"))}
    rest = {k: v for k, v in md.items() if k not in head and k != "samples_after"}
    after = md.get("samples_after")
    return checkpoint_page(out, headline=head, samples=after.value if after is not None else None, curve=curve, details=rest)


def _history_means(path: Path, keys: list[str], last: int = 10) -> dict:
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    tail = rows[-last:]
    return {f"last{last}.{k}": round(sum(r[k] for r in tail) / len(tail), 6) for k in keys if tail and all(k in r for r in tail)}


@dg.asset(deps=[BASE], group_name=GROUP, kinds={"pytorch", "parquet"}, code_version=code_version(code_files("training.pairs")),
          description=f"On-policy preference pairs: K samples per prompt from `{BASE}`, scored by the reward mix (post.rewards); best vs worst above post.pair_margin.")  # fmt: skip
def preference_pairs(kiln: KilnResource) -> dg.MaterializeResult:
    from training.pairs import make_pairs

    cfg = kiln.config()
    report = make_pairs(kiln.path(post_base(cfg)), kiln.path("preference_pairs"), cfg)
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
    base = post_base(cfg)
    out = dpo(kiln.path(base), kiln.path("preference_pairs"), kiln.path("checkpoint_dpo"), cfg, overwrite=True)  # the asset owns its folder
    info = json.loads((out / "dpo.json").read_text())
    md = compare(kiln.path(base), out, cfg, kiln.path(EVAL_SET))
    md |= _history_means(out / "dpo_history.jsonl", ["loss", "winner_loglik", "loser_loglik", "accuracy"])
    md["guard_fired_at"] = dg.MetadataValue.json(info["guard_fired_at"])
    return dg.MaterializeResult(metadata=post_page(out, md, (out / "dpo_history.jsonl", "loss")))


@dg.asset(deps=["checkpoint_dpo"], group_name=GROUP, kinds={"pytorch", "safetensors"}, code_version=code_version(code_files("training.grpo_train")),
          description="Flow-GRPO from `checkpoint_dpo` on the reward mix, without CFG; prompt following before/after and reward means first.")  # fmt: skip
def checkpoint_grpo(kiln: KilnResource) -> dg.MaterializeResult:
    from training.grpo_train import grpo

    cfg = kiln.config()
    out = grpo(kiln.path("checkpoint_dpo"), kiln.path("checkpoint_grpo"), cfg, overwrite=True)  # the asset owns its folder
    md = compare(kiln.path("checkpoint_dpo"), out, cfg, kiln.path(EVAL_SET))
    md |= _history_means(out / "grpo_history.jsonl", ["reward", "kl", "clipped"])
    return dg.MaterializeResult(metadata=post_page(out, md, (out / "grpo_history.jsonl", "reward")))


@dg.asset(deps=["checkpoint_grpo"], group_name=GROUP, kinds={"pytorch", "safetensors"}, code_version=code_version(code_files("training.tdm_train")),
          description="The few-step student: TDM distillation of `checkpoint_grpo` (post.distill), sampled with its own steps and no CFG; "
                      "the student against the teacher at its own steps and the teacher sampled naively with the student's steps, first.")  # fmt: skip
def checkpoint_student(kiln: KilnResource) -> dg.MaterializeResult:
    from training.evaluate import evaluation_row
    from training.sampling import read_sampler_settings
    from training.tdm_train import distill

    cfg = kiln.config()
    teacher = kiln.path("checkpoint_grpo")
    out = distill(teacher, kiln.path("checkpoint_student"), cfg, overwrite=True)  # the asset owns its folder
    md = compare(teacher, out, cfg, kiln.path(EVAL_SET))
    steps = read_sampler_settings(out).steps
    naive = cfg.model_copy(update={"train": cfg.train.model_copy(update={"eval": cfg.train.eval.model_copy(update={"steps": steps})})})
    row, _ = evaluation_row(teacher, kiln.path(EVAL_SET), naive)
    md |= evaluation_metadata(f"teacher_{steps}_steps", row)
    md["student_vs_teacher.all"] = round(md["prompt_following_after.all"] / md["prompt_following_before.all"], 4) if md["prompt_following_before.all"] else None
    md["speedup_vs_teacher"] = round(md["seconds_per_image_before"] / md["seconds_per_image_after"], 2) if md["seconds_per_image_after"] else None
    md |= _history_means(out / "tdm_history.jsonl", ["student_loss", "fake_loss", "teacher_gap"])
    return dg.MaterializeResult(metadata=post_page(out, {k: v for k, v in md.items() if v is not None}, (out / "tdm_history.jsonl", "student_loss")))


post_assets = [preference_pairs, reward_model, checkpoint_dpo, checkpoint_grpo, checkpoint_student]
