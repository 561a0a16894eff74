"""Sensors that record what changed outside a run as asset observations: the source's listing, kiln's Slurm jobs."""

from __future__ import annotations

import json

import dagster as dg

from dagster_project.resources import KilnResource
from slurm.state import jobs_named

# Slurm job name -> the asset the job materializes.
JOB_ASSETS = {"kiln-train": "checkpoint"}


@dg.sensor(
    minimum_interval_seconds=30,
    default_status=dg.DefaultSensorStatus.STOPPED,
    description="squeue for kiln-* jobs; observations on the assets they build",
)
def slurm_jobs(context: dg.SensorEvaluationContext) -> dg.SensorResult:
    seen: dict[str, str] = json.loads(context.cursor or "{}")
    events = []
    for jid, (name, st) in sorted(jobs_named().items()):
        if seen.get(jid) == st.state or name not in JOB_ASSETS:
            continue
        seen[jid] = st.state
        events.append(
            dg.AssetObservation(
                asset_key=JOB_ASSETS[name],
                metadata={
                    "slurm_job_id": jid,
                    "slurm_state": st.state,
                    "slurm_nodes": st.nodes,
                    "slurm_reason": st.reason,
                },
            )
        )
    return dg.SensorResult(asset_events=events, cursor=json.dumps(seen, sort_keys=True))


def recorded_source_version(instance: dg.DagsterInstance) -> str | None:
    """The data version of raw_images' latest observation."""
    from dagster._core.definitions.data_version import extract_data_version_from_entry

    record = instance.get_latest_data_version_record(dg.AssetKey("raw_images"), is_source=True)
    version = extract_data_version_from_entry(record.event_log_entry) if record else None
    return version.value if version else None


def observe_source(instance: dg.DagsterInstance, kiln: KilnResource) -> dg.AssetObservation | None:
    """List the source; when its version differs from the one recorded, an observation carrying the new one.

    Dagster compares each downstream asset's recorded input version with this, so a new, changed or removed
    object marks manifest and everything after it stale without running anything."""
    from dagster_project.assets import observe_listing

    result = observe_listing(kiln)
    if result.data_version is None or result.data_version.value == recorded_source_version(instance):
        return None
    return dg.AssetObservation(
        asset_key="raw_images", tags={"dagster/data_version": result.data_version.value}, metadata=result.metadata
    )


@dg.sensor(
    minimum_interval_seconds=300,
    default_status=dg.DefaultSensorStatus.STOPPED,
    description="lists data.source; an observation on raw_images when its version changed (downstream turns stale)",
)
def source_changes(context: dg.SensorEvaluationContext, kiln: KilnResource) -> dg.SensorResult:
    observation = observe_source(context.instance, kiln)
    return dg.SensorResult(asset_events=[observation] if observation else [])
