"""The whole config: one model per group, and the checks that span two groups."""

from __future__ import annotations

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
    def _latents_need_an_autoencoder(self) -> KilnConfig:
        if self.data.pack.latents and self.model.autoencoder == "pixel":
            raise PairError(
                "data.pack.latents stores model.autoencoder's latents, and model.autoencoder=pixel has none: "
                "set model.autoencoder=kl and model.autoencoder_path, or data.pack.latents=false",
                "data.pack.latents",
                "model.autoencoder",
            )
        return self
