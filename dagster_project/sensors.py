"""A sensor that watches kiln's Slurm jobs and records each state change as an asset observation."""

from __future__ import annotations

import json

import dagster as dg

from slurm.state import jobs_named

# Slurm job name -> the asset the job materializes.
JOB_ASSETS = {"kiln-train": "checkpoint"}


@dg.sensor(minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.STOPPED, description="squeue for kiln-* jobs; observations on the assets they build")
def slurm_jobs(context: dg.SensorEvaluationContext) -> dg.SensorResult:
    seen: dict[str, str] = json.loads(context.cursor or "{}")
    events = []
    for jid, (name, st) in sorted(jobs_named().items()):
        if seen.get(jid) == st.state or name not in JOB_ASSETS:
            continue
        seen[jid] = st.state
        events.append(dg.AssetObservation(asset_key=JOB_ASSETS[name], metadata={"slurm_job_id": jid, "slurm_state": st.state, "slurm_nodes": st.nodes, "slurm_reason": st.reason}))
    return dg.SensorResult(asset_events=events, cursor=json.dumps(seen, sort_keys=True))
