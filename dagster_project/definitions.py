"""`dagster dev -m dagster_project.definitions` (or `dagster dev` in the repo root) loads these: an asset per
node of the registry (dagster_project.assets), their checks, and jobs over parts of the graph."""

from __future__ import annotations

import dagster as dg

from dagster_project.assets import ASSETS, GRAPH
from dagster_project.checks import all_checks
from dagster_project.progress import kiln_progress_line
from dagster_project.resources import KilnResource
from dagster_project.sensors import slurm_jobs, source_changes
from kiln.registry import main_nodes

all_assets = list(ASSETS.values())
MAIN = [n.key for n in main_nodes(GRAPH)]


def _job(name: str, selection: dg.AssetSelection, description: str) -> dg.UnresolvedAssetJobDefinition:
    return dg.define_asset_job(name, selection=selection, hooks={kiln_progress_line}, description=description)


jobs = [
    _job(
        "main",
        dg.AssetSelection.assets(*MAIN),
        "raw images -> curation -> curation models -> OCR-grounded captions -> rewrites -> coverage -> mixes -> a train set and a checkpoint "
        "per ladder rung -> the PMA checkpoint -> samples and evaluation (what `kiln run` executes)",
    ),
    # parts of the chain, to rerun one after a change upstream of it has been materialized
    _job(
        "curation_models",
        dg.AssetSelection.groups("curation_models"),
        "embeddings -> pseudo-label classifiers -> SAE tags -> FAISS clusters (with review) -> semantic dedup",
    ),
    _job(
        "caption_branch",
        dg.AssetSelection.groups("captions"),
        "OCR -> OCR-grounded captions -> rewrites, prompt pairs, user prompts, concept coverage, mixes",
    ),
    _job(
        "training",
        dg.AssetSelection.groups("training", "evaluation"),
        "the ladder's train sets and checkpoints, the PMA checkpoint, samples and evaluation (after a change to the captions or mixes)",
    ),
    _job(
        "post_training",
        dg.AssetSelection.groups("post_training"),
        "after `checkpoint`: domain SFTs -> their merge, preference pairs -> reward model, Diffusion-DPO, then Flow-GRPO, then the TDM student (docs/post-training.md)",
    ),
    _job(
        "expander",
        dg.AssetSelection.assets("user_prompts") | dg.AssetSelection.groups("expander"),
        "prompt pairs -> synthetic user prompts -> expander SFT -> expander RL (GDPO), each with its evaluation (docs/expander.md)",
    ),
    _job(
        "style",
        dg.AssetSelection.groups("style"),
        "style references from `checkpoint`, with transfer and leakage per strength (docs/style.md)",
    ),
    # `kiln run --select KEY ...` and `kiln run --all`: the assets named, as a job of the definitions
    _job(
        "select", dg.AssetSelection.all(), "the assets `kiln run --select` names (the whole graph for `kiln run --all`)"
    ),
]

defs = dg.Definitions(
    assets=all_assets,
    asset_checks=all_checks,
    jobs=jobs,
    sensors=[slurm_jobs, source_changes],
    resources={"kiln": KilnResource()},
)
