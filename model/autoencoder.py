"""Autoencoder adapters: what the DiT sees instead of pixels.

Each exposes the same small interface: encode(uint8 [N, H, W, 3]) -> float [N, C, h, w] with roughly unit
scale, decode(float) -> uint8 [N, H, W, 3], `latent_channels`, `downsample` and `identity()`. Pixel space
(the demo) is the identity up to scaling to [-1, 1]. `load_vae` reads a diffusers folder's `_class_name` and
picks its adapter: AutoencoderKL (SD, SDXL, SD3, FLUX.1), AutoencoderKLFlux2 (FLUX.2) or AutoencoderKLQwenImage
(Qwen-Image), each normalising latents as its own diffusers pipeline does; any other class is refused by name.
Encoding uses the posterior mode, so it is deterministic and cacheable (docs/model.md, "Autoencoders").
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


def patchify2x2(z: Tensor) -> Tensor:
    """[B, C, h, w] -> [B, 4C, h/2, w/2], channel c*4 + 2*dy + dx: FLUX.2's latent layout (its pipeline's own)."""
    b, c, h, w = z.shape
    return z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


def unpatchify2x2(z: Tensor) -> Tensor:
    b, c, h, w = z.shape
    return z.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, h * 2, w * 2)


VAE_ID_VERSION = "kiln-vae-2"  # bump when an adapter's formula changes: ids of latents written before then differ


class DiffusersVAE:
    """A frozen diffusers autoencoder from a local folder, as the DiT sees it: 4D latents of roughly unit scale
    in the space the model's own diffusers pipeline trains in. A subclass per class (`cls_name`) says how."""

    cls_name = ""
    family = ""

    def __init__(self, path: str | Path, device: torch.device | str = "cpu"):
        import diffusers

        self.path = Path(path)
        vae = getattr(diffusers, self.cls_name).from_pretrained(str(self.path))
        self.vae = vae.eval().requires_grad_(False).to(device)
        self._identity: str | None = None
        self._setup(self.vae.config)

    @staticmethod
    def channels(config: dict) -> int:
        """The latent channels the DiT sees, from the folder's config.json alone (no weights loaded)."""
        raise NotImplementedError

    @staticmethod
    def downsample_of(config: dict) -> int:
        """Pixels per latent side, from config.json alone (what `downsample` will be once loaded)."""
        raise NotImplementedError

    def _setup(self, cfg) -> None:
        """Set latent_channels, downsample and the normalisation statistics (float32, on the CPU)."""
        raise NotImplementedError

    def _encode(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def _decode(self, z: Tensor) -> Tensor:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return next(self.vae.parameters()).device

    def to(self, device: torch.device | str) -> "DiffusersVAE":
        self.vae.to(device)
        return self

    @torch.no_grad()
    def encode(self, images: np.ndarray | Tensor) -> Tensor:
        return self._encode(from_uint8_nhwc(images, self.device).to(self.vae.dtype))

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        return to_uint8_nhwc(self._decode(latents.float().to(self.device)))

    def identity(self) -> str:
        """The class, the config (less diffusers' own `_` keys: the folder's path, the library's version) and
        every weight and buffer: two VAEs differ here exactly when their latents can. Hashed once."""
        if self._identity is None:
            import json

            h = hashlib.sha256(f"{VAE_ID_VERSION}|{self.family}".encode())
            cfg = {k: v for k, v in dict(self.vae.config).items() if not k.startswith("_")}
            h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
            for name, t in sorted(self.vae.state_dict().items()):
                t = t.detach().cpu().contiguous()
                h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            self._identity = f"{self.family}-{h.hexdigest()[:16]}"
        return self._identity


class KLAutoencoder(DiffusersVAE):
    """diffusers AutoencoderKL (SD, SDXL, SD3, FLUX.1): per-channel latents_mean/std when the config has them,
    else (z - shift_factor) * scaling_factor as the FLUX.1 pipeline does. SDXL's pipeline also multiplies its
    per-channel form by scaling_factor; kiln does not, for unit variance."""

    cls_name, family = "AutoencoderKL", "kl"

    @staticmethod
    def channels(config: dict) -> int:
        return int(config.get("latent_channels", 4))

    @staticmethod
    def downsample_of(config: dict) -> int:
        return 2 ** (len(config.get("block_out_channels", [64])) - 1)

    def _setup(self, cfg) -> None:
        self.latent_channels = c = self.channels(dict(cfg))
        self.downsample = self.downsample_of(dict(cfg))
        mean, std = getattr(cfg, "latents_mean", None), getattr(cfg, "latents_std", None)
        if mean is not None and std is not None:
            self.shift = torch.tensor(mean, dtype=torch.float32).view(1, c, 1, 1)
            self.scale = 1.0 / torch.tensor(std, dtype=torch.float32).view(1, c, 1, 1)
        else:
            self.shift = torch.full((1, c, 1, 1), float(getattr(cfg, "shift_factor", None) or 0.0))
            self.scale = torch.full((1, c, 1, 1), float(getattr(cfg, "scaling_factor", 1.0)))

    def _encode(self, x: Tensor) -> Tensor:
        z = self.vae.encode(x).latent_dist.mode().float()
        return (z - self.shift.to(z.device)) * self.scale.to(z.device)

    def _decode(self, z: Tensor) -> Tensor:
        z = z / self.scale.to(z.device) + self.shift.to(z.device)
        return self.vae.decode(z.to(self.vae.dtype)).sample


class Flux2Autoencoder(DiffusersVAE):
    """diffusers AutoencoderKLFlux2 (FLUX.2): the posterior mode patchified 2x2, then normalised by the VAE's
    batch-norm running statistics, as FLUX.2's pipeline does; the DiT sees 4x the VAE's channels at 2x its
    downsample (128 channels at 16x for the released VAE), already patchified, so model.patch_size=1 there."""

    cls_name, family = "AutoencoderKLFlux2", "flux2"

    @staticmethod
    def channels(config: dict) -> int:
        return 4 * int(config.get("latent_channels", 32))

    @staticmethod
    def downsample_of(config: dict) -> int:
        return 2 * 2 ** (len(config.get("block_out_channels", [128])) - 1)  # the 2x2 patchify doubles it

    def _setup(self, cfg) -> None:
        if tuple(cfg.patch_size) != (2, 2):
            raise ValueError(f"{self.path}: AutoencoderKLFlux2 with patch_size {cfg.patch_size}: kiln handles (2, 2)")
        self.latent_channels = self.channels(dict(cfg))
        self.downsample = self.downsample_of(dict(cfg))
        bn = self.vae.bn
        self.mean = bn.running_mean.detach().float().cpu().view(1, -1, 1, 1)
        self.std = torch.sqrt(bn.running_var.detach().float().cpu() + float(cfg.batch_norm_eps)).view(1, -1, 1, 1)

    def _encode(self, x: Tensor) -> Tensor:
        z = patchify2x2(self.vae.encode(x).latent_dist.mode().float())
        return (z - self.mean.to(z.device)) / self.std.to(z.device)

    def _decode(self, z: Tensor) -> Tensor:
        z = unpatchify2x2(z * self.std.to(z.device) + self.mean.to(z.device))
        return self.vae.decode(z.to(self.vae.dtype)).sample


class QwenImageAutoencoder(DiffusersVAE):
    """diffusers AutoencoderKLQwenImage (Qwen-Image): a causal video VAE run on one frame, normalised by the
    config's per-channel latents_mean/std as Qwen-Image's pipeline does; the frame axis never leaves here."""

    cls_name, family = "AutoencoderKLQwenImage", "qwenimage"

    @staticmethod
    def channels(config: dict) -> int:
        return int(config.get("z_dim", 16))

    @staticmethod
    def downsample_of(config: dict) -> int:
        return 2 ** len(config.get("temperal_downsample", [False, True, True]))  # diffusers' spatial_compression_ratio

    def _setup(self, cfg) -> None:
        self.latent_channels = c = self.channels(dict(cfg))
        self.downsample = int(self.vae.spatial_compression_ratio)
        if self.downsample != 2 ** (len(cfg.dim_mult) - 1):
            raise ValueError(
                f"{self.path}: temperal_downsample {cfg.temperal_downsample} and dim_mult {cfg.dim_mult} disagree on the downsample"
            )
        self.mean = torch.tensor(cfg.latents_mean, dtype=torch.float32).view(1, c, 1, 1)
        self.std = torch.tensor(cfg.latents_std, dtype=torch.float32).view(1, c, 1, 1)

    def _encode(self, x: Tensor) -> Tensor:
        z = self.vae.encode(x.unsqueeze(2)).latent_dist.mode().float()[:, :, 0]
        return (z - self.mean.to(z.device)) / self.std.to(z.device)

    def _decode(self, z: Tensor) -> Tensor:
        z = z * self.std.to(z.device) + self.mean.to(z.device)
        return self.vae.decode(z.unsqueeze(2).to(self.vae.dtype)).sample[:, :, 0]


VAE_CLASSES: dict[str, type[DiffusersVAE]] = {
    c.cls_name: c for c in (KLAutoencoder, Flux2Autoencoder, QwenImageAutoencoder)
}


def _vae_config(path: str | Path) -> dict:
    import json

    config = Path(path) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{path}: no config.json (not a diffusers model folder)")
    return json.loads(config.read_text())


def vae_class(path: str | Path) -> type[DiffusersVAE]:
    """The adapter for a diffusers folder's own class, read from its config.json: diffusers would load a FLUX.2
    VAE through AutoencoderKL with warnings only, and train on the wrong latents; any class kiln does not
    handle is refused by name."""
    name = _vae_config(path).get("_class_name")
    if name not in VAE_CLASSES:
        raise ValueError(
            f"{path}: config.json _class_name is {name!r}; kiln's autoencoders are {', '.join(sorted(VAE_CLASSES))} "
            "(refused rather than loaded as another class)"
        )
    return VAE_CLASSES[name]


def load_vae(path: str | Path, device: torch.device | str = "cpu") -> DiffusersVAE:
    return vae_class(path)(path, device)


def latent_channels_of(kind: str, path: str | None) -> int:
    """What the DiT's input channels must be for this autoencoder, without loading it."""
    if kind == "pixel":
        return PixelAutoencoder.latent_channels
    if path is None:
        raise ValueError("model.autoencoder=kl needs model.autoencoder_path (a diffusers VAE folder)")
    return vae_class(path).channels(_vae_config(path))


def token_side(kind: str, path: str | None, patch_size: int) -> int:
    """Pixels per side of one DiT token: the autoencoder's downsample x the DiT's patch size (FLUX.2's VAE at
    patch 1: 16; FLUX.1's at patch 2: 16; pixel space at patch 4: 4), from config.json alone. Every bucket
    side must be a multiple of it."""
    if kind == "pixel":
        return patch_size
    if path is None:
        raise ValueError("model.autoencoder=kl needs model.autoencoder_path (a diffusers VAE folder)")
    return vae_class(path).downsample_of(_vae_config(path)) * patch_size


def build_autoencoder(kind: str, path: str | None, device: torch.device | str = "cpu") -> Autoencoder:
    if kind == "pixel":
        return PixelAutoencoder(device)
    if kind == "kl":
        if path is None:
            raise ValueError("model.autoencoder=kl needs model.autoencoder_path (a diffusers VAE folder)")
        return load_vae(path, device)
    raise ValueError(f"unknown autoencoder {kind!r}")


class LatentCache:
    """Latents on disk, one safetensors file per image, keyed by sha256(autoencoder identity, image bytes)."""

    def __init__(self, root: str | Path, autoencoder: Autoencoder):
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
