"""Image encoders by path, for every slot that needs image features: the embed stage's embeddings, REPA's
frozen teacher, the reward model's and the style reference's frozen descriptor.

One small interface (`Embedder`): a name written next to every vector, and `embed(images) -> (n, d)
float32`, L2-normalised. Two exist:

- `ClassicalEmbedder`, the offline demo stand-in: a hand-made colour / texture / shape descriptor (no
  weights, no download), named `classical:...` in the data so nobody mistakes it for a learned model. Its
  blocks weigh layout and structure (how many blobs, stripes, a text sign) over colour, which is what the
  demo's scene families differ in.
- `HFEmbedder`: any Hugging Face vision model given by local path (SigLIP / SigLIP-2, CLIP, DINOv2 /
  DINOv3 classes) through `AutoModel` and its processor's inputs (model.vision), batched, on CPU or CUDA.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Protocol, runtime_checkable

import numpy as np
from PIL import Image

from kiln.config import EmbedConfig


@runtime_checkable
class Embedder(Protocol):
    name: str  # written to the `embedder` column

    def embed(self, images: list[Image.Image]) -> np.ndarray:
        """(n, d) float32, one row per image, L2-normalised."""
        ...


def l2_normalise(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


# ------------------------------------------------------------------------------------ classical
CLASSICAL_VERSION = "v1"


# block weights: structure first, colour last (the demo's families share their colours); chosen on the
# demo corpus by k-means purity against its scene families (docs/curation-models.md)
BLOCK_WEIGHTS = {
    "colour": 0.2,
    "orientation": 1.0,
    "edges": 0.3,
    "foreground": 0.7,
    "spectrum": 1.5,
    "blobs": 2.0,
    "shape": 2.5,
    "levels": 1.0,
}


def _rgb_to_hsv(a: np.ndarray) -> np.ndarray:
    mx, mn = a.max(-1), a.min(-1)
    d = mx - mn
    s = np.where(mx > 0, d / np.maximum(mx, 1e-6), 0)
    r, g, b = a[..., 0], a[..., 1], a[..., 2]
    h = np.where(
        mx == r,
        (g - b) / np.maximum(d, 1e-6) % 6,
        np.where(mx == g, (b - r) / np.maximum(d, 1e-6) + 2, (r - g) / np.maximum(d, 1e-6) + 4),
    )
    return np.stack([h / 6.0, s, mx], -1)


def _cells(x: np.ndarray, n: int) -> np.ndarray:
    """Mean of x over an n x n grid of cells: (H, W) -> (n * n,)."""
    h, w = x.shape
    return x[: h - h % n, : w - w % n].reshape(n, h // n, n, w // n).mean((1, 3)).ravel()


def _blob_blocks(a: np.ndarray, fg: np.ndarray, mag: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """How many sizeable foreground blobs (one-hot 0..4+), and what the largest two look like:
    their areas, whether they share a colour and a size (repeated objects vs two different ones),
    how rectangular the largest is and how much detail is inside it (a sign with text)."""
    from scipy import ndimage

    labels, n = ndimage.label(fg)
    sizes = np.bincount(labels.ravel(), minlength=n + 1)[1:]
    big = [int(i) + 1 for i in np.argsort(-sizes, kind="stable") if sizes[i] >= 0.004 * fg.size]
    count = np.eye(5, dtype=np.float32)[min(len(big), 4)]
    shape = np.zeros(6, np.float32)
    if big:
        first = labels == big[0]
        ys, xs = np.nonzero(first)
        box = (np.ptp(ys) + 1) * (np.ptp(xs) + 1)
        inner = ndimage.binary_erosion(first, iterations=2)
        shape[0] = np.sqrt(first.mean())
        shape[1] = first.sum() / box  # rectangle 1, circle 0.79, triangle / diamond 0.5
        shape[2] = min(float(mag[inner].mean()) if inner.any() else 0.0, 1.0)  # text inside a sign
    if len(big) >= 2:
        second = labels == big[1]
        shape[3] = np.sqrt(second.mean())
        shape[4] = second.sum() / first.sum()
        shape[5] = np.exp(-np.linalg.norm(a[first].mean(0) - a[second].mean(0)) / 0.15)  # same colour: 1
    return count, shape


def classical_descriptor(im: Image.Image, size: int = 64) -> np.ndarray:
    """Colour histogram, gradient orientations, edge layout, foreground layout, blob count, FFT bands."""
    from scipy import (
        ndimage,  # imported here: `kiln --help` imports this module's CLI neighbours
    )

    a = np.asarray(im.convert("RGB").resize((size, size), Image.Resampling.BILINEAR), np.float32) / 255.0
    grey = a @ np.array([0.299, 0.587, 0.114], np.float32)
    blocks: dict[str, np.ndarray] = {}

    hsv = _rgb_to_hsv(a)
    hue = np.minimum((hsv[..., 0] * 8).astype(int), 7)
    chroma = np.where(hsv[..., 1] > 0.25, hue, 8 + np.minimum((hsv[..., 2] * 3).astype(int), 2))  # 8 hues + 3 greys
    blocks["colour"] = np.sqrt(np.bincount(chroma.ravel(), minlength=11) / chroma.size)

    gx, gy = ndimage.sobel(grey, 1), ndimage.sobel(grey, 0)
    mag = np.hypot(gx, gy)
    ang = np.minimum(((np.arctan2(gy, gx) % np.pi) / np.pi * 8).astype(int), 7)  # unsigned: 8 bins
    blocks["orientation"] = np.sqrt(np.bincount(ang.ravel(), weights=mag.ravel(), minlength=8) / (mag.sum() + 1e-6))
    blocks["edges"] = np.sqrt(_cells(mag, 4) / (mag.mean() + 1e-6))

    # foreground: pixels far from the background colour (the median of the border ring)
    ring = np.concatenate([a[0], a[-1], a[:, 0], a[:, -1]])
    fg = np.linalg.norm(a - np.median(ring, 0), axis=-1) > 0.25
    blocks["foreground"] = np.concatenate([_cells(fg.astype(np.float32), 4), [fg.mean()]])
    blocks["blobs"], blocks["shape"] = _blob_blocks(a, fg, mag)

    spec = np.abs(np.fft.fftshift(np.fft.fft2(grey - grey.mean())))
    yy, xx = np.mgrid[:size, :size] - size // 2
    radius = np.minimum((np.hypot(yy, xx) / (size / 2) * 8).astype(int), 7)
    bands = np.bincount(radius.ravel(), weights=spec.ravel(), minlength=8)
    blocks["spectrum"] = np.sqrt(bands / (bands.sum() + 1e-6))

    # absolute levels (not normalised away): contrast, sharpness, saturation, brightness
    sharp = np.abs(ndimage.laplace(grey)).mean()
    levels = np.array([grey.std() * 4, sharp * 8, hsv[..., 1].mean(), hsv[..., 2].mean()], np.float32)
    parts = [BLOCK_WEIGHTS[k] * l2_normalise(v) for k, v in blocks.items()] + [
        BLOCK_WEIGHTS["levels"] * np.minimum(levels, 1.5)
    ]
    return l2_normalise(np.concatenate(parts))


class ClassicalEmbedder:
    """The offline default: a deterministic hand-made descriptor, honestly named as one."""

    def __init__(self, size: int = 64):
        self.size = size
        self.name = (
            f"classical:colour-texture-shape-{CLASSICAL_VERSION}@{size}px (hand-made descriptor, not a learned model)"
        )

    def embed(self, images: list[Image.Image]) -> np.ndarray:
        if not images:
            return np.zeros((0, 0), np.float32)
        return np.stack([classical_descriptor(im, self.size) for im in images])


# ------------------------------------------------------------------------------------------- HF
class HFEmbedder:
    """A transformers vision model from a local folder (model.vision: DINOv2/v3, SigLIP, SigLIP-2 NaFlex, CLIP,
    ViT), fed its processor's inputs: image features for dual encoders (CLIP, SigLIP), the pooled output (or
    the token mean) for vision-only encoders such as DINOv2."""

    def __init__(self, path: str, device: str = "cpu", batch_size: int = 32):
        import torch

        from model.vision import load_vision_model

        self.torch = torch
        self.model, _, self.inputs = load_vision_model(path)
        self.model = self.model.to(device)
        self.device, self.batch_size = device, batch_size
        self.name = f"hf:{self.model.config.model_type}:{path.rstrip('/').split('/')[-1]}"

    def _features(self, inputs: dict):
        if hasattr(self.model, "get_image_features"):  # dual encoders (CLIPModel, SiglipModel, Siglip2Model)
            out = self.model.get_image_features(**inputs)
        else:
            out = self.model(**inputs)
        if isinstance(out, self.torch.Tensor):
            return out
        pooled = getattr(out, "pooler_output", None)
        return pooled if pooled is not None else out.last_hidden_state.mean(1)

    def _prepared(self, images: list[Image.Image]) -> dict:
        """Each picture through the processor's steps at its own size, then one batch."""
        torch = self.torch
        each = [
            self.inputs.prepare(torch.from_numpy(np.asarray(im.convert("RGB"))).permute(2, 0, 1)[None] / 255.0)
            for im in images
        ]
        return {k: torch.cat([e[k] for e in each]).to(self.device) for k in each[0]}

    def embed(self, images: list[Image.Image]) -> np.ndarray:
        chunks = []
        with self.torch.inference_mode():
            for i in range(0, len(images), self.batch_size):
                batch = self._prepared(images[i : i + self.batch_size])
                chunks.append(self._features(batch).float().cpu().numpy())
        return l2_normalise(np.concatenate(chunks)) if chunks else np.zeros((0, 0), np.float32)


@lru_cache(maxsize=2)
def make_embedder(cfg: EmbedConfig) -> Embedder:
    """One embedder per process and config (a model loads once, not once per shard)."""
    if cfg.embedder == "classical":
        return ClassicalEmbedder(cfg.size)
    if not cfg.path:
        raise ValueError("data.embed.embedder=hf needs data.embed.path (a local model folder)")
    return HFEmbedder(cfg.path, cfg.device, cfg.batch_size)
