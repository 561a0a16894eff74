"""The one rectified-flow convention every part of kiln uses.

    x_t = (1 - t) * x0 + t * eps,   t in (0, 1),   t = 1 is pure noise,   velocity v = eps - x0

so dx_t/dt = v and the sampler integrates from t = 1 down to t = 0 with x <- x + (t_next - t) * v.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _broadcast(t: Tensor, like: Tensor) -> Tensor:
    """[B] -> [B, 1, 1, ...] so a per-sample time scales a whole sample."""
    return t.reshape(t.shape[0], *([1] * (like.dim() - 1))).to(like.dtype)


def interpolate(x0: Tensor, eps: Tensor, t: Tensor) -> Tensor:
    """The noisy point x_t on the straight line from data (t = 0) to noise (t = 1)."""
    tb = _broadcast(t, x0)
    return (1 - tb) * x0 + tb * eps


def velocity_target(x0: Tensor, eps: Tensor) -> Tensor:
    """What the network learns to predict: the constant velocity of the straight path."""
    return eps - x0


def shift_timesteps(t: Tensor, shift: float) -> Tensor:
    """t' = shift*t / (1 + (shift-1)*t): shift > 1 moves time towards noise (more steps at high noise)."""
    if shift == 1.0:
        return t
    return shift * t / (1 + (shift - 1) * t)


def resolution_shift(
    num_tokens: int,
    base_tokens: int = 256,
    base_shift: float = 1.0,
    max_tokens: int = 4096,
    max_shift: float = 3.0,
) -> float:
    """Timestep shift for an image of `num_tokens` tokens, linear in tokens through the two anchors.

    More pixels carry more redundant signal, so the same t destroys less of the image: larger images need
    more noise (a larger shift) to see the same effective signal-to-noise ratio.
    """
    slope = (max_shift - base_shift) / (max_tokens - base_tokens)
    return float(base_shift + slope * (num_tokens - base_tokens))


def sample_logit_normal(
    batch: int,
    generator: torch.Generator | None,
    mean: float = 0.0,
    std: float = 1.0,
    device: torch.device | str = "cpu",
) -> Tensor:
    """t = sigmoid(N(mean, std)): concentrates training on the middle of the path (SD3's logit-normal).

    The normal is drawn on the generator's device (CPU by default) so a seed gives the same t everywhere.
    """
    gen_device = generator.device if generator is not None else torch.device("cpu")
    z = torch.randn(batch, generator=generator, device=gen_device) * std + mean
    return torch.sigmoid(z).to(device)


def euler_timesteps(steps: int, shift: float = 1.0) -> Tensor:
    """steps+1 times from 1 (noise) to 0 (data), shifted; the sampler takes one Euler step between neighbours."""
    return shift_timesteps(torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64), shift).float()
