"""A user's mistake on the command line gets one line saying what is wrong and exit code 2, never a
traceback, and creates nothing; a traceback is kept for bugs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

KILN = str(Path(sys.executable).parent / "kiln")


def kiln(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([KILN, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.integration
@pytest.mark.parametrize(
    "args, says",
    [
        (["stage", "bogus", "--input", "in", "--output", "out"], "unknown stage 'bogus'; stages: ingest"),
        (["map", "filter", "--input", "in", "--output", "in"], "the output in is the input; choose another --output"),
        (["map", "filter", "--input", "nowhere", "--output", "out"], "filter: the input nowhere does not exist"),
        (
            ["submit", "stage", "filter", "--input", "in", "--output", "in", "cluster=test"],
            "the output in is the input",
        ),  # before any Slurm job
        (["train", "--data", "nonexistent", "--out", "ckpt"], "no train set at nonexistent (no such folder)"),
        (["review", "approve", "3"], "no clustering run yet: no review table at data/review.duckdb"),
        (
            ["run", "--select", "bogus", "data.demo.n=40"],
            "no asset 'bogus'; assets: captioned",
        ),  # the override after --select is not taken for an asset
    ],
)
def test_a_user_error_is_one_line_and_exit_2_and_creates_nothing(tmp_path, args, says):
    (tmp_path / "in").mkdir()
    r = kiln(*args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and says in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # no output folder, no review table


def test_review_list_before_any_clustering_says_so_and_creates_no_table(tmp_path):
    r = kiln("review", "list", cwd=tmp_path)
    assert r.returncode == 0 and "no clustering run yet" in r.stdout
    assert not (tmp_path / "data").exists()


@pytest.mark.integration
def test_an_unknown_cluster_in_an_existing_review_table_is_a_user_error(tmp_path):
    from assets.cluster_review import connect

    connect(tmp_path / "review.duckdb").close()  # the table the cluster stage creates, empty
    r = kiln("review", "reject", "0:3", "--db", str(tmp_path / "review.duckdb"), cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "no cluster 0:3 in the review table" in r.stderr
    r = kiln("review", "reject", "x:y", "--db", str(tmp_path / "review.duckdb"), cwd=tmp_path)
    assert r.returncode == 2 and "'x:y' is not a cluster" in r.stderr
