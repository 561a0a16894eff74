"""The DVC door: on a fresh copy of the repo, `dvc repro` rebuilds the data stages byte for byte as dvc.lock pins them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kiln.lineage import MAIN_CHAIN, output_hash
from kiln.paths import REPO_ROOT

TARGET = "train_set_pretrain"  # the first ladder rung's train set
DATA_STAGES = ["demo_corpus", "raw_images", *[s.key for s in MAIN_CHAIN], "coverage", "mixes", TARGET]  # what `dvc repro TARGET` runs


def _outs(lock: Path) -> dict[str, list[tuple[str, str]]]:
    stages = yaml.safe_load(lock.read_text())["stages"]
    return {s: sorted((o["path"], o["md5"]) for o in stages[s]["outs"]) for s in DATA_STAGES if s in stages}


def _fresh_copy(dst: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for f in filter(None, files):
        src = REPO_ROOT / f.decode()
        if src.is_file():
            (dst / f.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f.decode())
    subprocess.run(["git", "init", "-q"], cwd=dst, check=True)
    return dst


@pytest.mark.slow
@pytest.mark.integration
def test_dvc_repro_on_a_fresh_copy_reproduces_the_pinned_data_stages(tmp_path):
    repo = _fresh_copy(tmp_path / "kiln")
    pinned = _outs(repo / "dvc.lock") if (repo / "dvc.lock").exists() else None
    (repo / "dvc.lock").unlink(missing_ok=True)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1", "KILN_CONF": str(repo / "conf")}
    subprocess.run([str(Path(sys.executable).parent / "dvc"), "repro", "--quiet", TARGET], cwd=repo, env=env, check=True, timeout=900)
    first = _outs(repo / "dvc.lock")
    assert set(first) == set(DATA_STAGES)
    if pinned is not None:
        assert first == pinned, "dvc repro on a fresh copy must give the md5s that dvc.lock pins"

    for stage in ("manifest", "filtered", TARGET):  # Dagster's data version of a step is the hash dvc.lock records
        assert dict(first[stage])[f"data/{stage}"] == output_hash(repo / "data" / stage)

    shutil.rmtree(repo / "data")
    shutil.rmtree(repo / ".dvc" / "cache", ignore_errors=True)  # no cache to restore from: really recompute
    subprocess.run([str(Path(sys.executable).parent / "dvc"), "repro", "--quiet", "--force", "--no-run-cache", TARGET], cwd=repo, env=env, check=True, timeout=900)
    assert _outs(repo / "dvc.lock") == first
    assert (repo / "data" / "manifest" / "kept" / "part-00000.parquet").exists()
