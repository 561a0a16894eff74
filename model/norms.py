"""Zero-centred RMSNorm: weight = 1 + a learned scale initialised at 0.

Storing the deviation from 1 (not the weight itself) means weight decay pulls the norm towards the
identity rather than towards zero, and a fresh norm is exactly the plain RMS normalisation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class _RMSNormCPU(torch.autograd.Function):
    """F.rms_norm with a hand-written backward. On CPU, F.rms_norm's autograd is a decomposition (pow, mean,
    rsqrt, mul and the backward of each: ~20 full-size tensor passes, forward+backward); this takes ~8."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
        # one pass for the mean square (vector_norm does not materialise x**2)
        rstd = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps).rsqrt_()
        y = x * rstd
        ctx.save_for_backward(y, rstd, weight)
        return y if weight is None else y * weight

    @staticmethod
    def backward(ctx, g: Tensor):
        y, rstd, weight = ctx.saved_tensors
        gw = None
        if weight is not None and not ctx.needs_input_grad[0]:  # a frozen input: only the gain learns
            return None, (g * y).flatten(0, -2).sum(0), None
        if weight is None:
            dot = torch.linalg.vecdot(g, y)
        else:
            gy = g * y
            if ctx.needs_input_grad[1]:
                gw = gy.flatten(0, -2).sum(0)
            dot = gy @ weight  # sum over channels of (g * weight) * y
            g = g * weight
        # d/dx of y = x * rstd: rstd * (g - y * mean(g * y))
        gx = torch.addcmul(g, y, dot.unsqueeze(-1), value=-1.0 / y.shape[-1]).mul_(rstd)
        return gx, gw, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, affine: bool = True):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.scale = nn.Parameter(torch.zeros(dim)) if affine else None

    def forward(self, x: Tensor) -> Tensor:
        weight = None if self.scale is None else (1.0 + self.scale).to(x.dtype)
        # plain fp32 CPU tensors only: CUDA has a fused kernel, and DTensors (tensor parallel) need F.rms_norm's rules
        if type(x) is Tensor and x.device.type == "cpu" and x.dtype == torch.float32:
            return _RMSNormCPU.apply(x, weight, self.eps)
        return F.rms_norm(x, (self.dim,), weight=weight, eps=self.eps)

    def reset_parameters(self) -> None:
        if self.scale is not None:
            nn.init.zeros_(self.scale)
