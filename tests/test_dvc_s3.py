"""DVC on object storage: `dvc push` of a train set's shards and a checkpoint to an S3 remote (the local
S3-compatible server, reached through the same AWS_* variables as the sources), then `dvc pull` into a
fresh clone restores them byte for byte without running anything, and `dvc status` is clean."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kiln.paths import REPO_ROOT

MAKE = """
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from training.testing import scene_rows, write_pack_output

with open("../runs.log", "a") as log:  # outside the project: counts how often the stage really ran
    log.write("ran\\n")
write_pack_output(Path("train_set"), scene_rows(24, seed=1), shard_bytes=6_000)
Path("checkpoint").mkdir(exist_ok=True)
save_file({"w": torch.arange(12.0).reshape(3, 4)}, "checkpoint/model.safetensors")
"""


def run(cmd: list[str], cwd: Path) -> str:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{' '.join(cmd)}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.s3
@pytest.mark.slow
@pytest.mark.integration
def test_push_to_s3_then_pull_into_a_fresh_clone_restores_the_outputs_without_recomputing(s3, tmp_path):
    dvc = [str(Path(sys.executable).parent / "dvc")]
    s3.create_bucket(Bucket="kiln-artifacts")
    project = tmp_path / "lab" / "project"
    project.mkdir(parents=True)
    (project / "make.py").write_text(MAKE)
    (project / "dvc.yaml").write_text(
        textwrap.dedent(
            f"""\
            stages:
              train_set:
                cmd: {sys.executable} make.py
                deps: [make.py]
                outs: [train_set, checkpoint]
            """
        )
    )
    run(["git", "init", "-q"], project)
    run(dvc + ["init", "-q"], project)
    run(dvc + ["remote", "add", "-d", "s3", "s3://kiln-artifacts/dvc"], project)  # endpoint: AWS_ENDPOINT_URL
    run(dvc + ["repro", "-q"], project)
    run(["git", "add", "-A"], project)
    run(["git", "-c", "user.email=ci@kiln", "-c", "user.name=ci", "commit", "-qm", "train set"], project)
    run(dvc + ["push", "-q"], project)
    stored = s3.list_objects_v2(Bucket="kiln-artifacts", Prefix="dvc/")["KeyCount"]
    tars = len(list((project / "train_set" / "shards").glob("*.tar")))
    assert tars >= 2 and stored <= 2 * tars + 8  # DVC tracks shards, not images

    clone = tmp_path / "lab" / "clone"
    run(["git", "clone", "-q", str(project), str(clone)], tmp_path)
    run(dvc + ["pull", "-q"], clone)

    for out in ("train_set", "checkpoint"):
        assert digests(clone / out) == digests(project / out)
    assert (tmp_path / "lab" / "runs.log").read_text() == "ran\n"  # pulled, not recomputed
    assert "up to date" in run(dvc + ["status"], clone)
