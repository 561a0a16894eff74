"""Cluster profiles, code snapshots and the self-test job, without a Slurm cluster.

What each profile asks of Slurm is read off the sbatch script submitit would write; the jobs that
really go through sbatch are in test_slurm_cluster.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from fresh import in_fresh_process

from kiln.config import ConfigError, load_config
from kiln.paths import REPO_ROOT
from slurm.environment import master_port
from slurm.jobs import SlurmJobFailed, submit_and_wait
from slurm.launcher import TaskSpec, resolve_entry
from slurm.profiles import executor_parameters, sbatch_script, setup_lines
from slurm.selftest import allreduce_sgd, reference_sgd
from slurm.snapshot import code_digest, snapshot_code


def test_every_cluster_profile_validates():
    for name in ("local", "test", "h200"):
        assert load_config([f"cluster={name}"]).cluster.name == name


def test_a_mistyped_cluster_key_is_refused_with_its_source():
    with pytest.raises(ConfigError, match=r"cluster.gpu_per_node: unknown key"):
        load_config(["cluster=h200", "+cluster.gpu_per_node=8"])


def test_h200_profile_asks_for_whole_nodes_one_task_per_gpu_and_usr2_before_the_limit():
    script = sbatch_script(load_config(["cluster=h200"]).cluster, "train", "kiln-train")
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=12",
        "#SBATCH --exclusive",
        "#SBATCH --partition=h200",
        "#SBATCH --signal=USR2@120",
        "#SBATCH --mem=1800GB",
        "export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7",
        "export NCCL_SOCKET_IFNAME=bond0",
        "export NCCL_IB_GID_INDEX=3",
        "export NCCL_DEBUG=WARN",
    ):
        assert line in script.splitlines(), line


def test_data_arrays_use_their_own_resources_and_a_parallelism_cap():
    cluster = load_config(["cluster=h200"]).cluster
    p = executor_parameters(cluster, "array", "filter")
    assert (p["slurm_partition"], p["tasks_per_node"], p["cpus_per_task"], p["slurm_array_parallelism"]) == (
        "cpu",
        1,
        8,
        512,
    )
    assert "gpus_per_node" not in p and "slurm_exclusive" not in p
    assert "#SBATCH --array=0-0%1" in sbatch_script(cluster, "array", "filter")


def test_account_qos_constraint_reach_sbatch_only_when_set():
    cluster = load_config(
        ["cluster=h200", "cluster.account=vision", "cluster.qos=high", "cluster.constraint=h200"]
    ).cluster
    script = sbatch_script(cluster).splitlines()
    assert {"#SBATCH --account=vision", "#SBATCH --qos=high", "#SBATCH --constraint=h200"} <= set(script)
    assert not any(
        line.startswith("#SBATCH --account")
        for line in sbatch_script(load_config(["cluster=test"]).cluster).splitlines()
    )


def test_env_values_are_shell_quoted():
    cluster = load_config(["cluster=test", "+cluster.env.WEIRD='a b;c'"]).cluster
    assert "export WEIRD='a b;c'" in setup_lines(cluster, None)


def test_snapshot_is_named_by_content_reused_and_skips_bytecode(tmp_path):
    repo = tmp_path / "repo"
    (repo / "kiln" / "__pycache__").mkdir(parents=True)
    (repo / "kiln" / "a.py").write_text("A = 1\n")
    (repo / "kiln" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"junk")
    (repo / "conf").mkdir()
    (repo / "conf" / "config.yaml").write_text("seed: 0\n")

    first = snapshot_code(tmp_path / "snaps", root=repo)
    assert first.name == code_digest(repo)[:16]
    assert snapshot_code(tmp_path / "snaps", root=repo) == first
    assert (first / "kiln" / "a.py").read_text() == "A = 1\n" and not (first / "kiln" / "__pycache__").exists()

    (repo / "kiln" / "a.py").write_text("A = 2\n")  # an edit after submission: a new snapshot, the old one intact
    second = snapshot_code(tmp_path / "snaps", root=repo)
    assert second != first and (first / "kiln" / "a.py").read_text() == "A = 1\n"


def test_a_job_imports_the_snapshot_not_the_live_tree(tmp_path):
    snap = snapshot_code(tmp_path)
    cluster = load_config(["cluster=test"]).cluster
    probe = f"{sys.executable} -c 'import slurm, kiln.config as c; print(slurm.__file__); print(c.conf_dir())'"
    script = "\n".join([*setup_lines(cluster, snap), probe])
    env = {**os.environ, "PYTHONPATH": ""}
    out = subprocess.run(["bash", "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, check=True, env=env)
    code, conf = out.stdout.split()
    assert Path(code).parent == snap / "slurm"
    assert Path(conf) == snap / "conf"


def test_master_port_is_shared_by_a_run_and_changes_after_a_requeue():
    ports = [master_port(job, restart) for job in ("123", "98765_4") for restart in range(3)]
    code = "import json; from slurm.environment import master_port; print(json.dumps([master_port(j, r) for j in ('123', '98765_4') for r in range(3)]))"
    assert in_fresh_process(code) == ports  # every task of the run, each its own process, agrees on it
    assert master_port("123", 0) != master_port("123", 1)
    assert 20000 <= master_port("123", 5) < 60000


def test_entries_are_module_colon_function():
    assert resolve_entry("slurm.selftest:allreduce_sgd") is allreduce_sgd
    with pytest.raises(ValueError, match="package.module:function"):
        resolve_entry("slurm.selftest.allreduce_sgd")


def test_selftest_resumed_from_a_checkpoint_ends_where_an_uninterrupted_run_ends(tmp_path):
    allreduce_sgd(str(tmp_path), steps=4)  # "preempted" after 4 steps
    resumed = allreduce_sgd(str(tmp_path), steps=9)
    assert resumed["starts"] == [0, 4]
    assert resumed["weights"] == reference_sgd(1, steps=9)["weights"]
    assert resumed["losses"] == reference_sgd(1, steps=9)["losses"]


@pytest.mark.slow
def test_local_profile_runs_jobs_as_local_subprocesses(tmp_path):
    cfg = load_config(["cluster=local", f"++cluster.log_dir={tmp_path}", "++cluster.poll_s=0.2"])
    report = submit_and_wait(TaskSpec("kiln.config:to_yaml", distributed=False), cfg.cluster, cfg, log=lambda m: None)
    assert report.state == "COMPLETED"
    assert "kind: local" in report.result
    with pytest.raises(SlurmJobFailed, match="TypeError"):
        submit_and_wait(TaskSpec("os:getcwd", distributed=False), cfg.cluster, cfg, log=lambda m: None)


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_selftest_runs_over_nccl_on_the_device(tmp_path):
    cfg = load_config(
        ["cluster=local", f"++cluster.log_dir={tmp_path}", "++cluster.gpus_per_node=1", "++cluster.poll_s=0.2"]
    )
    report = submit_and_wait(
        TaskSpec("slurm.selftest:allreduce_sgd", (str(tmp_path / "run"),), {"steps": 5}),
        cfg.cluster,
        cfg,
        log=lambda m: None,
    )
    (r,) = report.results
    assert (r["backend"], r["device"]) == ("nccl", "cuda:0")
    assert r["losses"] == pytest.approx(reference_sgd(1, steps=5)["losses"], rel=1e-4)
