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


def rope_angles(positions: Tensor, head_dim: int, theta: float = 10_000.0) -> tuple[Tensor, Tensor]:
    """cos, sin of shape [S, head_dim // 2] for positions [S, 3] (float32: angles need the precision)."""
    chunks = []
    for axis, dim in enumerate(axes_dims(head_dim)):
        if dim == 0:
            continue
        freqs = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
        chunks.append(positions[:, axis, None].double() * freqs[None, :])
    angles = torch.cat(chunks, dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs (i, i + head_dim/2) of x [B, H, S, head_dim] by the angles [S, head_dim/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.to(x.dtype)
