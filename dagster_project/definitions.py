"""`dagster dev -m dagster_project.definitions` (or `dagster dev` in the repo root) loads these."""

from __future__ import annotations

import dagster as dg

from dagster_project.assets import MAIN_ASSETS, all_assets
from dagster_project.checks import all_checks
from dagster_project.ladder import LADDER_KEYS, ladder_assets
from dagster_project.progress import kiln_progress_line
from dagster_project.resources import KilnResource
from dagster_project.sensors import slurm_jobs, source_changes

main = dg.define_asset_job(
    "main",
    hooks={kiln_progress_line},
    selection=dg.AssetSelection.assets(*[a.key for a in MAIN_ASSETS]),
    description="raw images -> curation -> curation models -> OCR-grounded captions -> rewrites -> coverage -> train set -> an evaluated checkpoint (what `kiln run` executes)",
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

training_ladder = dg.define_asset_job(
    "training_ladder",
    selection=dg.AssetSelection.assets(*LADDER_KEYS),
    description="pretrain 256 -> 512 -> 1024 -> midtrain -> SFT -> PMA: a train set and a checkpoint per rung (GPU cluster work)",
)

defs = dg.Definitions(assets=[*all_assets, *ladder_assets], asset_checks=all_checks, jobs=[main, caption_branch, curation_models, training_ladder], sensors=[slurm_jobs, source_changes], resources={"kiln": KilnResource()})
