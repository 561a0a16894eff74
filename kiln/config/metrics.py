"""metrics: the distribution metrics of each checkpoint (FID, CMMD, DINO-MMD)."""

from __future__ import annotations

from pydantic import Field

from kiln.config.base import (
    MAX_BATCH,
    Seed,
    Strict,
)


class MetricsConfig(Strict):
    """Distribution metrics per checkpoint (training.evaluation.protocol): FID, CMMD, DINO-MMD against a
    reference image set of the dataset. An extractor path left None skips that metric, and the
    results say so; steps and CFG come from train.eval.steps and train.sample.cfg_scale."""

    fid_extractor: str | None = Field(
        None, description="HF image backbone folder (pooled output) for FID; None = no FID"
    )
    clip_extractor: str | None = Field(
        None, description="CLIPVisionModelWithProjection folder for CMMD; None = no CMMD"
    )
    dino_extractor: str | None = Field(None, description="Dinov2Model folder for DINO-MMD; None = no DINO-MMD")
    prompts_file: str | None = Field(None, description="one prompt a line; None = the demo prompts")
    n_per_prompt: int = Field(4, ge=1, le=10000, description="images generated per prompt for the distribution metrics")
    reference_images: int = Field(
        64, ge=2, le=10**7, description="real images of the main bucket (smallest sha1(id) first)"
    )
    seed: Seed = Field(2024, description="seed of the generation noise")
    batch_size: int = Field(32, ge=1, le=MAX_BATCH, description="images per extractor forward pass")
    history: str | None = Field(
        None, description="CSV kept across checkpoints (one row per step); None = only out/history.csv"
    )
