"""Text embeddings computed once per training set, not once per step.

The text backbone is frozen, so a caption's hidden states never change during training: encoding every
unique caption up front takes the MiniLM forward pass out of the step. (Across runs, the backbone's own
disk cache, `model.text_encoder.cache_dir`, keeps them; this is the in-memory index over one set.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kiln.progress import progress


class TextCache:
    """All unique captions' TextBatch rows; `batch(captions)` gathers the rows of one step."""

    def __init__(self, text, captions: Sequence[str]):
        self.text = text  # model.text_encoder.TextBatch on CPU, one row per caption
        self.index = {c: i for i, c in enumerate(captions)}
        if len(self.index) != len(text):
            raise ValueError(f"{len(text)} embeddings for {len(self.index)} unique captions")

    @classmethod
    def build(cls, gen, captions: Sequence[str], chunk: int = 64) -> "TextCache":
        from model.text_encoder import TextBatch

        captions = sorted(set(captions))
        parts = []
        with torch.no_grad():
            for i in progress(range(0, len(captions), chunk), desc="text embeddings", unit="chunk"):
                parts.append(gen.encode_text(captions[i : i + chunk]).to("cpu"))
        return cls(TextBatch.cat(parts), captions)

    def __len__(self) -> int:
        return len(self.index)

    def batch(self, captions: Sequence[str], device: torch.device | str = "cpu"):
        idx = torch.tensor([self.index[c] for c in captions], dtype=torch.long)
        return self.text[idx].to(device)
