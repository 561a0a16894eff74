"""Per-step training telemetry: a JSONL log, a loss plot and a throughput summary.

Losses, grad norms and learning rates are deterministic and belong with the checkpoint; throughput
is wall-clock and is kept apart (`throughput.json`) so that `train_state.json` stays byte-identical
across runs of the same data and config.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class StepRecord:
    step: int  # 1-based: the number of optimiser steps done
    loss: float
    grad_norm: float
    lr: float
    samples: int  # rows in this step's batch
    tokens: int  # image tokens in this step's batch
    seconds: float  # wall-clock of this step

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> str:
        d = asdict(self) | {"samples_per_s": round(self.samples_per_s, 3), "tokens_per_s": round(self.tokens_per_s, 1)}
        return json.dumps(d, sort_keys=True)


class Telemetry:
    """Collects step records, appends them to `metrics.jsonl` and draws `loss.png` at the end."""

    def __init__(self, out_dir: Path, append: bool = False):
        self.out_dir = out_dir
        self.path = out_dir / "metrics.jsonl"
        out_dir.mkdir(parents=True, exist_ok=True)
        if not append:
            self.path.write_text("")
        self.records: list[StepRecord] = []
        self._started = time.perf_counter()

    def log(self, rec: StepRecord) -> None:
        self.records.append(rec)
        with self.path.open("a") as f:
            f.write(rec.to_json() + "\n")

    def throughput(self, skip: int = 1) -> dict[str, float]:
        """Mean samples/s and tokens/s over the run, skipping the first `skip` steps (warm-up allocations)."""
        recs = self.records[skip:] or self.records
        secs = sum(r.seconds for r in recs)
        return {
            "steps": len(self.records),
            "samples_per_s": round(sum(r.samples for r in recs) / secs, 3) if secs else 0.0,
            "tokens_per_s": round(sum(r.tokens for r in recs) / secs, 1) if secs else 0.0,
            "seconds_per_step": round(secs / len(recs), 5) if recs else 0.0,
            "wall_s": round(time.perf_counter() - self._started, 2),
        }

    def finish(self) -> dict[str, float]:
        from training.plots import plot_loss

        records = read_metrics(self.path)
        plot_loss(records, self.out_dir / "loss.png")
        # The deterministic columns as CSV, for `dvc plots` (DVC reads CSV / JSON, not JSONL).
        lines = ["step,loss,grad_norm,lr"] + [f"{r['step']},{r['loss']:.6g},{r['grad_norm']:.6g},{r['lr']:.6g}" for r in records]
        (self.out_dir / "loss.csv").write_text("\n".join(lines) + "\n")
        summary = self.throughput()
        (self.out_dir / "throughput.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        return summary


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
