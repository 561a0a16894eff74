"""Jobs through a real Slurm: the localhost cluster of scripts/slurm-local.sh (started here if needed).

Each test is one or two sbatch round trips (about 3 s, plus Python and torch start-up in the job).
In CI (CI=true) a cluster that cannot start fails the run instead of skipping it.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kiln.config import load_config
from kiln.executors.slurm_array import run_stage_array
from kiln.stage import run_stage
from slurm.jobs import SlurmJobFailed, current_state, log_tail, submit, submit_and_wait, watch
from slurm.launcher import TaskSpec
from slurm.selftest import CHECKPOINT, reference_sgd
from slurm.state import query_states

pytestmark = [pytest.mark.slurm, pytest.mark.integration]


@pytest.fixture
def cfg(slurm_cluster, tmp_path):
    return load_config(["cluster=test", f"cluster.log_dir={tmp_path / 'slurm'}", "cluster.poll_s=0.3"])


def quiet(_msg: str) -> None:
    pass


def test_two_gloo_tasks_on_the_gpu_partition_reach_the_in_process_loss(cfg, tmp_path):
    gpu = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"partition": "gpu", "gpus_per_node": 2})})
    spec = TaskSpec("slurm.selftest:allreduce_sgd", (str(tmp_path / "run"),), {"steps": 8})
    report = submit_and_wait(spec, gpu.cluster, gpu, log=quiet)

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


def test_the_trainer_as_a_two_task_job_reaches_the_in_process_loss(cfg, tmp_path, text_encoder_dir):
    """`kiln submit train`'s task: the real trainer, FSDP2 over 2 gloo ranks (one per fake GPU), against
    the same run in this process; the job resumes from DCP, so it is also what a requeue continues."""
    from kiln.executors import train_task
    from training.core.telemetry import read_metrics
    from training.core.trainer import train
    from training.testing import scene_rows, tiny_config, write_pack_output

    data = write_pack_output(tmp_path / "pack", scene_rows(24, seed=3, buckets=((32, 32),), batch_size=8))
    run = tiny_config(text_encoder_dir, steps=4, warmup_steps=1, holdout=0)
    gpu = cfg.cluster.model_copy(update={"partition": "gpu", "gpus_per_node": 2})
    report = submit_and_wait(
        train_task(data, tmp_path / "job", run), gpu, run.model_copy(update={"cluster": gpu}), log=quiet
    )
    reference = train(data, tmp_path / "inproc", run)

    assert report.state == "COMPLETED" and len(report.results) == 2
    job, ref = read_metrics(tmp_path / "job" / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    assert [r["step"] for r in job] == [1, 2, 3, 4] and all(r["devices"] == 2 for r in job)
    assert [r["loss"] for r in job] == pytest.approx([r["loss"] for r in ref], rel=1e-5)
    assert [r["grad_norm"] for r in job] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-4)
    state = json.loads((tmp_path / "job" / "dcp" / "step-000004" / "train_state.json").read_text())
    assert state["world_size"] == 2 and state["tp"] == 1
    a, b = load_file(str(tmp_path / "job" / "model.safetensors")), load_file(str(reference / "model.safetensors"))
    assert sorted(a) == sorted(b) and max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-4


def _checkpoint_step(path: Path) -> int:
    if not path.exists():
        return 0
    with safe_open(str(path), framework="pt") as f:
        return int(f.metadata()["step"])


def _wait_until(predicate, timeout_s: float, what: str, job=None) -> None:
    """Poll `predicate`; with a `job`, stop as soon as it ends without it, and say why in either failure
    (its Slurm state and reason, and its log tail): a timeout alone does not tell a slow job from a dead one."""
    deadline, next_check = time.monotonic() + timeout_s, 0.0
    while not predicate():
        now = time.monotonic()
        if job is not None and now >= next_check:
            state, next_check = current_state(job), now + 2.0
            if state.terminal:
                raise AssertionError(f"job {job.job_id} ended {state.state} before {what}\n{log_tail(job)}")
        if now > deadline:
            why = (
                ""
                if job is None
                else f": job {job.job_id} is {current_state(job).state} ({current_state(job).reason})\n{log_tail(job)}"
            )
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}{why}")
        time.sleep(0.2)


def test_a_preempted_job_is_requeued_and_resumes_from_its_checkpoint(cfg, tmp_path):
    out = tmp_path / "run"
    job = submit(
        TaskSpec("slurm.selftest:allreduce_sgd", (str(out),), {"steps": 12, "step_sleep_s": 0.25}),
        cfg.cluster,
        cfg,
        log=quiet,
    )
    _wait_until(lambda: _checkpoint_step(out / CHECKPOINT) >= 3, 300, "three checkpointed steps", job)
    job._interrupt()  # what Slurm sends before preemption: SIGTERM, then USR2
    # Slurm holds a requeued job back for two minutes (BeginTime); let it start again now
    _wait_until(lambda: query_states([job.job_id]).get(job.job_id).state == "PENDING", 60, "the requeue")
    subprocess.run(["scontrol", "update", f"JobId={job.job_id}", "StartTime=now"], check=True, timeout=30)
    report = watch(job, cfg.cluster, log=quiet)

    reference = reference_sgd(2, steps=12)
    assert report.restarts == 1
    first, resumed_at = report.result["starts"]
    assert first == 0 and 3 <= resumed_at < 12
    for r in report.results:
        assert r["weights"] == pytest.approx(reference["weights"], abs=1e-7)
        assert r["losses"] == pytest.approx(reference["losses"], abs=1e-7)


def test_a_preempted_training_job_resumes_from_dcp_to_the_uninterrupted_run(cfg, tmp_path, text_encoder_dir):
    from kiln.executors import train_task
    from training.core.dcp import complete_checkpoints
    from training.core.telemetry import read_metrics
    from training.core.trainer import train
    from training.testing import scene_rows, tiny_config, write_pack_output

    data = write_pack_output(tmp_path / "pack", scene_rows(24, seed=4, buckets=((32, 32),), batch_size=8))
    run = tiny_config(
        text_encoder_dir, steps=60, warmup_steps=2, holdout=0, dcp={"every": 4, "keep": 2, "async_save": False}
    )
    one_gpu = cfg.cluster.model_copy(update={"partition": "gpu", "gpus_per_node": 1})
    out = tmp_path / "job"
    job = submit(train_task(data, out, run), one_gpu, run.model_copy(update={"cluster": one_gpu}), log=quiet)
    _wait_until(
        lambda: any(int(d.name.split("-")[1]) >= 8 for d in complete_checkpoints(out)), 300, "two checkpoints", job
    )
    job._interrupt()  # SIGTERM then USR2, as before a preemption: submitit requeues the job
    _wait_until(lambda: query_states([job.job_id]).get(job.job_id).state == "PENDING", 60, "the requeue")
    subprocess.run(["scontrol", "update", f"JobId={job.job_id}", "StartTime=now"], check=True, timeout=30)
    report = watch(job, cfg.cluster, log=quiet)
    reference = train(data, tmp_path / "inproc", run)

    assert report.restarts == 1
    resumed, whole = read_metrics(out / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, 61))  # the steps redone after the checkpoint are logged once
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]
    a, b = load_file(str(out / "model.safetensors")), load_file(str(reference / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def _digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_ingest_as_a_job_array_matches_in_process_and_keeps_relative_uris(cfg, tmp_path, monkeypatch):
    from PIL import Image

    monkeypatch.chdir(tmp_path)  # jobs share the submit directory, so relative uris resolve the same
    raw = Path("raw")
    raw.mkdir()
    for i in range(4):
        Image.new("RGB", (16 + 8 * i, 24), (40 * i, 80, 120)).save(raw / f"img{i}.png")
    (raw / "broken.png").write_bytes(b"not an image")
    sharded = cfg.model_copy(
        update={"data": cfg.data.model_copy(update={"ingest": cfg.data.ingest.model_copy(update={"shard_size": 2})})}
    )

    lines: list[str] = []
    summary = run_stage_array("ingest", raw, "array", sharded, log=lines.append)
    run_stage("ingest", raw, "inproc", sharded.model_copy(update={"cluster": load_config([]).cluster}))

    assert (summary.input_rows, summary.kept, summary.rejected) == (5, 4, 1)
    assert _digests(Path("array")) == _digests(Path("inproc"))
    assert len(list(Path("array/kept").glob("part-*.parquet"))) == 3  # one kept shard per array task
    assert all(u.startswith("raw/") for u in pq_uris(Path("array/kept")))
    assert any("3 shards as slurm array" in line and "at most 2 at once" in line for line in lines)
    assert not Path(".array.array").exists()  # the per-task parts are cleaned up


def pq_uris(folder: Path) -> list[str]:
    from kiln.stage import read_dataset

    return read_dataset(folder).column("uri").to_pylist()


def test_a_failing_job_raises_with_its_traceback_and_log_paths(cfg):
    with pytest.raises(SlurmJobFailed) as err:
        submit_and_wait(TaskSpec("os:getcwd", distributed=False), cfg.cluster, cfg, log=quiet)
    report = err.value.report
    assert report.state == "FAILED"
    assert "TypeError" in str(err.value) and f"slurm job {report.job_id}" in str(err.value)
    assert str(report.stderr) in str(err.value) and "TypeError" in report.log_tail
    assert "[task 1 stderr]" not in report.log_tail  # a non-distributed entry runs as a single task


def test_a_job_cancelled_by_slurm_is_reported_without_an_accounting_database(cfg):
    long_job = TaskSpec(
        "slurm.selftest:allreduce_sgd", ("/nonexistent",), {"steps": 1000, "step_sleep_s": 1.0}, distributed=False
    )
    job = submit(long_job, cfg.cluster, cfg, log=quiet)
    _wait_until(lambda: query_states([job.job_id])[job.job_id].state == "RUNNING", 60, "the job to start")
    subprocess.run(["scancel", job.job_id], check=True, timeout=30)
    with pytest.raises(SlurmJobFailed, match="CANCELLED") as err:
        watch(job, cfg.cluster, log=quiet)
    assert err.value.report.state == "CANCELLED"


def test_kiln_submit_prints_the_job_id_and_its_logs(slurm_cluster, tmp_path, capsys):
    from kiln.cli.submit import main

    logs = tmp_path / "slurm"
    assert main(["submit", "selftest", "--out", str(tmp_path / "run"), "cluster=test", f"cluster.log_dir={logs}"]) == 0
    job_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("job "))
    job_id = job_line.split()[1].rstrip(":")
    subprocess.run(["scancel", job_id], check=True, timeout=30)
    assert job_line == f"job {job_id}: logs in {logs / job_id} (task 0: {logs / job_id / (job_id + '_0_log.out')})"
