"""TREAD-style token routing: during training a random share of the image tokens skips a span of middle blocks.

The routed tokens leave the sequence before block `start` and rejoin, unchanged, after block `end - 1`:
the blocks in between run on fewer tokens (cheaper steps), and the skipped tokens still reach the later
blocks and the loss. One draw per step, shared by the batch, from the step's generator, so a seed and a
step give the same route on every rank and on resume. Inference never routes (the DiT sees every token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def routed_count(n_image_tokens: int, frac: float) -> int:
    """How many image tokens skip the span: floor(frac * n)."""
    return int(frac * n_image_tokens)


@dataclass(frozen=True)
class TokenRoute:
    routed: Tensor  # sorted indices (0 .. n_image_tokens - 1) of the image tokens that skip blocks [start, end)
    start: int
    end: int

    @classmethod
    def draw(cls, n_image_tokens: int, frac: float, start: int, end: int, generator: torch.Generator) -> TokenRoute:
        perm = torch.randperm(n_image_tokens, generator=generator, device=generator.device)
        return cls(perm[: routed_count(n_image_tokens, frac)].sort().values.cpu(), start, end)

    def kept_positions(self, seq_len: int, image_start: int, device: torch.device) -> Tensor:
        """Sequence positions that go through the span: every text, timestep and pad token, and the image
        tokens not routed."""
        keep = torch.ones(seq_len, dtype=torch.bool)
        keep[image_start + self.routed] = False
        return keep.nonzero().squeeze(1).to(device)
