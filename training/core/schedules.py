"""Learning-rate schedules. Warmup-stable-decay (WSD) because a run can be extended, or a decay
branched off any stable-phase checkpoint, without re-planning the whole schedule."""

from __future__ import annotations


def wsd_lr(
    step: int, total_steps: int, base_lr: float, warmup_steps: int, decay_frac: float, min_lr_ratio: float = 0.0
) -> float:
    """LR for optimiser step `step` (0-based): linear warmup to `base_lr`, flat, then a linear decay
    over the last `decay_frac` of `total_steps` down to `min_lr_ratio * base_lr`."""
    if total_steps <= 0:
        raise ValueError("total_steps must be positive")
    warmup = min(max(warmup_steps, 0), total_steps)
    decay = min(int(round(decay_frac * total_steps)), total_steps - warmup)
    floor = min_lr_ratio * base_lr
    if step < warmup:
        return base_lr * (step + 1) / warmup
    decay_start = total_steps - decay
    if decay == 0 or step < decay_start:
        return base_lr
    progress = min((step - decay_start + 1) / decay, 1.0)
    return base_lr + (floor - base_lr) * progress
