"""Style references: images that steer a sample's style, each with a strength in [0, 1].

A reference goes through an encoder (a small trainable conv net, the offline classical descriptor of
model/image_encoders.py, or a frozen HF vision model by path) and a projector to `grid * grid` tokens of the DiT's
width. The DiT appends them to its sequence after the image patches, at their own RoPE positions (a grid
in frame 1, shared by all references; the image is frame 0, text sits at the origin), so every block
attends to them, and swapping two references changes nothing.

Strength acts as an additive attention-logit bias log(strength) on the keys of that reference's tokens:
every query's attention weight on them is multiplied by `strength` before the softmax renormalises, so
influence grows continuously with strength, several references mix by their strengths, and strength 0
(bias -inf) removes them exactly: no query ever reads them, so the sample is the one without references.
A batch whose samples carry different numbers of references pads with strength-0 references.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn

from kiln.config import ReferenceConfig


@dataclass(frozen=True)
class ReferenceBatch:
    """The encoder's inputs for a batch: `inputs` [B, R, ...] (float pixels in [-1, 1] for the conv
    encoder, descriptors for the frozen ones) and `strength` [B, R] in [0, 1]."""

    inputs: Tensor
    strength: Tensor

    def to(self, device: torch.device | str) -> ReferenceBatch:
        return ReferenceBatch(self.inputs.to(device), self.strength.to(device))

    @staticmethod
    def cat(batches: Sequence[ReferenceBatch]) -> ReferenceBatch:
        return ReferenceBatch(torch.cat([b.inputs for b in batches]), torch.cat([b.strength for b in batches]))

    def with_strength(self, strength: float | Tensor) -> ReferenceBatch:
        """The same references at another strength (every reference of every sample)."""
        s = torch.as_tensor(strength, dtype=self.strength.dtype, device=self.strength.device)
        return ReferenceBatch(self.inputs, torch.broadcast_to(s, self.strength.shape).clone())


@dataclass(frozen=True)
class ReferenceTokens:
    """What the DiT receives: tokens [B, R, T, width], strength [B, R] and the token grid side (T = grid^2)."""

    tokens: Tensor
    strength: Tensor
    grid: int

    def key_bias(self, dtype: torch.dtype) -> Tensor:
        """[B, R*T] additive logit bias log(strength) of every reference token (-inf at strength 0)."""
        t = self.tokens.shape[2]
        return torch.log(self.strength.float()).repeat_interleave(t, dim=1).to(dtype)

    def positions(self) -> Tensor:
        """[R*T, 3] RoPE positions: every reference's tokens on a grid in frame 1. One frame for all keeps
        the model blind to the references' order, so a model trained on one reference mixes several."""
        r, t = self.tokens.shape[1], self.tokens.shape[2]
        j = torch.arange(t)
        return torch.stack([torch.ones_like(j), j // self.grid, j % self.grid], dim=-1).repeat(r, 1)


def check_strengths(strength: Tensor) -> None:
    if strength.numel() and (not torch.isfinite(strength).all() or strength.min() < 0 or strength.max() > 1):
        raise ValueError(f"reference strengths must lie in [0, 1], got {strength.flatten().tolist()[:8]}")


class ConvEncoder(nn.Module):
    """Two stride-2 convolutions and an adaptive pool to a grid x grid feature map: cheap, trainable, and
    colour-sensitive (a background's colour is what the demo's style is)."""

    def __init__(self, channels: int, grid: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, channels, 3, stride=2, padding=1),
            nn.SiLU(),
            nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1),
            nn.SiLU(),
            nn.AdaptiveAvgPool2d(grid),
        )
        self.out_dim = 2 * channels

    def forward(self, pixels: Tensor) -> Tensor:
        """[N, 3, S, S] -> [N, grid*grid, out_dim]."""
        return self.net(pixels).flatten(2).transpose(1, 2)


class FrozenDescriptor:
    """A frozen image -> vector encoder (no parameters in the model): the classical descriptor, or an HF
    vision model by path, both through model/image_encoders.py."""

    def __init__(self, cfg: ReferenceConfig):
        from kiln.config import EmbedConfig
        from model.image_encoders import make_embedder

        kind = "classical" if cfg.encoder == "classical" else "hf"
        self.embedder = make_embedder(EmbedConfig(embedder=kind, path=cfg.encoder_path, size=max(16, cfg.image_size)))
        self.dim = int(self.embedder.embed([Image.new("RGB", (cfg.image_size, cfg.image_size))]).shape[1])

    def __call__(self, images: list[Image.Image]) -> np.ndarray:
        return self.embedder.embed(images).astype(np.float32)


class ReferencePathway(nn.Module):
    """Encoder + projector: a ReferenceBatch -> ReferenceTokens of the DiT's width."""

    def __init__(self, cfg: ReferenceConfig, width: int):
        super().__init__()
        self.cfg, self.tokens = cfg, cfg.grid * cfg.grid
        if cfg.encoder == "conv":
            self.encoder = ConvEncoder(cfg.conv_channels, cfg.grid)
            self.projector = nn.Sequential(nn.Linear(self.encoder.out_dim, width), nn.SiLU(), nn.Linear(width, width))
        else:
            self.__dict__["descriptor"] = FrozenDescriptor(cfg)  # frozen, held by reference: never saved
            self.projector = nn.Sequential(
                nn.Linear(self.descriptor.dim, width), nn.SiLU(), nn.Linear(width, self.tokens * width)
            )
        self.width = width
        self.init_weights()

    def init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)

    def prepare(self, images: Sequence[Sequence[np.ndarray]], strengths: Sequence[Sequence[float]]) -> ReferenceBatch:
        """Per sample a list of uint8 [H, W, 3] references and their strengths -> the encoder's inputs,
        padded to the batch's largest count with strength-0 references."""
        if len(images) != len(strengths) or any(len(i) != len(s) for i, s in zip(images, strengths, strict=True)):
            raise ValueError("every reference needs exactly one strength")
        r = max((len(i) for i in images), default=0)
        if r > self.cfg.max_references:
            raise ValueError(
                f"{r} references on one sample; model.reference.max_references is {self.cfg.max_references}"
            )
        r = max(r, 1)
        side = self.cfg.image_size
        strength = torch.zeros(len(images), r)
        pics = np.zeros((len(images), r, side, side, 3), np.uint8)
        for b, (ims, ss) in enumerate(zip(images, strengths, strict=True)):
            for k, (im, s) in enumerate(zip(ims, ss, strict=True)):
                pics[b, k] = np.asarray(
                    Image.fromarray(np.asarray(im, np.uint8)).convert("RGB").resize((side, side), Image.BILINEAR)
                )
                strength[b, k] = float(s)
        check_strengths(strength)
        if self.cfg.encoder == "conv":
            inputs = torch.from_numpy(pics).permute(0, 1, 4, 2, 3).float() / 127.5 - 1.0
        else:
            flat = [Image.fromarray(p) for p in pics.reshape(-1, side, side, 3)]
            inputs = torch.from_numpy(self.descriptor(flat)).view(len(images), r, -1)
        return ReferenceBatch(inputs, strength)

    def forward(self, batch: ReferenceBatch) -> ReferenceTokens:
        check_strengths(batch.strength)
        b, r = batch.strength.shape
        dtype = self.projector[0].weight.dtype
        if self.cfg.encoder == "conv":
            feats = self.encoder(batch.inputs.flatten(0, 1).to(dtype))  # [B*R, T, C]
            tokens = self.projector(feats)
        else:
            tokens = self.projector(batch.inputs.flatten(0, 1).to(dtype))
        return ReferenceTokens(tokens.view(b, r, self.tokens, self.width), batch.strength, self.cfg.grid)
