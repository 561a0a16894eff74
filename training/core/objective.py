"""The training objective: rectified flow with v-prediction, and how its timesteps are drawn.

x_t = (1 - t) x0 + t eps and the network predicts v = eps - x0 (model/flow.py owns the convention).
Timesteps are logit-normal, then shifted towards noise by an amount that grows with the token count,
because at more pixels the same t leaves more of the image recognisable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from model.flow import interpolate, resolution_shift, sample_logit_normal, shift_timesteps, velocity_target


def num_image_tokens(height: int, width: int, patch_size: int) -> int:
    return (height // patch_size) * (width // patch_size)


def timestep_shift(num_tokens: int, base_shift: float, max_shift: float) -> float:
    """The shift at this resolution: `base_shift` at model.flow's base token count (32x32 px at patch 2),
    `max_shift` at 4096 tokens, linear between; floored at a quarter of the base for tiny crops."""
    return max(resolution_shift(num_tokens, base_shift=base_shift, max_shift=max_shift), base_shift / 4)


def sample_timesteps(
    batch: int, generator: torch.Generator, mean: float, std: float, shift: float, device: torch.device | str
) -> Tensor:
    return shift_timesteps(sample_logit_normal(batch, generator, mean, std, device), shift)


def drop_captions(
    text, null_text, p: float, generator: torch.Generator, n: int | None = None, rows: slice = slice(None)
):
    """Replace each row's caption by the null caption with probability p: the unconditional branch CFG needs.
    The draw covers `n` rows (default: all of `text`); `text` holds its `rows`."""
    if p <= 0:
        return text
    keep = (torch.rand(n or len(text), generator=generator, device=generator.device) >= p)[rows]
    return text.where(keep, null_text)


def flow_loss(gen, x0: Tensor, eps: Tensor, t: Tensor, text, route=None) -> Tensor:
    """Per-sample MSE between predicted and target velocity, [B] in fp32. `route`: the step's token routing
    (model/routing.py, training only), None = every token through every block."""
    pred = (
        gen(interpolate(x0, eps, t), t, text) if route is None else gen(interpolate(x0, eps, t), t, text, route=route)
    )
    err = F.mse_loss(pred.float(), velocity_target(x0, eps).float(), reduction="none")
    return err.flatten(1).mean(1)
