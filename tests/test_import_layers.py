"""The import-linter contracts (pyproject.toml [tool.importlinter]) hold, and they cover the whole product:
every module of kiln's spine sits in a layer, every package is a root, so a new module cannot slip past them."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from kiln.paths import PACKAGES, REPO_ROOT

CONFIG = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def _layered() -> set[str]:
    layers = next(c for c in CONFIG["contracts"] if c["id"] == "layers")["layers"]
    return {m.strip() for layer in layers for m in layer.replace("|", ":").split(":")}


def test_the_contracts_cover_every_package_and_every_module_of_kilns_spine():
    assert set(CONFIG["root_packages"]) == set(PACKAGES)
    spine = {
        f"kiln.{p.stem if p.is_file() else p.name}"
        for p in (REPO_ROOT / "kiln").iterdir()
        if p.name != "__init__.py" and (p.suffix == ".py" or (p / "__init__.py").exists())
    }
    assert spine <= _layered(), f"not in a layer of [tool.importlinter]: {sorted(spine - _layered())}"
    assert {"assets", "training", "components", "model", "dagster_project"} <= _layered()


def test_the_import_contracts_hold():
    r = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:]


def test_a_wrong_way_import_breaks_a_contract(tmp_path):
    """training importing assets: the leak the layers forbid (a curation edit would retrain a model)."""
    import shutil

    for top in PACKAGES:
        shutil.copytree(REPO_ROOT / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with (tmp_path / "training" / "core" / "objective.py").open("a") as fh:
        fh.write("\n\ndef _leak():\n    from assets.embed import embed_rows  # noqa: F401\n")
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0 and "training.core.objective -> assets.embed" in r.stdout, r.stdout[-2000:]
