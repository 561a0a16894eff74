"""The whole config: one model per group, and the checks that span two groups."""

from __future__ import annotations

import os

from pydantic import model_validator

from kiln.config.base import (
    PairError,
    Strict,
)
from kiln.config.cluster import ClusterConfig
from kiln.config.data import DataConfig
from kiln.config.expander import ExpanderConfig
from kiln.config.ladder import LadderConfig
from kiln.config.metrics import MetricsConfig
from kiln.config.model import ModelConfig
from kiln.config.post import PostConfig
from kiln.config.style import StyleConfig
from kiln.config.train import TrainConfig


class KilnConfig(Strict):
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    cluster: ClusterConfig = ClusterConfig()
    metrics: MetricsConfig = MetricsConfig()
    ladder: LadderConfig = LadderConfig()
    post: PostConfig = PostConfig()
    style: StyleConfig = StyleConfig()
    expander: ExpanderConfig = ExpanderConfig()

    @model_validator(mode="after")
    def _tp_knows_the_mlp(self) -> KilnConfig:
        if (
            self.model.mlp != "swiglu" and self.train.parallel.tp > 1
        ):  # training/core/parallel.py shards SwiGLU's fused gate/up only
            raise PairError(
                f"model.mlp={self.model.mlp} has no tensor-parallel plan; use train.parallel.tp=1 (FSDP alone) or model.mlp=swiglu",
                "model.mlp",
                "train.parallel.tp",
            )
        return self

    @model_validator(mode="after")
    def _latents_are_the_models(self) -> KilnConfig:
        source, model = self.data.pack.latents_from, self.model
        if source is not None and (
            model.autoencoder != "kl" or os.path.abspath(source) != os.path.abspath(model.autoencoder_path or "")
        ):
            raise PairError(
                f"data.pack.latents_from={source} stores that autoencoder's latents, but the model's is "
                f"model.autoencoder={model.autoencoder} at {model.autoencoder_path}: the trainer would refuse the train "
                "set; set model.autoencoder=kl and model.autoencoder_path to the same folder (a profile can write "
                "data.pack.latents_from: ${model.autoencoder_path})",
                "data.pack.latents_from",
                "model.autoencoder_path",
            )
        return self
