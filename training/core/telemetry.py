"""Per-step training telemetry: a JSONL log, spike detection, MFU, GPU health, a loss plot and a summary.

Losses, grad norms, learning rates and the spikes found in them are deterministic and belong with the
checkpoint (`loss.csv`, `spikes.json`); throughput, MFU and GPU counters are wall-clock and are kept
apart (`metrics.jsonl`'s timing columns, `throughput.json`) so the deterministic files stay byte-identical
across runs of the same data and config.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kiln.progress import log


@dataclass(frozen=True)
class StepRecord:
    step: int  # 1-based: the number of optimiser steps done
    loss: float
    grad_norm: float
    lr: float
    samples: int  # rows in this step's (global) batch
    tokens: int  # image tokens in this step's batch
    seconds: float  # wall-clock of this step
    flops: float = 0.0  # model FLOPs of the step (forward + backward, all devices)
    devices: int = 1  # devices that shared the step
    peak_tflops: float | None = None  # one device's peak, for MFU; None = unknown (CPU)
    repa_loss: float | None = None  # the REPA term, when it is on
    gpu: dict = field(default_factory=dict)  # NVML counters of this rank's GPU (training/core/gpu_telemetry.py)
    rank_seconds: list[float] | None = (
        None  # each rank's own step time, in rank order (distributed runs: training/core/stragglers.py)
    )
    stragglers: list[int] = field(
        default_factory=list
    )  # ranks slower than the median rank by train.telemetry.straggler_factor

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tflops_per_device(self) -> float:
        return self.flops / self.seconds / self.devices / 1e12 if self.seconds > 0 else 0.0

    @property
    def mfu(self) -> float | None:
        return self.tflops_per_device / self.peak_tflops if self.peak_tflops else None

    def to_dict(self) -> dict:
        d = {
            k: v
            for k, v in asdict(self).items()
            if k not in ("gpu", "peak_tflops", "repa_loss", "rank_seconds", "stragglers")
        }
        if self.rank_seconds is not None:
            d |= {"rank_seconds": [round(s, 5) for s in self.rank_seconds], "stragglers": self.stragglers}
        d |= {
            "samples_per_s": round(self.samples_per_s, 3),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "tflops_per_device": round(self.tflops_per_device, 6),
        }
        if self.mfu is not None:
            d["mfu"] = round(self.mfu, 4)
        if self.repa_loss is not None:
            d["repa_loss"] = self.repa_loss
        return d | self.gpu


class SpikeDetector:
    """Flags a value more than `z` standard deviations above the mean of the previous `window` values.

    Loss spikes (and the grad-norm spikes that usually come a step before them) are the early sign of a
    diverging run; flagging them as they happen lets a person roll back to the checkpoint before one.
    The first `window // 2` values are never flagged (no baseline yet); the std has a floor of 1% of the
    mean so a flat stretch does not turn noise into spikes."""

    def __init__(self, window: int = 50, z: float = 6.0):
        self.values: deque[float] = deque(maxlen=window)
        self.window, self.z = window, z

    def update(self, value: float) -> bool:
        spike = False
        if len(self.values) >= max(self.window // 2, 2) and math.isfinite(value):
            mean = sum(self.values) / len(self.values)
            std = math.sqrt(sum((v - mean) ** 2 for v in self.values) / len(self.values))
            spike = value > mean + self.z * max(std, 0.01 * abs(mean))
        if not math.isfinite(value):
            spike = True
        else:
            self.values.append(value)
        return spike


class Telemetry:
    """Collects step records, appends them to `metrics.jsonl`, flags spikes; plots and summarises at the end."""

    def __init__(self, out_dir: Path, resume_step: int = 0, spike_window: int = 50, spike_z: float = 6.0):
        """`resume_step` > 0: a run resumed from that step's checkpoint keeps the log up to it and drops the
        steps logged after it (a pre-empted run's work since its last checkpoint, which is about to be redone)."""
        self.out_dir = out_dir
        self.path = out_dir / "metrics.jsonl"
        out_dir.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(self.path) if r["step"] <= resume_step] if resume_step > 0 else []
        self.path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
        self.records: list[StepRecord] = []
        self.loss_spikes, self.grad_spikes = SpikeDetector(spike_window, spike_z), SpikeDetector(spike_window, spike_z)
        # a resumed run re-reads the steps already logged, so its spike baseline is the uninterrupted run's
        for r in kept:
            self.loss_spikes.update(r["loss"])
            self.grad_spikes.update(r["grad_norm"])
        self._started = time.perf_counter()

    def log(self, rec: StepRecord) -> dict:
        """Append one step; returns its row (with `loss_spike` / `grad_spike` flags)."""
        self.records.append(rec)
        row = rec.to_dict() | {
            "loss_spike": self.loss_spikes.update(rec.loss),
            "grad_spike": self.grad_spikes.update(rec.grad_norm),
        }
        if rec.stragglers:
            log.warning(
                "step %d: straggler rank(s) %s (step seconds per rank %s)",
                rec.step,
                rec.stragglers,
                [round(s, 3) for s in rec.rank_seconds or []],
            )
        if row["loss_spike"] or row["grad_spike"]:
            log.warning(
                "step %d: %s spike (loss %.4g, grad norm %.4g)",
                rec.step,
                "loss" if row["loss_spike"] else "grad-norm",
                rec.loss,
                rec.grad_norm,
            )
        with self.path.open("a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
        return row

    def throughput(self, skip: int = 1) -> dict[str, float | None]:
        """Means over the run, skipping the first `skip` steps (warm-up allocations, compilation)."""
        recs = self.records[skip:] or self.records
        secs = sum(r.seconds for r in recs)
        flops = sum(r.flops for r in recs)
        devices = recs[0].devices if recs else 1
        peak = recs[0].peak_tflops if recs else None
        tflops = flops / secs / devices / 1e12 if secs else 0.0
        return {
            "steps": len(self.records),
            "samples_per_s": round(sum(r.samples for r in recs) / secs, 3) if secs else 0.0,
            "tokens_per_s": round(sum(r.tokens for r in recs) / secs, 1) if secs else 0.0,
            "seconds_per_step": round(secs / len(recs), 5) if recs else 0.0,
            "tflops_per_device": round(tflops, 6),
            "devices": devices,
            "mfu": round(tflops / peak, 4) if peak else None,
            "peak_tflops_per_device": peak,
            "wall_s": round(time.perf_counter() - self._started, 2),
        }

    def finish(self) -> dict[str, float | None]:
        from training.core.plots import plot_loss

        records = read_metrics(self.path)
        plot_loss(records, self.out_dir / "loss.png")
        # The deterministic columns as CSV, for `dvc plots` (DVC reads CSV / JSON, not JSONL).
        lines = ["step,loss,grad_norm,lr"] + [
            f"{r['step']},{r['loss']:.6g},{r['grad_norm']:.6g},{r['lr']:.6g}" for r in records
        ]
        (self.out_dir / "loss.csv").write_text("\n".join(lines) + "\n")
        spikes = {
            "loss": [r["step"] for r in records if r.get("loss_spike")],
            "grad_norm": [r["step"] for r in records if r.get("grad_spike")],
        }
        (self.out_dir / "spikes.json").write_text(json.dumps(spikes, indent=2, sort_keys=True) + "\n")
        summary = self.throughput() | {
            "loss_spikes": len(spikes["loss"]),
            "grad_spikes": len(spikes["grad_norm"]),
            "straggler_steps": sum(bool(r.get("stragglers")) for r in records),
        }
        (self.out_dir / "throughput.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        return summary


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
