"""Where things live. One place, so that Dagster, DVC, the CLI and Slurm workers agree."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = REPO_ROOT / "conf"
# the product's packages, bottom layer last (import-linter contracts in pyproject.toml say which imports which)
PACKAGES = ("dagster_project", "slurm", "kiln", "assets", "training", "components", "model")


def data_dir() -> Path:
    """The artifact root: `KILN_DATA` if set, else `data/` under the current directory."""
    return Path(os.environ.get("KILN_DATA", "data"))


def artifact(name: str) -> Path:
    """The folder of one named artifact (e.g. `manifest`, `filtered`, `checkpoint`)."""
    return data_dir() / name


def repo_file(path: str | Path) -> Path:
    """A file a config names: as given when it exists there, else relative to the repo (conf/data/... from any cwd)."""
    p = Path(path)
    return p if p.exists() or p.is_absolute() else REPO_ROOT / p
