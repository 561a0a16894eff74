"""Autoencoder adapters: what the DiT sees instead of pixels.

Both expose the same small interface: encode(uint8 [N, H, W, 3]) -> float [N, C, h, w] with roughly unit
scale, decode(float) -> uint8 [N, H, W, 3], `latent_channels` and `downsample`. Pixel space (the demo) is
the identity up to scaling to [-1, 1]; `KLAutoencoder` wraps diffusers' AutoencoderKL family by local path
and normalises latents by the VAE's own statistics (per-channel latents_mean/std when the config has them,
else shift_factor/scaling_factor). Encoding uses the posterior mode, so it is deterministic and cacheable.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor


def to_uint8_nhwc(x: Tensor) -> Tensor:
    """[-1, 1] NCHW float -> uint8 NHWC on the CPU (rounded, clamped)."""
    return ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()


def from_uint8_nhwc(images: np.ndarray | Tensor, device: torch.device | str = "cpu") -> Tensor:
    """uint8 NHWC -> [-1, 1] float32 NCHW."""
    x = torch.as_tensor(np.ascontiguousarray(images) if isinstance(images, np.ndarray) else images)
    if x.dtype != torch.uint8 or x.dim() != 4 or x.shape[-1] != 3:
        raise ValueError(f"expected uint8 [N, H, W, 3], got {x.dtype} {tuple(x.shape)}")
    return (x.to(device).permute(0, 3, 1, 2).float() / 127.5) - 1.0


class Autoencoder(Protocol):
    latent_channels: int
    downsample: int

    def encode(self, images: np.ndarray | Tensor) -> Tensor: ...
    def decode(self, latents: Tensor) -> Tensor: ...
    def identity(self) -> str: ...


class PixelAutoencoder:
    """Pixel space: the 'latent' is the image in [-1, 1]."""

    latent_channels = 3
    downsample = 1

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def to(self, device: torch.device | str) -> "PixelAutoencoder":
        self.device = torch.device(device)
        return self

    def encode(self, images: np.ndarray | Tensor) -> Tensor:
        return from_uint8_nhwc(images, self.device)

    def decode(self, latents: Tensor) -> Tensor:
        return to_uint8_nhwc(latents)

    def identity(self) -> str:
        return "pixel"


class KLAutoencoder:
    """A frozen diffusers AutoencoderKL (SD/SDXL/FLUX/SD3 VAEs and relatives) loaded from a local folder."""

    def __init__(self, path: str | Path, device: torch.device | str = "cpu"):
        from diffusers import AutoencoderKL

        self.path = Path(path)
        self.vae = AutoencoderKL.from_pretrained(str(self.path)).eval().requires_grad_(False).to(device)
        cfg = self.vae.config
        self.latent_channels = int(cfg.latent_channels)
        self.downsample = 2 ** (len(cfg.block_out_channels) - 1)
        c = self.latent_channels
        mean, std = getattr(cfg, "latents_mean", None), getattr(cfg, "latents_std", None)
        if mean is not None and std is not None:
            self.shift = torch.tensor(mean, dtype=torch.float32).view(1, c, 1, 1)
            self.scale = 1.0 / torch.tensor(std, dtype=torch.float32).view(1, c, 1, 1)
        else:
            self.shift = torch.full((1, c, 1, 1), float(getattr(cfg, "shift_factor", None) or 0.0))
            self.scale = torch.full((1, c, 1, 1), float(getattr(cfg, "scaling_factor", 1.0)))

    @property
    def device(self) -> torch.device:
        return next(self.vae.parameters()).device

    def to(self, device: torch.device | str) -> "KLAutoencoder":
        self.vae.to(device)
        return self

    @torch.no_grad()
    def encode(self, images: np.ndarray | Tensor) -> Tensor:
        x = from_uint8_nhwc(images, self.device).to(self.vae.dtype)
        z = self.vae.encode(x).latent_dist.mode().float()
        return (z - self.shift.to(z.device)) * self.scale.to(z.device)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        z = latents.float().to(self.device) / self.scale.to(self.device) + self.shift.to(self.device)
        return to_uint8_nhwc(self.vae.decode(z.to(self.vae.dtype)).sample)

    def identity(self) -> str:
        import json

        blob = json.dumps(dict(self.vae.config), sort_keys=True, default=str)
        return "kl-" + hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_autoencoder(
    kind: str, path: str | None, device: torch.device | str = "cpu"
) -> PixelAutoencoder | KLAutoencoder:
    if kind == "pixel":
        return PixelAutoencoder(device)
    if kind == "kl":
        if path is None:
            raise ValueError("model.autoencoder=kl needs model.autoencoder_path (a diffusers AutoencoderKL folder)")
        return KLAutoencoder(path, device)
    raise ValueError(f"unknown autoencoder {kind!r}")


class LatentCache:
    """Latents on disk, one safetensors file per image, keyed by sha256(autoencoder identity, image bytes)."""

    def __init__(self, root: str | Path, autoencoder: PixelAutoencoder | KLAutoencoder):
        self.ae = autoencoder
        self.root = Path(root) / autoencoder.identity()
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, image: np.ndarray) -> Path:
        h = hashlib.sha256(f"{image.shape}".encode() + np.ascontiguousarray(image).tobytes()).hexdigest()
        return self.root / f"{h}.safetensors"

    def encode(self, images: np.ndarray) -> Tensor:
        """Latents for uint8 [N, H, W, 3] images, computing only those not cached."""
        paths = [self._path(img) for img in images]
        missing = [i for i, p in enumerate(paths) if not p.exists()]
        if missing:
            fresh = self.ae.encode(images[missing]).cpu()
            for j, i in enumerate(missing):
                tmp = paths[i].with_suffix(
                    f".{os.getpid()}.{threading.get_ident()}.tmp"
                )  # ranks and loader threads may race
                save_file({"latent": fresh[j].contiguous()}, str(tmp))
                tmp.replace(paths[i])
        return torch.stack([load_file(str(p))["latent"] for p in paths])
