"""The single-stream DiT: text tokens and image patches share one sequence through every block.

Block: x += gate_a * Attn(mod(norm(x))); x += gate_m * SwiGLU(mod(norm(x))), where mod(h) = h*(1+scale)+shift.
Modulation ("light", the default): one timestep projection shared by all blocks gives shift/scale/gate
vectors and each block adds its own learned bias; "adaln" gives every block its own projection (DiT's
adaLN); "none" has no modulation at all (affine norms, like the text refiner): the timestep then enters only
as `timestep_tokens` in the sequence. All start closed, so every block (and the output) is the identity /
zero at initialisation. The ablation knobs (kv_heads, the gate, QK-norm, partial RoPE, the MLP type, token
routing) are described in docs/ablations.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.attention import Attention, GeluMLP, SwiGLU, attention_bias
from model.norms import RMSNorm
from model.rope import image_positions, rope_angles

if TYPE_CHECKING:
    from model.reference import ReferenceTokens
    from model.routing import TokenRoute


@dataclass(frozen=True)
class DiTConfig:
    """Everything that decides the DiT's shape; resolved from ModelConfig + size and saved with weights."""

    width: int
    depth: int
    heads: int
    kv_heads: int
    mlp_hidden: int
    patch_size: int = 2
    in_channels: int = 3
    modulation: Literal["light", "adaln", "none"] = "light"
    timestep_tokens: int = 0
    pad_to_multiple: int = 64
    rope_theta: float = 10_000.0
    qk_norm: bool = True
    gated_attention: bool = True
    rope_fraction: float = 1.0  # share of each head's dims RoPE rotates
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    abs_pos: bool = False  # add fixed 2-D sin-cos positions to the patch tokens (besides RoPE)
    prediction: Literal["v", "x"] = "v"  # x: the head outputs the clean image; forward still returns the velocity
    pixel_head: int = 0  # >0: the final layer gives this many channels per pixel and a 3x3 conv across the patch seams makes the output

    def __post_init__(self) -> None:
        if self.modulation == "none" and not self.timestep_tokens:
            raise ValueError("modulation='none' needs timestep_tokens > 0: the timestep would not reach the model")

    def to_dict(self) -> dict:
        return asdict(self)


X_PRED_MIN_T = 0.05  # JiT's clip: near t = 0 the division would turn a small error in x0 into a huge one in v


def velocity_from_clean(x_t: Tensor, x0: Tensor, t: Tensor) -> Tensor:
    """v = eps - x0 = (x_t - x0) / t under model.flow's x_t = (1 - t) x0 + t eps: an x-predicting head
    serves every sampler, loss and post-training loop that expects a velocity (Li & He, JiT, 2025)."""
    return (x_t.float() - x0.float()) / t.float().clamp(min=X_PRED_MIN_T).view(-1, *([1] * (x_t.dim() - 1)))


# --------------------------------------------------------------------------------------- patch helpers
def sincos_2d(hp: int, wp: int, width: int, device: torch.device | str = "cpu") -> Tensor:
    """[hp * wp, width] fixed sin-cos embedding of each patch's (row, column), half the channels each (DiT, MAE).

    RoPE puts only relative positions into attention scores; this writes where a token is into the token
    itself, so "on the left" can switch a token to foreground from the first layer (the tiny demo model
    learns layout several times faster with it)."""
    quarter = width // 4
    freqs = 1.0 / (10_000 ** (torch.arange(quarter, dtype=torch.float32, device=device) / quarter))
    rows = torch.arange(hp, dtype=torch.float32, device=device).repeat_interleave(wp)[:, None] * freqs
    cols = torch.arange(wp, dtype=torch.float32, device=device).repeat(hp)[:, None] * freqs
    emb = torch.cat([rows.sin(), rows.cos(), cols.sin(), cols.cos()], dim=1)
    return F.pad(emb, (0, width - emb.shape[1]))


def patchify(x: Tensor, p: int) -> Tensor:
    """[B, C, H, W] -> [B, (H/p)*(W/p), C*p*p], patches in row-major order (any aspect ratio)."""
    b, c, h, w = x.shape
    if h % p or w % p:
        raise ValueError(f"image {h}x{w} is not a multiple of the patch size {p}")
    x = x.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // p) * (w // p), c * p * p)


def unpatchify(tokens: Tensor, p: int, channels: int, height: int, width: int) -> Tensor:
    """Inverse of patchify."""
    b = tokens.shape[0]
    hp, wp = height // p, width // p
    x = tokens.view(b, hp, wp, channels, p, p).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, channels, height, width)


def timestep_embedding(t: Tensor, dim: int = 256, max_period: float = 10_000.0) -> Tensor:
    """Sinusoidal features of 1000*t (t in [0, 1]) so neighbouring times are distinguishable."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = 1000.0 * t.float()[:, None] * freqs[None]
    return torch.cat([args.cos(), args.sin()], dim=-1)


# -------------------------------------------------------------------------------------------- modules
class LightModulation(nn.Module):
    """The block's own learned bias on top of the shared timestep projection."""

    def __init__(self, width: int):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(6, width))

    def forward(self, shared: Tensor, c: Tensor) -> Tensor:
        return shared + self.bias.to(shared.dtype)


class AdaLNModulation(nn.Module):
    """A per-block projection of the timestep conditioning (DiT adaLN-Zero)."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 6 * width)

    def forward(self, shared: Tensor | None, c: Tensor) -> Tensor:
        return self.proj(c).view(c.shape[0], 6, -1)


class Block(nn.Module):
    """Pre-norm transformer block. modulation=None (text refiner, or the DiT's modulation "none"): affine
    norms, and the output projections start at zero."""

    def __init__(
        self,
        width: int,
        heads: int,
        kv_heads: int,
        mlp_hidden: int,
        modulation: Literal["light", "adaln"] | None,
        qk_norm: bool = True,
        gated_attention: bool = True,
        mlp: Literal["swiglu", "gelu"] = "swiglu",
    ):
        super().__init__()
        affine = modulation is None
        self.norm1 = RMSNorm(width, affine=affine)
        self.attn = Attention(width, heads, kv_heads, qk_norm=qk_norm, gated=gated_attention)
        self.norm2 = RMSNorm(width, affine=affine)
        self.mlp = {"swiglu": SwiGLU, "gelu": GeluMLP}[mlp](width, mlp_hidden)
        kinds = {"light": LightModulation, "adaln": AdaLNModulation}
        self.modulation = kinds[modulation](width) if modulation is not None else None

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        key_mask: Tensor | None,
        shared: Tensor | None = None,
        c: Tensor | None = None,
    ) -> Tensor:
        if self.modulation is None:
            x = x + self.attn(self.norm1(x), rope, key_mask)
            return x + self.mlp(self.norm2(x))
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.modulation(shared, c).unsqueeze(2).unbind(1)
        x = torch.addcmul(x, gate_a, self.attn(torch.addcmul(shift_a, self.norm1(x), 1 + scale_a), rope, key_mask))
        return torch.addcmul(x, gate_m, self.mlp(torch.addcmul(shift_m, self.norm2(x), 1 + scale_m)))

    def init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                m.reset_parameters()
        if isinstance(self.modulation, LightModulation):
            nn.init.zeros_(self.modulation.bias)
        elif isinstance(self.modulation, AdaLNModulation):
            nn.init.zeros_(self.modulation.proj.weight)
            nn.init.zeros_(self.modulation.proj.bias)
        else:  # no gate to close: close the residual branches at their output projections
            nn.init.zeros_(self.attn.out.weight)
            nn.init.zeros_(self.mlp.down.weight)

    def flops_per_token(self, seq_len: int) -> int:
        return self.attn.flops_per_token(seq_len) + self.mlp.flops_per_token()


class DiT(nn.Module):
    """Velocity network over patches of x [B, C, H, W], conditioned on t [B] and text tokens [B, L, width]."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        w, p = cfg.width, cfg.patch_size
        self.patch_embed = nn.Linear(cfg.in_channels * p * p, w)
        self.time_embed = nn.Sequential(nn.Linear(256, w), nn.SiLU(), nn.Linear(w, w))
        self.shared_modulation = nn.Linear(w, 6 * w, bias=False) if cfg.modulation == "light" else None
        self.timestep_tokens = nn.Linear(w, cfg.timestep_tokens * w) if cfg.timestep_tokens else None
        block_modulation = None if cfg.modulation == "none" else cfg.modulation
        self.blocks = nn.ModuleList(
            Block(
                w, cfg.heads, cfg.kv_heads, cfg.mlp_hidden, block_modulation, cfg.qk_norm, cfg.gated_attention, cfg.mlp
            )
            for _ in range(cfg.depth)
        )
        modulated = cfg.modulation != "none"
        self.final_norm = RMSNorm(w, affine=not modulated)
        self.final_modulation = nn.Linear(w, 2 * w) if modulated else None
        head = cfg.pixel_head or cfg.in_channels
        self.final = nn.Linear(w, head * p * p)
        self.pixel_conv = nn.Conv2d(head, cfg.in_channels, 3, padding=1) if cfg.pixel_head else None
        self.init_weights()

    def init_weights(self) -> None:
        """Xavier for projections; zero for everything that closes a residual branch or the output.

        On the meta device there is nothing to fill (and random fills there are slow): materialise with
        `to_empty(device=...)`, then call this."""
        if self.patch_embed.weight.is_meta:
            return
        nn.init.xavier_uniform_(self.patch_embed.weight)
        nn.init.zeros_(self.patch_embed.bias)
        for m in self.time_embed:
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        if self.shared_modulation is not None:
            nn.init.zeros_(self.shared_modulation.weight)
        if self.timestep_tokens is not None:
            nn.init.normal_(self.timestep_tokens.weight, std=0.02)
            nn.init.zeros_(self.timestep_tokens.bias)
        for block in self.blocks:
            block.init_weights()
        self.final_norm.reset_parameters()  # affine only under modulation 'none'
        closing = (
            (self.final_modulation, self.final) if self.pixel_conv is None else (self.final_modulation, self.pixel_conv)
        )
        for m in closing:
            if m is None:
                continue
            nn.init.zeros_(m.weight)
            nn.init.zeros_(m.bias)
        if self.pixel_conv is not None:  # the conv closes the output; the layer before it must pass a signal
            nn.init.xavier_uniform_(self.final.weight)
            nn.init.zeros_(self.final.bias)

    # ------------------------------------------------------------------------------------- sequence
    def sequence_length(self, text_len: int, height: int, width: int, reference_tokens: int = 0) -> int:
        """Tokens per sample after padding: text + timestep tokens + patches (+ reference tokens), rounded up
        to pad_to_multiple."""
        p, m = self.cfg.patch_size, max(1, self.cfg.pad_to_multiple)
        n = text_len + self.cfg.timestep_tokens + (height // p) * (width // p) + reference_tokens
        return -(-n // m) * m

    def _rope(
        self, text_len: int, hp: int, wp: int, seq_len: int, device: torch.device, refs: ReferenceTokens | None = None
    ) -> tuple[Tensor, Tensor]:
        prefix = text_len + self.cfg.timestep_tokens
        pos = torch.zeros(seq_len, 3, dtype=torch.long, device=device)  # text, timestep and pad tokens at 0
        pos[prefix : prefix + hp * wp] = image_positions(1, hp, wp).to(device)
        if refs is not None:  # after the patches, each reference in its own frame
            ref_pos = refs.positions().to(device)
            pos[prefix + hp * wp : prefix + hp * wp + len(ref_pos)] = ref_pos
        return rope_angles(pos, self.cfg.width // self.cfg.heads, self.cfg.rope_theta, self.cfg.rope_fraction)

    def forward(
        self,
        x: Tensor,
        t: Tensor,
        text: Tensor,
        text_mask: Tensor,
        refs: ReferenceTokens | None = None,
        route: TokenRoute | None = None,
    ) -> Tensor:
        """`refs`: style-reference tokens (model/reference.py), appended after the patches with the logit
        bias log(strength) on their keys; None computes exactly what the DiT computes without the pathway.
        `route` (training only, model/routing.py): the image tokens that skip blocks [route.start, route.end)."""
        b, _, h, w = x.shape
        p, k, text_len = self.cfg.patch_size, self.cfg.timestep_tokens, text.shape[1]
        hp, wp = h // p, w // p
        img = self.patch_embed(patchify(x, p).to(self.patch_embed.weight.dtype))
        if self.cfg.abs_pos:
            img = img + sincos_2d(hp, wp, self.cfg.width, img.device).to(img.dtype)
        c = F.silu(self.time_embed(timestep_embedding(t).to(img.dtype)))
        parts, masks = [text.to(img.dtype)], [text_mask.bool()]
        if self.timestep_tokens is not None:
            parts.append(self.timestep_tokens(c).view(b, k, -1))
            masks.append(text_mask.new_ones(b, k, dtype=torch.bool))
        parts.append(img)
        masks.append(text_mask.new_ones(b, hp * wp, dtype=torch.bool))
        n_ref = 0
        if refs is not None:
            n_ref = refs.tokens.shape[1] * refs.tokens.shape[2]
            parts.append(refs.tokens.reshape(b, n_ref, -1).to(img.dtype))
            masks.append(text_mask.new_ones(b, n_ref, dtype=torch.bool))
        seq = torch.cat(parts, dim=1)
        seq_len = self.sequence_length(text_len, h, w, n_ref)
        pad = seq_len - seq.shape[1]
        if pad:
            seq = F.pad(seq, (0, 0, 0, pad))
            masks.append(text_mask.new_zeros(b, pad, dtype=torch.bool))
        key_mask = attention_bias(torch.cat(masks, dim=1), seq.dtype)
        if refs is not None:  # strength s multiplies every query's attention weight on the reference by s
            first = text_len + k + hp * wp
            key_mask = key_mask.clone()
            key_mask[:, 0, 0, first : first + n_ref] += refs.key_bias(seq.dtype)
        rope = self._rope(text_len, hp, wp, seq_len, x.device, refs)
        shared = self.shared_modulation(c).view(b, 6, -1) if self.shared_modulation is not None else None
        start = text_len + k
        if route is None:
            for block in self.blocks:
                seq = block(seq, rope, key_mask, shared, c)
        else:
            seq = self._routed_blocks(seq, rope, key_mask, shared, c, route, start)
        out = self.final_norm(seq[:, start : start + hp * wp])
        if self.final_modulation is not None:
            shift, scale = self.final_modulation(c).unsqueeze(1).chunk(2, dim=-1)
            out = out * (1 + scale) + shift
        if self.pixel_conv is None:
            out = unpatchify(self.final(out), p, self.cfg.in_channels, h, w)
        else:
            out = self.pixel_conv(F.silu(unpatchify(self.final(out), p, self.cfg.pixel_head, h, w)))
        if self.cfg.prediction == "x":
            out = velocity_from_clean(x, out, t)
        return out.to(x.dtype)

    def _routed_blocks(
        self,
        seq: Tensor,
        rope: tuple[Tensor, Tensor],
        key_mask: Tensor,
        shared: Tensor | None,
        c: Tensor,
        route: TokenRoute,
        image_start: int,
    ) -> Tensor:
        """The blocks with `route`'s image tokens leaving before block route.start and rejoining, as they
        left, after block route.end - 1 (TREAD)."""
        if not 0 <= route.start < route.end <= self.cfg.depth:
            raise ValueError(
                f"token route blocks [{route.start}, {route.end}) are not inside the DiT's {self.cfg.depth} blocks (train.route.start / end)"
            )
        keep = route.kept_positions(seq.shape[1], image_start, seq.device)
        for i, block in enumerate(self.blocks):
            if i == route.start:
                full, seq = seq, seq.index_select(1, keep)
                sub_rope, sub_mask = (rope[0][keep], rope[1][keep]), key_mask.index_select(3, keep)
            if route.start <= i < route.end:
                seq = block(seq, sub_rope, sub_mask, shared, c)
            else:
                seq = block(seq, rope, key_mask, shared, c)
            if i == route.end - 1:
                seq = full.index_copy(1, keep, seq)
        return seq

    def flops_per_sample(self, text_len: int, height: int, width: int) -> int:
        """Forward FLOPs of one sample (matmuls and attention; norms and activations are negligible)."""
        s = self.sequence_length(text_len, height, width)
        n_img = (height // self.cfg.patch_size) * (width // self.cfg.patch_size)
        per_token = sum(block.flops_per_token(s) for block in self.blocks)
        io = 2 * n_img * (self.patch_embed.in_features * self.cfg.width + self.cfg.width * self.final.out_features)
        if self.pixel_conv is not None:
            io += 2 * height * width * self.pixel_conv.weight.numel()
        return s * per_token + io
