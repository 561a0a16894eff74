"""3-D axial rotary position embedding over (frame, height, width).

The head dimension is split into three chunks, one per axis; each chunk rotates pairs of channels by
angle = position_along_axis * frequency. Because q and k are rotated by their own positions, the q.k
score depends only on the difference of positions (tested). Text tokens sit at (0, 0, 0): no rotation.
"""

from __future__ import annotations

import torch
from torch import Tensor


def axes_dims(head_dim: int) -> tuple[int, int, int]:
    """Split head_dim into even (frame, height, width) chunks; frame gets about a quarter."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    f = 2 * (head_dim // 8)
    h = 2 * ((head_dim - f) // 4)
    w = head_dim - f - h
    return f, h, w


def image_positions(frames: int, height: int, width: int) -> Tensor:
    """[frames*height*width, 3] integer (f, h, w) positions, row-major like patchify."""
    f, h, w = torch.meshgrid(torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij")
    return torch.stack([f, h, w], dim=-1).reshape(-1, 3)


def rotated_dims(head_dim: int, fraction: float = 1.0) -> int:
    """How many of a head's channels partial RoPE rotates: fraction * head_dim, rounded to whole pairs."""
    return 2 * round(fraction * head_dim / 2)


def rope_angles(
    positions: Tensor, head_dim: int, theta: float = 10_000.0, fraction: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Rotation tables (cos, sin), each [S, head_dim], for positions [S, 3] (float32: angles need the precision).

    Channel pair (i, i + head_dim/2) turns by angle a_i: cos = [cos a, cos a], sin = [-sin a, sin a] (the
    sign is in the table), so `apply_rope` is one swap of the halves, one multiply and one multiply-add.
    Partial RoPE (`fraction` < 1): only the first `rotated_dims` / 2 pairs turn, split over the three axes as a
    head of that size would be; the other pairs get angle 0 (cos 1, sin 0), which leaves them exactly as they are."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    rotated = rotated_dims(head_dim, fraction)
    chunks = []
    for axis, dim in enumerate(axes_dims(rotated)):
        if dim == 0:
            continue
        freqs = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
        chunks.append(positions[:, axis, None].double() * freqs[None, :])
    if rotated < head_dim:
        chunks.append(positions.new_zeros(positions.shape[0], (head_dim - rotated) // 2, dtype=torch.float64))
    angles = torch.cat(chunks, dim=-1)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1).float(), torch.cat([-sin, sin], dim=-1).float()


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, sign: float) -> Tensor:
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return torch.addcmul(x * cos, swapped, sin, value=sign)


class _Rope(torch.autograd.Function):
    """The rotation's gradient is the inverse rotation (sin -> -sin): 3 passes where autograd takes 4."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, g: Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(g, cos, sin, -1.0), None, None


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs (i, i + head_dim/2) of x [B, H, S, head_dim] by the tables [S, head_dim] of
    `rope_angles`: x * cos + swap_halves(x) * sin, in float32 (the tables' dtype). The result keeps x's memory
    layout (no concatenation), so a [B, S, H, D]-major q reaches SDPA without a copy."""
    return _Rope.apply(x, cos, sin).to(x.dtype)
