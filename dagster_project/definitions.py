"""`dagster dev -m dagster_project.definitions` (or `dagster dev` in the repo root) loads these."""

from __future__ import annotations

import dagster as dg

from dagster_project.assets import all_assets
from dagster_project.checks import all_checks
from dagster_project.resources import KilnResource
from dagster_project.sensors import slurm_jobs

everything = dg.define_asset_job("everything", selection=dg.AssetSelection.all(), description="raw images to an evaluated checkpoint")

defs = dg.Definitions(assets=all_assets, asset_checks=all_checks, jobs=[everything], sensors=[slurm_jobs], resources={"kiln": KilnResource()})
