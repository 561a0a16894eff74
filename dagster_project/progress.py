"""One line per finished asset on the terminal (`kiln run`): rows in, kept, rejected, seconds.

Dagster's own event stream stays in the run's event log (the UI) and at WARNING on the console."""

from __future__ import annotations

import sys
import time

import dagster as dg

QUIET_CONSOLE = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}


def _seconds(context: dg.HookContext) -> float | None:
    starts = [
        e
        for e in context.instance.all_logs(context.run_id, of_type=dg.DagsterEventType.STEP_START)
        if e.step_key == context.step_key
    ]
    return None if not starts else max(0.0, time.time() - starts[-1].timestamp)


def progress_line(key: str, metadata: dict, seconds: float | None) -> str:
    def value(name: str):
        v = metadata.get(name)
        return getattr(v, "value", v)

    parts = [f"{key:<16}"]
    if value("input_rows") is not None:
        parts.append(f"{value('input_rows'):>8} in {value('kept'):>8} kept {value('rejected'):>7} rejected")
    elif value("objects") is not None:
        parts.append(f"{value('objects'):>8} objects listed")
    if seconds is not None:
        parts.append(f"{seconds:7.1f} s")
    return "  ".join(parts)


def _metadata(context: dg.HookContext, key: str) -> dict:
    """The metadata this run recorded for the asset: its materialization, or (raw_images) its observation."""
    for is_source in (False, True):
        record = context.instance.get_latest_data_version_record(dg.AssetKey(key), is_source=is_source)
        if record is not None and record.run_id == context.run_id:
            event = record.event_log_entry.asset_materialization or record.event_log_entry.asset_observation
            return dict(event.metadata) if event else {}
    return {}


@dg.success_hook(name="kiln_progress_line")
def kiln_progress_line(context: dg.HookContext) -> None:
    key = context.op.name
    metadata = _metadata(context, key)
    if not metadata:  # an asset check's op, or an asset that recorded nothing
        return
    print(f"kiln run: {progress_line(key, metadata, _seconds(context))}", file=sys.stderr, flush=True)
