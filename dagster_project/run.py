"""`kiln run`: materialize the asset graph in-process through Dagster's Python API.

The selection is built from AssetKeys, not the selection-string parser, and runs are recorded in the
instance under DAGSTER_HOME (default `.dagster/`), so `dagster dev` shows them afterwards.
"""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg

from dagster_project.assets import MAIN_ASSETS, all_assets
from dagster_project.checks import all_checks
from dagster_project.resources import KilnResource
from kiln.paths import data_dir


def dagster_home() -> Path:
    home = Path(os.environ.setdefault("DAGSTER_HOME", str(Path.cwd() / ".dagster")))
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "dagster.yaml").exists():
        (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    return home


def materialize_all(overrides: list[str] | None = None, select: list[str] | None = None, everything: bool = False) -> bool:
    """The main job by default (raw images to an evaluated checkpoint); `select` names assets; `everything` adds the branches."""
    dagster_home()
    if everything:
        selection = dg.AssetSelection.all()
    else:
        selection = dg.AssetSelection.assets(*([dg.AssetKey(k) for k in select] if select else MAIN_ASSETS))
    result = dg.materialize(
        [*all_assets, *all_checks],
        selection=selection,
        resources={"kiln": KilnResource(overrides=list(overrides or []), data_dir=str(data_dir()))},
        instance=dg.DagsterInstance.get(),
        tags={"kiln/entry": "kiln run"},
        raise_on_error=False,
    )
    failed_checks = [c for c in result.get_asset_check_evaluations() if not c.passed]
    for c in failed_checks:
        print(f"asset check failed: {c.asset_key.to_user_string()} {c.check_name}")
    return result.success and not failed_checks
