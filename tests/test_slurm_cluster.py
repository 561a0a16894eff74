"""Jobs through a real Slurm: the localhost cluster of scripts/slurm-local.sh (started here if needed).

Each test is one or two sbatch round trips (about 3 s, plus Python and torch start-up in the job).
In CI (CI=true) a cluster that cannot start fails the run instead of skipping it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
from safetensors import safe_open

from kiln.config import load_config
from kiln.paths import REPO_ROOT
from kiln.schemas import MANIFEST
from kiln.stage import run_stage, write_table
from slurm.arrays import run_stage_array
from slurm.jobs import SlurmJobFailed, submit, submit_and_wait, watch
from slurm.launcher import TaskSpec
from slurm.selftest import CHECKPOINT, reference_sgd
from slurm.state import query_states

pytestmark = [pytest.mark.slurm, pytest.mark.integration]
SCRIPT = REPO_ROOT / "scripts" / "slurm-local.sh"


def _sinfo_answers() -> bool:
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def slurm_cluster():
    """SLURM_CONF of a cluster that answers: the one in the environment, else the local one, started."""
    if not (os.environ.get("SLURM_CONF") and _sinfo_answers()):
        env_line = subprocess.run([str(SCRIPT), "env"], capture_output=True, text=True).stdout.strip()
        os.environ["SLURM_CONF"] = env_line.split("=", 1)[1]
        started = subprocess.run([str(SCRIPT), "start"], capture_output=True, text=True, timeout=120)
        if started.returncode != 0 or not _sinfo_answers():
            why = f"local Slurm did not start: {started.stderr[-2000:]}"
            if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
                pytest.fail(why)
            pytest.skip(why)
    return os.environ["SLURM_CONF"]


@pytest.fixture
def cfg(slurm_cluster, tmp_path):
    return load_config(["cluster=test", f"cluster.log_dir={tmp_path / 'slurm'}", "cluster.poll_s=0.3"])


def quiet(_msg: str) -> None:
    pass


def test_two_gloo_tasks_on_the_gpu_partition_reach_the_in_process_loss(cfg, tmp_path):
    gpu = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"partition": "gpu", "gpus_per_node": 2})})
    spec = TaskSpec("slurm.selftest:allreduce_sgd", (str(tmp_path / "run"),), {"steps": 8})
    report = submit_and_wait(spec, gpu, log=quiet)

    reference = reference_sgd(2, steps=8)
    assert report.state == "COMPLETED" and report.nodes == "localhost"
    assert [r["rank"] for r in report.results] == [0, 1]
    for r in report.results:
        assert r["world_size"] == 2 and r["backend"] == "gloo"
        assert r["cuda_visible_devices"] == "0,1"  # the two fake GPUs of the gres
        assert r["losses"] == pytest.approx(reference["losses"], abs=1e-7)
        assert r["final_loss"] == pytest.approx(reference["final_loss"], abs=1e-7)
        assert Path(r["code"]).parent.parent == tmp_path / "slurm" / "snapshots"  # ran the snapshot
    assert report.stdout.exists() and "Job completed successfully" in report.stdout.read_text()


def _checkpoint_step(path: Path) -> int:
    if not path.exists():
        return 0
    with safe_open(str(path), framework="pt") as f:
        return int(f.metadata()["step"])


def _wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_a_preempted_job_is_requeued_and_resumes_from_its_checkpoint(cfg, tmp_path):
    out = tmp_path / "run"
    job = submit(TaskSpec("slurm.selftest:allreduce_sgd", (str(out),), {"steps": 24, "step_sleep_s": 0.25}), cfg, log=quiet)
    _wait_until(lambda: _checkpoint_step(out / CHECKPOINT) >= 3, 120, "three checkpointed steps")
    job._interrupt()  # what Slurm sends before preemption: SIGTERM, then USR2
    # Slurm holds a requeued job back for two minutes (BeginTime); let it start again now
    _wait_until(lambda: query_states([job.job_id]).get(job.job_id).state == "PENDING", 60, "the requeue")
    subprocess.run(["scontrol", "update", f"JobId={job.job_id}", "StartTime=now"], check=True, timeout=30)
    report = watch(job, cfg, log=quiet)

    reference = reference_sgd(2, steps=24)
    assert report.restarts == 1
    first, resumed_at = report.result["starts"]
    assert first == 0 and 3 <= resumed_at < 24
    for r in report.results:
        assert r["weights"] == pytest.approx(reference["weights"], abs=1e-7)
        assert r["losses"] == pytest.approx(reference["losses"], abs=1e-7)


def _manifest(n: int, offset: int) -> pa.Table:
    rows = [
        dict(id=f"{i:016x}", uri=f"img/{i}.png", bytes=100 + i, md5="0" * 32, format="PNG",
             width=8 + (i * 7) % 60, height=40, mode="RGB", exif_orientation=1, n_frames=1)
        for i in range(offset, offset + n)
    ]
    return pa.Table.from_pylist(rows, schema=MANIFEST)


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_stage_as_a_job_array_writes_the_bytes_run_stage_writes(cfg, tmp_path):
    for i, n in enumerate([5, 7, 3]):
        write_table(_manifest(n, 100 * i), tmp_path / "in" / f"part-{i:05d}.parquet")
    lines: list[str] = []
    summary = run_stage_array("slurm.selftest_stage", tmp_path / "in", tmp_path / "array", cfg, max_parallel=2, log=lines.append)
    run_stage("slurm.selftest_stage", tmp_path / "in", tmp_path / "inproc", load_config([]))

    assert (summary.input_rows, summary.kept + summary.rejected) == (15, 15)
    assert summary.by_reason == {"too_small": summary.rejected} and summary.rejected > 0
    assert _digests(tmp_path / "array") == _digests(tmp_path / "inproc")
    assert any("3 shards as slurm array" in line for line in lines)
    assert not (tmp_path / ".array.array").exists()  # the per-task parts are cleaned up


def test_a_failing_job_raises_with_its_traceback_and_log_paths(cfg):
    with pytest.raises(SlurmJobFailed) as err:
        submit_and_wait(TaskSpec("os:getcwd", distributed=False), cfg, log=quiet)
    report = err.value.report
    assert report.state == "FAILED"
    assert "TypeError" in str(err.value) and f"slurm job {report.job_id}" in str(err.value)
    assert str(report.stderr) in str(err.value) and "TypeError" in report.log_tail


def test_a_job_cancelled_by_slurm_is_reported_without_an_accounting_database(cfg):
    job = submit(TaskSpec("slurm.selftest:allreduce_sgd", ("/nonexistent",), {"steps": 1000, "step_sleep_s": 1.0}, distributed=False), cfg, log=quiet)
    subprocess.run(["scancel", job.job_id], check=True, timeout=30)
    with pytest.raises(SlurmJobFailed, match="CANCELLED") as err:
        watch(job, cfg, log=quiet)
    assert err.value.report.state == "CANCELLED"


def test_kiln_submit_prints_the_job_id_and_its_logs(slurm_cluster, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "slurm.cli", "submit", "selftest", "--out", str(tmp_path / "run"),
         "cluster=test", f"cluster.log_dir={tmp_path / 'slurm'}"],
        capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
    )
    assert out.returncode == 0, out.stderr
    job_line = next(line for line in out.stdout.splitlines() if line.startswith("job "))
    job_id = job_line.split()[1].rstrip(":")
    subprocess.run(["scancel", job_id], check=True, timeout=30)
    assert f"logs in {tmp_path / 'slurm' / job_id} (task 0: {tmp_path / 'slurm' / job_id / (job_id + '_0_log.out')})" in job_line
