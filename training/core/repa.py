"""REPA (Yu et al. 2025) and iREPA: align an intermediate DiT block's image tokens with a frozen teacher.

    L_REPA = -E_x,t [ 1/N sum_n cos( y_n , h_phi(h_t^n) ) ]

y_n: the teacher's patch features of the clean image (any HF vision model by path: DINOv2/v3, SigLIP,
ViT: the last N tokens of last_hidden_state, so CLS and register tokens are skipped), resampled to the
DiT's token grid; h_t^n: block `block`'s output tokens for the noisy input; h_phi: a trainable projector.
REPA's projector is a 3-layer SiLU MLP per token. iREPA (`projector="conv"`) replaces it by a 3x3 conv over
the token grid (spatial context for the projection) and normalises the teacher features over the
spatial positions (zero mean, unit variance per channel across the grid) before the cosine, so that the
alignment target is the spatial structure rather than the global feature offset. The term is added with
`weight` for the first `steps` steps (`steps=0`: always), after which the projector stops mattering.

`teacher_path="classical"` aligns with a hand-made target instead, as MaskFeat predicts HOG: the classical
descriptor of the clean image (model/image_encoders.py: colour, gradient orientations, edge and foreground layout,
blob count and shape, spectrum), one vector per image given to every token. It needs no model, so the CPU
demo can use REPA (docs/training.md, "REPA against the hand-made descriptor").
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.config import ParallelConfig, RepaConfig
from kiln.config.train import REPA_CLASSICAL as CLASSICAL


class Teacher(nn.Module):
    """A frozen HF vision tower (DINOv2/v3, SigLIP, SigLIP-2 NaFlex, CLIP, ViT) returning its patch features on
    their grid, [B, D, gh, gw], fed what its own processor defines (model.vision: size, crop or NaFlex, mean
    and std), so the target is the representation the teacher was trained to give."""

    def __init__(self, path: str | Path):
        super().__init__()
        from model.vision import load_vision_model

        _, self.model, self.inputs = load_vision_model(path)
        self.dim = int(self.model.config.hidden_size)

    @torch.no_grad()
    def forward(self, images: Tensor) -> Tensor:
        """images [B, 3, H, W] in [-1, 1] -> patch features [B, D, gh, gw] at the teacher's own resolution."""
        inputs = self.inputs.prepare((images.float() + 1) / 2)
        hidden = self.model(**{k: v.to(images.device) for k, v in inputs.items()}).last_hidden_state
        return self.inputs.patch_tokens(hidden, inputs)


class ClassicalTeacher(nn.Module):
    """The classical descriptor of each clean image, [B, D, 1, 1], standardised over the batch: what tells the
    batch's images apart, not the direction every descriptor shares (its blocks are non-negative histograms,
    so raw vectors are all within a small angle of each other and the cosine would teach little). A batch of
    one has nothing to compare and gives zeros, which the cosine ignores. Descriptors are cached by the
    image's bytes, as a training set repeats its images every epoch."""

    def __init__(self, cache_size: int = 2**17):
        super().__init__()
        from model.image_encoders import classical_descriptor

        self._describe = classical_descriptor
        self._cache: OrderedDict[bytes, Tensor] = OrderedDict()
        self._cache_size = cache_size
        self.dim = len(classical_descriptor(_blank()))

    def _one(self, pixels: np.ndarray) -> Tensor:
        from PIL import Image

        key = hashlib.blake2b(pixels.tobytes() + bytes(str(pixels.shape), "ascii"), digest_size=16).digest()
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        value = torch.from_numpy(self._describe(Image.fromarray(pixels)).astype(np.float32))
        self._cache[key] = value
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return value

    @torch.no_grad()
    def forward(self, images: Tensor) -> Tensor:
        from model.autoencoder import to_uint8_nhwc

        y = torch.stack([self._one(p) for p in to_uint8_nhwc(images).numpy()])
        y = (y - y.mean(0, keepdim=True)) / (y.std(0, keepdim=True, unbiased=False) + 1e-3)
        return y.to(images.device)[:, :, None, None]


def _blank():
    from PIL import Image

    return Image.new("RGB", (32, 32), (128, 128, 128))


def make_teacher(path: str) -> nn.Module:
    return ClassicalTeacher() if path == CLASSICAL else Teacher(path)


def teacher_targets(features: Tensor, grid: tuple[int, int], spatial_norm: bool) -> Tensor:
    """Teacher features resampled to the DiT's patch grid, [B, N, D]; iREPA normalises over positions."""
    y = F.adaptive_avg_pool2d(features, grid) if features.shape[-2:] != grid else features
    if spatial_norm:
        y = (y - y.mean(dim=(2, 3), keepdim=True)) / (y.std(dim=(2, 3), keepdim=True) + 1e-6)
    return y.flatten(2).transpose(1, 2)


class Projector(nn.Module):
    """DiT tokens [B, N, width] on a (gh, gw) grid -> teacher space [B, N, D]."""

    def __init__(self, width: int, teacher_dim: int, hidden: int, kind: str = "mlp"):
        super().__init__()
        self.kind = kind
        if kind == "mlp":
            self.net = nn.Sequential(
                nn.Linear(width, hidden),
                nn.SiLU(),
                nn.Linear(hidden, hidden),
                nn.SiLU(),
                nn.Linear(hidden, teacher_dim),
            )
        elif kind == "conv":
            self.net = nn.Conv2d(width, teacher_dim, kernel_size=3, padding=1)
        else:
            raise ValueError(f"unknown REPA projector {kind!r}")

    def forward(self, tokens: Tensor, grid: tuple[int, int]) -> Tensor:
        if self.kind == "mlp":
            return self.net(tokens)
        b, _, w = tokens.shape
        x = tokens.transpose(1, 2).reshape(b, w, *grid)
        return self.net(x).flatten(2).transpose(1, 2)


def repa_loss(projected: Tensor, target: Tensor) -> Tensor:
    """-mean over samples and tokens of cos(y_n, h_phi(h_n)): the published REPA term (fp32)."""
    return -F.cosine_similarity(projected.float(), target.float(), dim=-1).mean()


def repa_active(cfg: RepaConfig, step: int) -> bool:
    return cfg.teacher_path is not None and cfg.weight > 0 and (cfg.steps == 0 or step < cfg.steps)


class BlockTap:
    """Keeps the output of one DiT block from the last forward (a forward hook; `remove()` detaches it)."""

    def __init__(self, block: nn.Module):
        self.output: Tensor | None = None
        self._handle = block.register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        self.output = output

    def remove(self) -> None:
        self._handle.remove()


def image_tokens(seq: Tensor, text_len: int, timestep_tokens: int, grid: tuple[int, int]) -> Tensor:
    """The patch tokens of a DiT sequence (text and timestep tokens first, padding last)."""
    start = text_len + timestep_tokens
    return seq[:, start : start + grid[0] * grid[1]]


class Repa(nn.Module):
    """The REPA term for a Generator: teacher + projector + the tap on the configured block."""

    def __init__(self, gen: nn.Module, cfg: RepaConfig):
        super().__init__()
        if cfg.teacher_path is None:
            raise ValueError("train.repa.teacher_path is not set")
        self.cfg = cfg
        if cfg.teacher_path == CLASSICAL and cfg.projector == "conv":
            raise ValueError(
                "train.repa.teacher_path=classical gives one vector per image, which iREPA's normalisation over positions would zero: use projector=mlp"
            )
        self.__dict__["teacher"] = make_teacher(cfg.teacher_path)  # frozen, not a submodule: never trained or saved
        self.projector = Projector(gen.dit_cfg.width, self.teacher.dim, cfg.hidden, cfg.projector)
        self.tap = BlockTap(gen.dit.blocks[cfg.block])
        self.text_len, self.timestep_tokens, self.patch = (
            gen.text_length,
            gen.dit_cfg.timestep_tokens,
            gen.dit_cfg.patch_size,
        )

    def loss(self, images: Tensor, latent_hw: tuple[int, int]) -> Tensor:
        """The term for the last forward of the Generator; images [B, 3, H, W] in [-1, 1] (the clean inputs)."""
        if self.tap.output is None:
            raise RuntimeError("REPA: run the Generator forward first")
        grid = (latent_hw[0] // self.patch, latent_hw[1] // self.patch)
        target = teacher_targets(self.teacher(images), grid, spatial_norm=self.cfg.projector == "conv")
        tokens = image_tokens(self.tap.output, self.text_len, self.timestep_tokens, grid)
        return repa_loss(self.projector(tokens, grid), target.to(tokens.device))

    def make_optimizer(self, mesh, train_cfg) -> torch.optim.Optimizer:
        """AdamW for the projector (it is not part of the Generator's checkpoint). On a mesh the projector is
        FSDP-sharded over dp, which averages its gradients like the model's; tp ranks hold the same rows."""
        if mesh is not None:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.projector, mesh=mesh["dp_shard"])
        return torch.optim.AdamW(
            self.projector.parameters(), lr=train_cfg.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False
        )


def build_repa(gen: nn.Module, cfg: RepaConfig, parallel: ParallelConfig, device: torch.device) -> Repa:
    """The REPA term for a Generator about to be parallelised: the tap must be on the block before sharding."""
    if parallel.sequence_parallel:
        raise ValueError(
            "train.repa with parallel.sequence_parallel is not supported: the tapped block's tokens are sharded over the sequence"
        )
    if not 0 <= cfg.block < len(gen.dit.blocks):
        raise ValueError(f"train.repa.block={cfg.block} but the DiT has {len(gen.dit.blocks)} blocks")
    repa = Repa(gen, cfg)
    repa.teacher.to(device)
    return repa.to(device)
