"""The DVC door: on a fresh copy of the repo, `dvc repro` rebuilds the data stages byte for byte as dvc.lock
pins them, on any x86-64 machine with AVX2 (kiln/numerics.py caps numpy at its AVX2 kernels), and leaves
dvc.lock as committed (git stays clean).

CI reproduces through `train_set_pretrain`, the first ladder rung's packed set. The training stages are
byte-reproducible on the machine kind that pinned them, not across CPU kinds (MKL and ATen pick kernels by
vendor and vector width; docs/training.md, "What `dvc repro` reproduces on another machine"); the trainer's
own determinism is tests/test_training_trainer.py's, and a full `dvc repro` on a fresh clone pins the
later stages."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kiln.config import load_config
from kiln.outputs import output_hash
from kiln.paths import REPO_ROOT
from kiln.registry import curation_nodes

TARGET = "train_set_pretrain"  # the first ladder rung's train set: the last stage before training
STAGES = [
    "demo_corpus",
    "raw_images",
    *[n.key for n in curation_nodes(load_config([]))],
    "coverage",
    "mixes",
    TARGET,
]  # what `dvc repro TARGET` runs


def _outs(lock: Path) -> dict[str, list[tuple[str, str]]]:
    stages = yaml.safe_load(lock.read_text())["stages"]
    return {s: sorted((o["path"], o["md5"]) for o in stages[s]["outs"]) for s in STAGES if s in stages}


def _fresh_copy(dst: Path) -> Path:
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
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
    assert set(pinned) == set(STAGES), "dvc.lock must pin every stage up to the first train set"
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "DVC_NO_ANALYTICS": "1",
        "KILN_CONF": str(repo / "conf"),
    }
    subprocess.run(
        [str(Path(sys.executable).parent / "dvc"), "repro", "--quiet", TARGET],
        cwd=repo,
        env=env,
        check=True,
        timeout=1500,
    )
    assert _outs(repo / "dvc.lock") == pinned, "dvc repro on a fresh copy must give the md5s that dvc.lock pins"
    assert (repo / "dvc.lock").read_text() == committed  # what `git status` would call clean

    for stage in (
        "manifest",
        "filtered",
        "embedded",
        TARGET,
    ):  # Dagster's data version of a step is the hash dvc.lock records
        assert dict(pinned[stage])[f"data/{stage}"] == output_hash(repo / "data" / stage)
