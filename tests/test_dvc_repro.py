"""The DVC door: on a fresh copy of the repo, `dvc repro` rebuilds the stages byte for byte as dvc.lock pins
them, the first training stage included, and leaves dvc.lock as committed (git stays clean).

CI reproduces through `checkpoint_pretrain` (the data stages and the 3,600-step pretraining, about eight
minutes on 2 cores); every later stage is pinned by a full `dvc repro` on a fresh clone (about 60 minutes
on 2 cores, too long for CI), which must leave dvc.lock unchanged as this test does."""

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

TRAIN_SET, TARGET = "train_set_pretrain", "checkpoint_pretrain"  # the first ladder rung's train set and checkpoint
STAGES = ["demo_corpus", "raw_images", *[s.key for s in MAIN_CHAIN], "coverage", "mixes", TRAIN_SET, TARGET]  # what `dvc repro TARGET` runs


def _outs(lock: Path) -> dict[str, list[tuple[str, str]]]:
    stages = yaml.safe_load(lock.read_text())["stages"]
    return {s: sorted((o["path"], o["md5"]) for o in stages[s]["outs"]) for s in STAGES if s in stages}


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
def test_dvc_repro_on_a_fresh_copy_reproduces_the_pinned_stages_and_leaves_the_lock_unchanged(tmp_path):
    repo = _fresh_copy(tmp_path / "kiln")
    committed = (repo / "dvc.lock").read_text()
    pinned = _outs(repo / "dvc.lock")
    assert set(pinned) == set(STAGES), "dvc.lock must pin every stage up to the first checkpoint"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1", "KILN_CONF": str(repo / "conf")}
    subprocess.run([str(Path(sys.executable).parent / "dvc"), "repro", "--quiet", TARGET], cwd=repo, env=env, check=True, timeout=1500)
    assert _outs(repo / "dvc.lock") == pinned, "dvc repro on a fresh copy must give the md5s that dvc.lock pins"
    assert (repo / "dvc.lock").read_text() == committed  # what `git status` would call clean

    for stage in ("manifest", "filtered", TRAIN_SET, TARGET):  # Dagster's data version of a step is the hash dvc.lock records
        assert dict(pinned[stage])[f"data/{stage}"] == output_hash(repo / "data" / stage)
    assert (repo / "data" / TARGET / "throughput.json").is_file()  # the wall-clock records stay on disk, outside the hash
