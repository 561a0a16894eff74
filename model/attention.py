"""Grouped-query attention with QK-norm, RoPE and a sigmoid output gate; and the SwiGLU MLP.

The gate (Qiu et al. 2025, "Gated Attention"): the attention output is multiplied elementwise by
sigmoid(W_g h) of the block input h before the output projection. It adds a cheap non-linearity after the
value mixing and removes attention sinks. q, k, v and the gate come out of one fused matmul.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.norms import RMSNorm
from model.rope import apply_rope


def attention_bias(key_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """[B, S] bool -> additive [B, 1, 1, S] (0 or -inf): SDPA's CPU kernels convert a bool mask on every
    call, so a stack of blocks converts it once. Every query must keep at least one key."""
    bias = torch.zeros(key_mask.shape, dtype=dtype, device=key_mask.device)
    return bias.masked_fill(~key_mask, float("-inf"))[:, None, None, :]


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int, qk_norm: bool = True, gated: bool = True):
        super().__init__()
        if width % heads or heads % kv_heads:
            raise ValueError(f"width {width} / heads {heads} / kv_heads {kv_heads} do not divide")
        self.heads, self.kv_heads, self.head_dim, self.gated = heads, kv_heads, width // heads, gated
        q_dim, kv_dim = heads * self.head_dim, kv_heads * self.head_dim
        self.split = (q_dim, kv_dim, kv_dim) + ((q_dim,) if gated else ())
        self.qkvg = nn.Linear(width, sum(self.split), bias=False)
        self.out = nn.Linear(q_dim, width, bias=False)
        self.q_norm = RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim) if qk_norm else nn.Identity()

    def forward(self, h: Tensor, rope: tuple[Tensor, Tensor] | None = None, key_mask: Tensor | None = None) -> Tensor:
        """h [B, S, width]; rope the (cos, sin) tables [S, head_dim] of `rope_angles`; key_mask [B, S] bool
        (True = attend to this key) or an additive bias [B, 1, 1, S] from `attention_bias`, computed once and
        shared by all blocks."""
        b, s, _ = h.shape
        parts = self.qkvg(h).split(self.split, dim=-1)
        q = self.q_norm(parts[0].view(b, s, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(parts[1].view(b, s, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = parts[2].view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        mask = key_mask if key_mask is None or key_mask.dim() == 4 else attention_bias(key_mask, q.dtype)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads)
        o = o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        if self.gated:
            o = o * torch.sigmoid(parts[3])
        return self.out(o)

    def flops_per_token(self, seq_len: int) -> int:
        """Forward FLOPs for one token: the fused projections plus QK^T and AV over seq_len keys."""
        width = self.qkvg.in_features
        proj = 2 * width * sum(self.split) + 2 * self.out.in_features * width
        return proj + 4 * seq_len * self.heads * self.head_dim


def swiglu_hidden(width: int, ratio: float = 4.0, multiple_of: int = 64) -> int:
    """The 2/3-adjusted SwiGLU width: 2/3 * ratio * width (same FLOPs as a 4x GELU MLP), rounded up."""
    return int(math.ceil(2 / 3 * ratio * width / multiple_of) * multiple_of)


class _SwiGLUAct(torch.autograd.Function):
    """silu(gate) * up of the fused [gate | up] projection, with one new activation-sized buffer per pass.

    Forward keeps only its input (silu is recomputed in backward: cheaper than a second buffer); backward
    writes both halves of the gradient into one buffer in place (autograd's chunk backward would concatenate
    them, and every fresh buffer of this size costs page faults on CPU). Bit-identical to the plain form."""

    @staticmethod
    def forward(ctx, h: Tensor) -> Tensor:
        gate, up = h.chunk(2, dim=-1)
        ctx.save_for_backward(h)
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx, g: Tensor):
        (h,) = ctx.saved_tensors
        gate, up = h.chunk(2, dim=-1)
        grad = torch.empty_like(h)
        d_gate, d_up = grad.chunk(2, dim=-1)
        torch.mul(g, up, out=d_gate)
        torch.ops.aten.silu_backward.grad_input(d_gate, gate, grad_input=d_gate)  # elementwise: in place is safe
        torch.ops.aten.silu.out(gate, out=d_up)
        d_up.mul_(g)
        return grad


class SwiGLU(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(width, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h = self.gate_up(x)
        if (
            torch.compiler.is_compiling()
        ):  # inductor fuses the plain form; the hand-written backward's out= would break the graph
            gate, up = h.chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(_SwiGLUAct.apply(h))

    def flops_per_token(self) -> int:
        return (
            2 * self.gate_up.in_features * self.gate_up.out_features
            + 2 * self.down.in_features * self.down.out_features
        )


def gelu_hidden(width: int, ratio: float = 4.0) -> int:
    """The classic 4x GELU width: 2 * width * 4w * 2 matmuls = 16 w^2 FLOPs per token, what the 2/3-adjusted
    SwiGLU (`swiglu_hidden`: three w x 8w/3 matmuls) also costs, so the two MLPs compare at equal compute."""
    return int(ratio * width)


class GeluMLP(nn.Module):
    """up -> GELU (tanh approximation) -> down: the MLP of the original DiT, the SwiGLU ablation's baseline."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))

    def flops_per_token(self) -> int:
        return 2 * self.up.in_features * self.up.out_features + 2 * self.down.in_features * self.down.out_features
