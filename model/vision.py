"""Vision towers by path, fed the inputs their own image processors define, computed on tensors.

A REPA teacher sees decoded training images (float tensors), an embedder sees uint8 pictures: both go through
`VisionInputs.prepare`, which does what the folder's `preprocessor_config.json` says (resize to a square, or
the shortest edge then a centre crop, or SigLIP-2's NaFlex: the aspect kept, at most `max_num_patches`
patches, padded, with its mask and shapes) and normalises by the processor's mean and std. transformers'
own processors would need torchvision for DINOv3, which has no CPU build beside kiln's torch; this needs
none. A folder whose `model_type` is not a vision tower kiln knows is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

# model_type -> (the attribute holding the vision tower in a dual model, or None; tokens before the patches)
VISION_TOWERS: dict[str, tuple[str | None, int]] = {
    "dinov2": (None, 1),  # CLS
    "dinov3_vit": (None, 1),  # CLS, then config.num_register_tokens registers
    "vit": (None, 1),
    "siglip": ("vision_model", 0),  # patches only
    "siglip_vision_model": (None, 0),
    "siglip2": ("vision_model", 0),  # NaFlex: padding after the patches
    "siglip2_vision_model": (None, 0),
    "clip": ("vision_model", 1),
    "clip_vision_model": (None, 1),
}
RESAMPLE = {2: "bilinear", 3: "bicubic"}  # PIL's codes in preprocessor_config.json


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


@dataclass(frozen=True)
class VisionInputs:
    """What a folder's image processor does, as tensors: `prepare(x)` for x [B, 3, H, W] in [0, 1]."""

    mode: Literal["square", "crop", "naflex"]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    resample: str
    height: int  # square: the output; crop: the crop; naflex: unused
    width: int
    shortest_edge: int  # crop mode: the resize before the crop
    patch_size: int
    max_num_patches: int  # naflex only
    prefix_tokens: int  # CLS and register tokens before the patches in last_hidden_state

    @classmethod
    def from_folder(cls, path: str | Path) -> VisionInputs:
        path = Path(path)
        proc_file = path / "preprocessor_config.json"
        if not proc_file.is_file():
            raise FileNotFoundError(
                f"{path}: no preprocessor_config.json: the vision model's inputs (size, mean, std) are its processor's; save it beside the model"
            )
        proc, config = _json(proc_file), _json(path / "config.json")
        model_type = config.get("model_type")
        if model_type not in VISION_TOWERS:
            raise ValueError(
                f"{path}: config.json model_type {model_type!r} is not a vision tower kiln loads ({', '.join(sorted(VISION_TOWERS))})"
            )
        vision = config.get("vision_config", config)
        prefix = VISION_TOWERS[model_type][1] + int(vision.get("num_register_tokens", 0) or 0)
        size = proc.get("size") or {}
        crop = proc.get("crop_size") or {}
        common = {
            "mean": tuple(proc.get("image_mean") or (0.5, 0.5, 0.5)),
            "std": tuple(proc.get("image_std") or (0.5, 0.5, 0.5)),
            "resample": RESAMPLE.get(proc.get("resample"), "bilinear"),
            "patch_size": int(proc.get("patch_size") or vision.get("patch_size")),
            "prefix_tokens": prefix,
        }
        if "max_num_patches" in proc:
            return cls(
                "naflex", height=0, width=0, shortest_edge=0, max_num_patches=int(proc["max_num_patches"]), **common
            )
        if "shortest_edge" in size:
            edge = int(size["shortest_edge"])
            if proc.get("do_center_crop", True) and crop:
                h, w = int(crop["height"]), int(crop["width"])
            else:
                raise ValueError(f"{path}: a shortest-edge resize without a centre crop gives no fixed grid")
            return cls("crop", height=h, width=w, shortest_edge=edge, max_num_patches=0, **common)
        h, w = int(size.get("height", vision.get("image_size"))), int(size.get("width", vision.get("image_size")))
        return cls("square", height=h, width=w, shortest_edge=0, max_num_patches=0, **common)

    def _resize(self, x: Tensor, size: tuple[int, int]) -> Tensor:
        if tuple(x.shape[-2:]) == size:
            return x
        out = F.interpolate(x, size=size, mode=self.resample, align_corners=False, antialias=True)
        return out.clamp(0, 1)  # the processors resize 8-bit images: no bicubic overshoot survives

    def _normalise(self, x: Tensor) -> Tensor:
        mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
        return (x - mean) / std

    def prepare(self, x: Tensor) -> dict[str, Tensor]:
        """x [B, 3, H, W] float in [0, 1] -> the model's keyword inputs (pixel_values, and for NaFlex
        pixel_attention_mask and spatial_shapes)."""
        x = x.float()
        h, w = x.shape[-2:]
        if self.mode == "square":
            return {"pixel_values": self._normalise(self._resize(x, (self.height, self.width)))}
        if self.mode == "crop":
            short, long = (h, w) if h <= w else (w, h)
            scaled = (self.shortest_edge, int(self.shortest_edge * long / short))
            x = self._resize(x, scaled if h <= w else scaled[::-1])
            top, left = (x.shape[-2] - self.height) // 2, (x.shape[-1] - self.width) // 2
            return {"pixel_values": self._normalise(x[..., top : top + self.height, left : left + self.width])}
        from transformers.models.siglip2.image_processing_pil_siglip2 import get_image_size_for_max_num_patches

        th, tw = get_image_size_for_max_num_patches(int(h), int(w), self.patch_size, self.max_num_patches)
        x = self._normalise(self._resize(x, (th, tw)))
        p, (gh, gw), b = self.patch_size, (th // self.patch_size, tw // self.patch_size), x.shape[0]
        patches = x.reshape(b, 3, gh, p, gw, p).permute(0, 2, 4, 3, 5, 1).reshape(b, gh * gw, p * p * 3)
        values = patches.new_zeros(b, self.max_num_patches, p * p * 3)
        values[:, : gh * gw] = patches
        mask = torch.zeros(b, self.max_num_patches, dtype=torch.int32, device=x.device)
        mask[:, : gh * gw] = 1
        shapes = torch.tensor([[gh, gw]] * b, dtype=torch.int64, device=x.device)
        return {"pixel_values": values, "pixel_attention_mask": mask, "spatial_shapes": shapes}

    def grid(self, inputs: dict[str, Tensor]) -> tuple[int, int]:
        """The patch grid of `prepare`'s output (every image of a batch shares it: one bucket)."""
        if self.mode == "naflex":
            gh, gw = inputs["spatial_shapes"][0].tolist()
            return int(gh), int(gw)
        return self.height // self.patch_size, self.width // self.patch_size

    def patch_tokens(self, hidden: Tensor, inputs: dict[str, Tensor]) -> Tensor:
        """last_hidden_state [B, N, D] -> the patch features on their grid, [B, D, gh, gw]."""
        gh, gw = self.grid(inputs)
        tokens = hidden[:, self.prefix_tokens : self.prefix_tokens + gh * gw]
        return tokens.transpose(1, 2).reshape(hidden.shape[0], hidden.shape[-1], gh, gw)


def load_vision_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """(the whole model, its vision tower, its inputs): the model by its own class (AutoModel), refused when a
    weight of it is missing from the folder (transformers would leave it random); the tower is the model, or
    its `vision_model` in a dual encoder (CLIP, SigLIP)."""
    from transformers import AutoModel

    inputs = VisionInputs.from_folder(path)
    model, info = AutoModel.from_pretrained(str(path), dtype=dtype, output_loading_info=True)
    if info["missing_keys"]:
        raise ValueError(
            f"{path}: {len(info['missing_keys'])} weights of {type(model).__name__} are not in the folder "
            f"(e.g. {sorted(info['missing_keys'])[:3]}): it would run with them random"
        )
    model = model.eval().requires_grad_(False)
    attr = VISION_TOWERS[model.config.model_type][0]
    return model, (getattr(model, attr) if attr else model), inputs
