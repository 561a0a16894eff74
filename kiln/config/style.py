"""style: style-reference training and its evaluation."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from kiln.config.base import (
    MAX_BATCH,
    MAX_STEPS,
    Seed,
    Strict,
)


class StyleConfig(Strict):
    """Style-reference training and its evaluation (training/style/train.py, training/style/evaluate.py,
    docs/style.md). The pathway's shape is `model.reference`; a checkpoint without one gets it added."""

    reference: Literal["family", "crop"] = Field(
        "family",
        description="family: another image of the same style family (demo: same background, other shape); crop: a crop of the image itself",
    )
    steps: int = Field(300, ge=1, le=MAX_STEPS)
    batch_size: int = Field(16, ge=1, le=MAX_BATCH)
    lr: float = Field(3e-4, gt=0, le=1)
    grad_clip: float = Field(1.0, gt=0, le=1e6)
    save_every: int = Field(50, ge=1, le=MAX_STEPS, description="DCP checkpoint every this many steps")
    no_reference_prob: float = Field(
        0.1,
        ge=0,
        le=1,
        description="share of training samples without a reference (the model keeps working without one)",
    )
    crop_min: float = Field(
        0.5, gt=0, le=1, description="crop references: smallest crop side, as a share of the image side"
    )
    seed: Seed = 0
    eval_strengths: list[Annotated[float, Field(ge=0, le=1)]] = Field(
        default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0], min_length=1
    )
    eval_cases: int = Field(32, ge=1, le=100_000, description="evaluation (prompt, reference) cases per strength")
    eval_steps: int = Field(10, ge=1, le=10000, description="sampler steps of the evaluation")
    eval_cfg_scale: float = Field(3.0, ge=0, le=100)
    leakage_bound: float = Field(
        0.3, ge=0, le=1, description="the content-leakage rate the benchmark and asset check stay under"
    )
