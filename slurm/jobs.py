"""The functions Dagster (and the CLI) call: submit, watch, report; fail loudly with the log tail.

`watch` decides a job is over when every task has written its result (submitit's pickles) or when
Slurm says the job reached a terminal state (slurm.state; no accounting database needed). A job that
was requeued after preemption keeps its id and is simply watched until its final run ends.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import submitit
from submitit.core.utils import FailedJobError, UncompletedJobError

from slurm.launcher import TaskSpec, launch
from slurm.profiles import ClusterProfile
from slurm.state import SlurmState, query_states, restarts

Log = Callable[[str], Any]
log_info = logging.getLogger("kiln").info  # the project's logger, by name
TAIL_LINES = 40


@dataclass(frozen=True)
class JobReport:
    job_id: str
    state: str  # COMPLETED, FAILED, CANCELLED, TIMEOUT, ... (local runs: COMPLETED / FAILED)
    nodes: str
    stdout: Path  # task 0's logs (every task has its own: <job id>_<task>_log.out)
    stderr: Path
    log_tail: str
    restarts: int = 0
    results: list[Any] = field(default_factory=list)  # one per task

    @property
    def result(self) -> Any:
        return self.results[0] if self.results else None

    def metadata(self) -> dict[str, str | int]:
        """Flat, JSON-able: what a Dagster asset shows about the job that made it."""
        return {
            "slurm_job_id": self.job_id,
            "slurm_state": self.state,
            "slurm_nodes": self.nodes,
            "slurm_restarts": self.restarts,
            "stdout": str(self.stdout),
            "stderr": str(self.stderr),
        }


class SlurmJobFailed(RuntimeError):
    """A job ended without results; the message carries the job id, state, log paths and the log tail."""

    def __init__(self, report: JobReport, detail: str = ""):
        self.report = report
        msg = (
            f"slurm job {report.job_id} ended {report.state} on {report.nodes or '?'}\n"
            f"  stdout: {report.stdout}\n  stderr: {report.stderr}\n"
        )
        if detail:
            msg += f"{detail.rstrip()}\n"
        super().__init__(msg + f"--- log tail ---\n{report.log_tail}")


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def log_tail(job: submitit.Job, lines: int = TAIL_LINES, max_tasks: int = 2) -> str:
    """Last lines of the stderr of the first tasks that wrote any, then task 0's stdout."""
    parts = []
    for i in range(job.num_tasks):
        t = tail(job.task(i).paths.stderr, lines)
        if t:
            parts.append(f"[task {i} stderr]\n{t}")
        if len(parts) == max_tasks:
            break
    out = tail(job.paths.stdout, lines)
    if out:
        parts.append(f"[task 0 stdout]\n{out}")
    return "\n".join(parts)


def _results_written(job: submitit.Job) -> bool:
    return all(job.task(i).paths.result_pickle.exists() for i in range(job.num_tasks))


def _is_slurm(job: submitit.Job) -> bool:
    return isinstance(job, submitit.SlurmJob)


def current_state(job: submitit.Job) -> SlurmState:
    if _is_slurm(job):
        return query_states([job.job_id]).get(job.job_id, SlurmState(job.job_id, "UNKNOWN", ""))
    state = "COMPLETED" if _results_written(job) else ("RUNNING" if not job.done() else "FAILED")
    return SlurmState(job.job_id, state, "localhost")


def wait_for(jobs: list[submitit.Job], log: Log, poll_s: float, grace_s: float = 15.0) -> dict[str, SlurmState]:
    """Block until every job has written its results or Slurm reports it finished; log state changes."""
    seen: dict[str, str] = {}
    final: dict[str, SlurmState] = {}
    ended_at: dict[str, float] = {}
    last_line = ""
    while len(final) < len(jobs):
        open_jobs = [j for j in jobs if j.job_id not in final]
        states = query_states([j.job_id for j in open_jobs if _is_slurm(j)])
        for j in open_jobs:
            st = states.get(j.job_id) if _is_slurm(j) else current_state(j)
            st = st or SlurmState(j.job_id, "UNKNOWN", "")
            seen[j.job_id] = st.state
            if len(jobs) == 1 and st.state != last_line:
                last_line = st.state
                log(f"slurm job {j.job_id}: {st.state}" + (f" on {st.nodes}" if st.nodes else ""))
            if _results_written(j):  # every task finished (results or a traceback): the job is over
                final[j.job_id] = SlurmState(j.job_id, st.state if st.terminal else "COMPLETED", st.nodes)
            elif st.terminal or (not _is_slurm(j) and j.done()):
                # results can land a moment after Slurm's verdict on a shared filesystem
                ended_at.setdefault(j.job_id, time.monotonic())
                if st.state != "COMPLETED" or time.monotonic() - ended_at[j.job_id] > grace_s:
                    final[j.job_id] = st
        if len(jobs) > 1:  # arrays: one line per change of the counts, not one per task
            counts = Counter(final[j.job_id].state if j.job_id in final else seen[j.job_id] for j in jobs)
            line = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
            if line != last_line:
                last_line = line
                log(f"slurm array {jobs[0].job_id.split('_')[0]}: {line}")
        if len(final) < len(jobs):
            time.sleep(poll_s)
    return final


def report(job: submitit.Job, state: SlurmState) -> JobReport:
    """Collect results (raising `SlurmJobFailed` when a task failed or never finished)."""
    base = dict(
        job_id=job.job_id,
        nodes=state.nodes,
        stdout=job.paths.stdout,
        stderr=job.paths.stderr,
        restarts=restarts(job.job_id) if _is_slurm(job) else 0,
    )
    if not _results_written(job):
        missing = [i for i in range(job.num_tasks) if not job.task(i).paths.result_pickle.exists()]
        failed = state.state if state.state != "COMPLETED" else "FAILED"
        raise SlurmJobFailed(JobReport(state=failed, log_tail=log_tail(job), **base), f"no result from tasks {missing}")
    try:
        results = job.results()
    except (FailedJobError, UncompletedJobError) as e:
        raise SlurmJobFailed(JobReport(state="FAILED", log_tail=log_tail(job), **base), str(e)) from None
    return JobReport(state="COMPLETED", log_tail=log_tail(job), results=list(results), **base)


def watch(job: submitit.Job, cluster: ClusterProfile, log: Log = log_info) -> JobReport:
    """Wait for a submitted job and report on it (for a sensor, or after `submit`)."""
    state = wait_for([job], log, cluster.poll_s)[job.job_id]
    rep = report(job, state)
    log(f"slurm job {rep.job_id}: {rep.state}, logs {rep.stdout.parent}")
    return rep


def submit(spec: TaskSpec | str, cluster: ClusterProfile, cfg: Any = None, log: Log = log_info) -> submitit.Job:
    """Submit `spec` on `cluster`; each task calls the entry with `cfg=cfg`."""
    spec = TaskSpec(spec) if isinstance(spec, str) else spec
    job = launch(spec, cluster, cfg)
    log(f"submitted {spec.entry} as slurm job {job.job_id} ({cluster.name}); logs {job.paths.stdout}")
    return job


def submit_and_wait(spec: TaskSpec | str, cluster: ClusterProfile, cfg: Any = None, log: Log = log_info) -> JobReport:
    """Submit `spec` on `cluster`, wait, and return its report; `SlurmJobFailed` on failure."""
    return watch(submit(spec, cluster, cfg, log), cluster, log)
