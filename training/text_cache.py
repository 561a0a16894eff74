"""Text embeddings computed once per training set, not once per step.

The text encoder is frozen, so a caption's embedding never changes during training: encoding every
unique caption up front (optionally saved to a safetensors file keyed by the captions and the encoder
settings) takes the MiniLM forward pass out of the step.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kiln.progress import progress


def pad_text(hidden: torch.Tensor, mask: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad [B, n_layers, L, D] / [B, L] to `length` tokens with zeros / False."""
    extra = length - hidden.shape[2]
    if extra <= 0:
        return hidden, mask
    hidden = torch.nn.functional.pad(hidden, (0, 0, 0, extra))
    mask = torch.nn.functional.pad(mask, (0, extra), value=False)
    return hidden, mask


def cache_key(captions: Sequence[str], encoder_settings: dict) -> str:
    h = hashlib.sha256(json.dumps(encoder_settings, sort_keys=True).encode())
    for c in captions:
        h.update(c.encode() + b"\0")
    return h.hexdigest()[:24]


class TextCache:
    """caption -> (hidden [n_layers, L, D], mask [L]); `batch(captions)` gathers a TextBatch."""

    def __init__(self, hidden: torch.Tensor, mask: torch.Tensor, captions: Sequence[str]):
        self.hidden, self.mask = hidden, mask  # [N, n_layers, L, D], [N, L]
        self.index = {c: i for i, c in enumerate(captions)}

    @classmethod
    def build(cls, gen, captions: Sequence[str], chunk: int = 64, cache_dir: Path | None = None, settings: dict | None = None) -> "TextCache":
        captions = list(captions)
        path = Path(cache_dir) / f"text-{cache_key(captions, settings or {})}.safetensors" if cache_dir else None
        if path is not None and path.exists():
            t = load_file(str(path))
            return cls(t["hidden"], t["mask"].bool(), captions)
        hs, ms = [], []
        with torch.no_grad():
            for i in progress(range(0, len(captions), chunk), desc="text embeddings", unit="chunk"):
                tb = gen.encode_text(captions[i : i + chunk])
                hs.append(tb.hidden.detach().float().cpu())
                ms.append(tb.mask.detach().bool().cpu())
        length = max(h.shape[2] for h in hs)
        padded = [pad_text(h, m, length) for h, m in zip(hs, ms)]
        hidden = torch.cat([p[0] for p in padded])
        mask = torch.cat([p[1] for p in padded])
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file({"hidden": hidden.contiguous(), "mask": mask.to(torch.uint8)}, str(path))
        return cls(hidden, mask, captions)

    def __len__(self) -> int:
        return len(self.index)

    def batch(self, captions: Sequence[str], device: torch.device | str = "cpu"):
        from model.generator import TextBatch

        idx = torch.tensor([self.index[c] for c in captions])
        return TextBatch(hidden=self.hidden[idx].to(device), mask=self.mask[idx].to(device))
