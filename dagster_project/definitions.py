"""`dagster dev -m dagster_project.definitions` (or `dagster dev` in the repo root) loads these."""

from __future__ import annotations

import dagster as dg

from dagster_project.assets import CAPTION_BRANCH, CURATION_MODELS, MAIN_ASSETS, all_assets
from dagster_project.checks import all_checks
from dagster_project.ladder import LADDER_KEYS, ladder_assets
from dagster_project.resources import KilnResource
from dagster_project.sensors import slurm_jobs

main = dg.define_asset_job("main", selection=dg.AssetSelection.assets(*MAIN_ASSETS), description="raw images to an evaluated checkpoint (what `kiln run` materializes)")
caption_branch = dg.define_asset_job(
    "caption_branch",
    selection=dg.AssetSelection.assets(*[sa.key for sa in CAPTION_BRANCH], "coverage", "mixes"),
    description="OCR -> OCR-grounded captions -> rewrites, prompt pairs, concept coverage, mixes",
)
curation_models = dg.define_asset_job(
    "curation_models",
    selection=dg.AssetSelection.assets(*[sa.key for sa in CURATION_MODELS]),
    description="embeddings -> pseudo-label classifiers -> SAE tags -> FAISS clusters (with review) -> semantic dedup",
)

training_ladder = dg.define_asset_job(
    "training_ladder",
    selection=dg.AssetSelection.assets(*LADDER_KEYS),
    description="pretrain 256 -> 512 -> 1024 -> midtrain -> SFT -> PMA: a train set and a checkpoint per rung (GPU cluster work)",
)

defs = dg.Definitions(assets=[*all_assets, *ladder_assets], asset_checks=all_checks, jobs=[main, caption_branch, curation_models, training_ladder], sensors=[slurm_jobs], resources={"kiln": KilnResource()})
