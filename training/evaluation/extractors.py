"""Image feature extractors for the distribution metrics: HF models loaded from a local folder.

  clip      CLIPVisionModelWithProjection -> `image_embeds` (the projected CLIP image embedding), for CMMD
  dino      Dinov2Model -> `pooler_output` (the layer-normed CLS token), for DINO-MMD
  backbone  any AutoModel image backbone with a pooled output (ResNet, ConvNeXt, ViT, ...), for FID

Why "backbone" and not InceptionV3: transformers has no Inception-v3, and pytorch-fid's / timm's
Inception weights need torchvision, which this environment does not install (a bare torch wheel
pulls CUDA). FID is therefore the Fréchet distance of an Inception-*class* ImageNet backbone's pooled
features, and every result names the model type next to the number: our FID is comparable across our
checkpoints, not with published Inception-v3 FIDs.

Each folder holds the model (save_pretrained) and its image processor (preprocessor_config.json);
preprocessing is that processor's own (resize, centre crop, rescale, normalise), so features match
what the model was trained on. Inference runs in eval mode, float32, batch by batch: deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

Kind = Literal["clip", "dino", "backbone"]


@dataclass
class FeatureExtractor:
    kind: Kind
    path: str
    model: torch.nn.Module
    processor: object
    device: str = "cpu"

    @property
    def model_type(self) -> str:
        return str(self.model.config.model_type)

    def _features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.model(pixel_values=pixel_values)
        if self.kind == "clip":
            return out.image_embeds
        pooled = out.pooler_output
        return pooled.flatten(1)  # ResNet-style pools are [N, C, 1, 1]

    @torch.no_grad()
    def __call__(self, images: np.ndarray, batch_size: int = 32) -> np.ndarray:
        """float32 [N, D] features of uint8 [N, H, W, 3] images."""
        images = np.asarray(images)
        if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
            raise ValueError(f"need uint8 [N, H, W, 3] images, got {images.dtype} {images.shape}")
        chunks = []
        for start in range(0, images.shape[0], batch_size):
            batch = list(images[start : start + batch_size])
            pixels = self.processor(images=batch, return_tensors="pt")["pixel_values"].to(self.device, torch.float32)
            chunks.append(self._features(pixels).float().cpu().numpy())
        return np.concatenate(chunks) if chunks else np.zeros((0, 0), np.float32)


def load_extractor(kind: Kind, path: str | Path, device: str = "cpu") -> FeatureExtractor:
    """The extractor of one kind from a local HF folder (model + preprocessor_config.json)."""
    from transformers import (
        AutoImageProcessor,
        AutoModel,
        CLIPVisionModelWithProjection,
        Dinov2Model,
    )

    path = Path(path)
    if not (path / "preprocessor_config.json").exists():
        raise FileNotFoundError(f"{path}: no preprocessor_config.json; save the model's image processor next to it")
    classes = {"clip": CLIPVisionModelWithProjection, "dino": Dinov2Model, "backbone": AutoModel}
    if kind not in classes:
        raise ValueError(f"unknown extractor kind {kind!r}; kinds: {sorted(classes)}")
    model = classes[kind].from_pretrained(str(path), dtype=torch.float32).eval().to(device)
    processor = AutoImageProcessor.from_pretrained(str(path))
    return FeatureExtractor(kind, str(path), model, processor, device)


def write_tiny_extractor(kind: Kind, directory: str | Path, image_size: int = 32, seed: int = 0) -> Path:
    """A randomly initialised extractor of `kind` (hidden 32, 2 layers) with its image processor, saved
    with save_pretrained: what tests and CPU demos load through `load_extractor`."""
    from transformers import (
        BitImageProcessor,
        CLIPImageProcessor,
        CLIPVisionConfig,
        CLIPVisionModelWithProjection,
        ConvNextImageProcessor,
        Dinov2Config,
        Dinov2Model,
        ResNetConfig,
        ResNetModel,
    )

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    square = {"height": image_size, "width": image_size}
    torch.manual_seed(seed)
    if kind == "clip":
        cfg = CLIPVisionConfig(
            image_size=image_size,
            patch_size=8,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            projection_dim=16,
        )
        model, proc = (
            CLIPVisionModelWithProjection(cfg),
            CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size=square),
        )
    elif kind == "dino":
        cfg = Dinov2Config(
            image_size=image_size,
            patch_size=8,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
        )
        model, proc = (
            Dinov2Model(cfg),
            BitImageProcessor(
                size={"shortest_edge": image_size},
                crop_size=square,
                image_mean=[0.485, 0.456, 0.406],
                image_std=[0.229, 0.224, 0.225],
            ),
        )
    elif kind == "backbone":
        cfg = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic")
        model, proc = ResNetModel(cfg), ConvNextImageProcessor(size={"shortest_edge": image_size}, crop_pct=1.0)
    else:
        raise ValueError(f"unknown extractor kind {kind!r}")
    model.eval().save_pretrained(str(d))
    proc.save_pretrained(str(d))
    return d
