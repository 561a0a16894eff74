"""`dagster dev -m dagster_project.definitions` (or `dagster dev` in the repo root) loads these."""

from __future__ import annotations

import dagster as dg

from dagster_project.assets import BRANCH_ASSETS, DOMAIN_DATA_ASSETS, EVAL_ASSETS, MAIN_DATA_ASSETS
from dagster_project.checks import all_checks
from dagster_project.domains import domain_assets
from dagster_project.expander import expander_assets, expander_job
from dagster_project.ladder import ladder_assets
from dagster_project.post_training import post_assets
from dagster_project.progress import kiln_progress_line
from dagster_project.resources import KilnResource
from dagster_project.sensors import slurm_jobs, source_changes
from dagster_project.style import style_assets

MAIN_ASSETS = [*MAIN_DATA_ASSETS, *ladder_assets, *EVAL_ASSETS]
all_assets = [*MAIN_ASSETS, *BRANCH_ASSETS, *DOMAIN_DATA_ASSETS, *domain_assets, *post_assets, *style_assets, *expander_assets]

main = dg.define_asset_job(
    "main",
    hooks={kiln_progress_line},
    selection=dg.AssetSelection.assets(*[a.key for a in MAIN_ASSETS]),
    description="raw images -> curation -> curation models -> OCR-grounded captions -> rewrites -> coverage -> mixes -> "
    "a train set and a checkpoint per ladder rung -> the PMA checkpoint -> samples and evaluation (what `kiln run` executes)",
)
# Parts of the chain, to rerun one after a change upstream of it has been materialized.
caption_branch = dg.define_asset_job(
    "caption_branch",
    selection=dg.AssetSelection.groups("captions"),
    description="OCR -> OCR-grounded captions -> rewrites, prompt pairs, concept coverage, mixes",
)
curation_models = dg.define_asset_job(
    "curation_models",
    selection=dg.AssetSelection.groups("curation_models"),
    description="embeddings -> pseudo-label classifiers -> SAE tags -> FAISS clusters (with review) -> semantic dedup",
)

training = dg.define_asset_job(
    "training",
    hooks={kiln_progress_line},
    selection=dg.AssetSelection.groups("training", "evaluation"),
    description="the ladder's train sets and checkpoints, the PMA checkpoint, samples and evaluation (after a change to the captions or mixes)",
)

post_training = dg.define_asset_job(
    "post_training",
    hooks={kiln_progress_line},
    selection=dg.AssetSelection.groups("post_training"),
    description="after `checkpoint`: domain SFTs -> their merge, preference pairs -> reward model, Diffusion-DPO, then Flow-GRPO (docs/post-training.md)",
)

defs = dg.Definitions(
    assets=all_assets, asset_checks=all_checks, jobs=[main, caption_branch, curation_models, training, post_training, expander_job],
    sensors=[slurm_jobs, source_changes], resources={"kiln": KilnResource()},
)
