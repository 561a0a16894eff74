"""Zero-centred RMSNorm: weight = 1 + a learned scale initialised at 0.

Storing the deviation from 1 (not the weight itself) means weight decay pulls the norm towards the
identity rather than towards zero, and a fresh norm is exactly the plain RMS normalisation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, affine: bool = True):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.scale = nn.Parameter(torch.zeros(dim)) if affine else None

    def forward(self, x: Tensor) -> Tensor:
        weight = None if self.scale is None else (1.0 + self.scale).to(x.dtype)
        return F.rms_norm(x, (self.dim,), weight=weight, eps=self.eps)

    def reset_parameters(self) -> None:
        if self.scale is not None:
            nn.init.zeros_(self.scale)
