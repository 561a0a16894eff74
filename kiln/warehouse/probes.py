"""Small synthetic stages that exercise the queue: tests, the benchmark, a smoke check of a new cluster.

They take `PROBE_INPUT` rows, whose columns steer them deterministically: `poison` makes COMPUTE raise
(a stage bug on one row), `sleep_s` makes it slow (so a worker can be killed mid-batch), `x` feeds a
deterministic computation with rejects, so results can be compared row for row between paths.
FAULTS takes `FAULT_INPUT` rows whose `fault` column makes the worker process itself fail on that row:
SIGKILL, a segfault, or a hang. Run it only on worker processes, never in the caller's own.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Iterable, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kiln.config import KilnConfig
from kiln.reasons import Reason
from kiln.stage import Rejects, Stage, StageOutput

PROBE_INPUT = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("uri", pa.string(), nullable=False),
        pa.field("x", pa.int64(), nullable=False),
        pa.field("poison", pa.bool_(), nullable=False),
        pa.field("sleep_s", pa.float32(), nullable=False),
    ]
)
PROBE_OUTPUT = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("uri", pa.string(), nullable=False),
        pa.field("x", pa.int64(), nullable=False),
        pa.field("y", pa.float64(), nullable=False),
        pa.field("code", pa.binary(4), nullable=False),
    ]
)
FILTERLIKE_OUTPUT = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("uri", pa.string(), nullable=False),
        pa.field("laplacian_var", pa.float32(), nullable=False),
        pa.field("entropy", pa.float32(), nullable=False),
    ]
)
REJECT_EVERY = 5  # COMPUTE rejects rows whose x is a multiple of this


def probe_rows(n: int, poison: Iterable[int] = (), sleep_s: float = 0.0, start: int = 0) -> pa.Table:
    """n rows with ids row-0000000...; rows whose index is in `poison` make COMPUTE raise."""
    xs = np.arange(start, start + n, dtype=np.int64)
    bad = set(poison)
    return pa.table(
        {
            "id": [f"row-{i:07d}" for i in xs],
            "uri": [f"probe://{i}" for i in xs],
            "x": xs,
            "poison": [int(i) in bad for i in xs],
            "sleep_s": np.full(n, sleep_s, dtype=np.float32),
        },
        schema=PROBE_INPUT,
    )


def noop(rows: pa.Table, cfg: KilnConfig) -> StageOutput:
    return StageOutput(rows, Rejects("probe_noop").table())


def compute(rows: pa.Table, cfg: KilnConfig) -> StageOutput:
    poisoned = pc.filter(rows.column("id"), rows.column("poison")).to_pylist()
    if poisoned:
        raise ValueError(f"poison rows {poisoned}")
    if rows.num_rows:
        time.sleep(float(pc.max(rows.column("sleep_s")).as_py()))
    x = rows.column("x").to_numpy()
    y = np.sin(x.astype(np.float64)) * np.sqrt(x + 1.0)
    code = [int(v * 2654435761 % 2**32).to_bytes(4, "big") for v in x]
    out = pa.table({"id": rows["id"], "uri": rows["uri"], "x": rows["x"], "y": y, "code": code}, schema=PROBE_OUTPUT)
    reject = x % REJECT_EVERY == 0
    rejects = Rejects("probe_compute")
    for i, u, v in zip(*(c.to_pylist() for c in pc.filter(out, reject).select(["id", "uri", "y"]).columns)):
        rejects.add(i, u, Reason.PROBE_REJECT, value=v, detail=f"x is a multiple of {REJECT_EVERY}")
    return StageOutput(out.filter(pa.array(~reject)), rejects.table())


def filterlike(rows: pa.Table, cfg: KilnConfig) -> StageOutput:
    """The per-row cost profile of a cheap CPU filter: a 64x64 image, its Laplacian variance and entropy."""
    lap, ent = [], []
    for x in rows.column("x").to_pylist():
        img = np.random.default_rng(x).integers(0, 256, (64, 64), dtype=np.uint8).astype(np.float32)
        k = 4 * img[1:-1, 1:-1] - img[:-2, 1:-1] - img[2:, 1:-1] - img[1:-1, :-2] - img[1:-1, 2:]
        p = np.bincount(img.astype(np.uint8).ravel(), minlength=256) / img.size
        lap.append(float(k.var()))
        ent.append(float(-(p[p > 0] * np.log2(p[p > 0])).sum()))
    out = pa.table(
        {"id": rows["id"], "uri": rows["uri"], "laplacian_var": lap, "entropy": ent}, schema=FILTERLIKE_OUTPUT
    )
    return StageOutput(out, Rejects("probe_filterlike").table())


FAULT_INPUT = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("uri", pa.string(), nullable=False),
        pa.field("x", pa.int64(), nullable=False),
        pa.field("fault", pa.string()),  # None, "raise", "sigkill", "segfault" or "hang"
    ]
)
FAULT_KINDS = ("raise", "sigkill", "segfault", "hang")


def fault_rows(n: int, fault_at: Mapping[int, str] | None = None) -> pa.Table:
    """n rows with ids row-0000000...; the row at index i carries fault_at[i]."""
    fault_at = dict(fault_at or {})
    if not set(fault_at.values()) <= set(FAULT_KINDS):
        raise ValueError(f"faults are {FAULT_KINDS}, not {sorted(set(fault_at.values()) - set(FAULT_KINDS))}")
    return pa.table(
        {
            "id": [f"row-{i:07d}" for i in range(n)],
            "uri": [f"probe://{i}" for i in range(n)],
            "x": np.arange(n, dtype=np.int64),
            "fault": [fault_at.get(i) for i in range(n)],
        },
        schema=FAULT_INPUT,
    )


def faults(rows: pa.Table, cfg: KilnConfig) -> StageOutput:
    """Keeps every row, unless one carries a fault: then it raises, or takes its worker process down."""
    for fault in rows.column("fault").to_pylist():
        if fault == "raise":
            raise RuntimeError("a probe row that always raises")
        if fault == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "segfault":
            ctypes.string_at(0)  # reads address 0: SIGSEGV
        if fault == "hang":
            time.sleep(3600)
    return StageOutput(rows, Rejects("probe_faults").table())


NOOP = Stage("probe_noop", noop, PROBE_INPUT, PROBE_INPUT)
FAULTS = Stage("probe_faults", faults, FAULT_INPUT, FAULT_INPUT)
COMPUTE = Stage("probe_compute", compute, PROBE_INPUT, PROBE_OUTPUT)
FILTERLIKE = Stage("probe_filterlike", filterlike, PROBE_INPUT, FILTERLIKE_OUTPUT)
