"""Per-rank step timing and straggler detection.

In a synchronous data-parallel job every rank waits for the slowest at each collective, so one slow GPU
(thermal throttling, a bad link, a noisy neighbour on the node) slows the whole job without failing it.
Each rank times its own step up to the first wait (data, forward, backward: `busy` seconds); the times are
gathered on every step and a rank slower than the median rank by `factor` is flagged in telemetry
(`rank_seconds`, `stragglers` in metrics.jsonl, and a warning). A rank that never arrives is a hang: the
process-group timeout (`train.parallel.watchdog_timeout_s`) and the NCCL flight recorder cover that.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist


def find_stragglers(seconds: list[float], factor: float) -> list[int]:
    """Ranks whose time exceeds `factor` x the median rank's (none with fewer than two ranks)."""
    if len(seconds) < 2:
        return []
    median = statistics.median(seconds)
    return [rank for rank, s in enumerate(seconds) if s > factor * median]


def gather_rank_seconds(seconds: float, device: torch.device) -> list[float]:
    """Every rank's `seconds`, in rank order (one small all-gather; just [seconds] without a group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [seconds]
    mine = torch.tensor([seconds], dtype=torch.float64, device=device)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [float(t) for t in out]
