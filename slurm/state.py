"""What Slurm says about jobs, without an accounting database.

submitit asks `sacct`, which fails where accounting is off (the local cluster, many small sites):
its state then reads UNKNOWN forever and a job killed by Slurm (time limit, OOM, scancel) never looks
finished. We ask `squeue --states=all` (jobs still in the controller's memory, MinJobAge) and fall
back to `sacct --completion` (the jobcomp file) for jobs that have left it.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

# States after which a job will not run again. PREEMPTED is not here: with requeue it comes back.
TERMINAL = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
)
QUERY_TIMEOUT_S = 30  # squeue / sacct hang rather than fail when munge or the controller is down


@dataclass(frozen=True)
class SlurmState:
    job_id: str
    state: str  # PENDING, RUNNING, COMPLETED, FAILED, ... (first word: "CANCELLED by 0" -> CANCELLED)
    nodes: str  # Slurm node list expression, "" while pending
    reason: str = ""

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _parse(text: str, wanted: set[str]) -> dict[str, SlurmState]:
    states = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 3 or parts[0] not in wanted:
            continue
        job_id, state, nodes, *rest = parts
        states[job_id] = SlurmState(job_id, state.split()[0] if state else "UNKNOWN", nodes, rest[0] if rest else "")
    return states


def query_states(job_ids: list[str]) -> dict[str, SlurmState]:
    """States of the given job ids (`123` or array tasks `123_4`); ids Slurm no longer knows are absent."""
    wanted = set(job_ids)
    if not wanted:
        return {}
    found = _parse(_run(["squeue", "--me", "--states=all", "-h", "-r", "-o", "%i|%T|%N|%r"]) or "", wanted)
    missing = sorted(wanted - set(found))
    if missing:
        bases = sorted({j.split("_")[0] for j in missing})
        cmd = ["sacct", "--completion", "-P", "-n", "-o", "JobID,State,NodeList"]
        for b in bases:
            cmd += ["-j", b]
        found.update(_parse(_run(cmd) or "", set(missing)))
    return found


def restarts(job_id: str) -> int:
    """How many times the job was requeued (0 once Slurm has forgotten it)."""
    out = _run(["scontrol", "show", "job", "-o", job_id]) or ""
    for token in out.split():
        if token.startswith("Restarts="):
            return int(token.split("=", 1)[1])
    return 0


def jobs_named(prefix: str = "kiln-") -> dict[str, tuple[str, SlurmState]]:
    """Job id -> (job name, state) for this user's jobs whose name starts with `prefix` (for the Dagster sensor)."""
    out = _run(["squeue", "--me", "--states=all", "-h", "-o", "%i|%j|%T|%N|%r"]) or ""
    found = {}
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 5 and parts[1].startswith(prefix):
            jid, name, state, nodes, reason = parts
            found[jid] = (name, SlurmState(jid, state.split()[0], nodes, reason))
    return found
