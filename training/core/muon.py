"""Muon (Jordan et al. 2024) for the 2-D hidden weights, AdamW for everything else, in one optimiser.

Muon: m = mu m + g; u = g + mu m (Nesterov) or m; O = NewtonSchulz5(u) (approximately U V^T of u's SVD);
W -= lr (0.2 sqrt(max(rows, cols)) O + wd W). The 0.2 sqrt(max) factor (Moonshot, "Muon is Scalable",
2025) gives the update AdamW's RMS, so both groups share one LR and one WSD schedule.

Which parameters: the 2-D projection weights inside transformer blocks (attention and MLP of the DiT and
text-refiner blocks). Per-block modulation (a [6, width] bias, or adaLN's conditioning projection), the
first layers (patch / text / time embeddings), the last (final projection and its modulation), the shared
modulation and every 1-D parameter (gains, biases) stay on AdamW.

DTensor parameters (FSDP2 / TP): Newton-Schulz needs the whole matrix, so each step gathers the full
momentum-corrected update (`full_tensor`: an all-gather of one matrix's worth of data per rank and
parameter), runs Newton-Schulz redundantly on every rank, and keeps the local shard. That costs one
all-gather of the hidden weights per step (the size of an FSDP forward's all-gather) plus
5 x 3 matmuls of the full matrix on each rank; a sharded NS (Dion-style) would avoid the redundancy.
Row permutations (TP's rank-major regrouping) commute with NS, so the result is layout independent.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

ADAMW_PREFIXES = (
    "dit.patch_embed",
    "dit.time_embed",
    "dit.shared_modulation",
    "dit.timestep_tokens",
    "dit.final",
    "text_fusion.proj",
    "text_fusion.layer_attention",
)


def newton_schulz(g: Tensor, steps: int = 5, eps: float = 1e-7) -> Tensor:
    """The quintic Newton-Schulz iteration of Muon: maps g to roughly the nearest semi-orthogonal matrix."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.float()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if transposed else x


def uses_muon(name: str, p: Tensor) -> bool:
    in_block = ".blocks." in name or ".refiner." in name
    return (
        p.dim() == 2
        and name.endswith(".weight")
        and in_block
        and ".modulation." not in name
        and not name.startswith(ADAMW_PREFIXES)
    )


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Muon group (hidden 2-D weights), AdamW groups with and without decay; names in a stable order."""
    muon, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if uses_muon(name, p):
            muon.append(p)
        elif p.dim() >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    return [
        {"params": muon, "use_muon": True, "weight_decay": weight_decay},
        {"params": decay, "use_muon": False, "weight_decay": weight_decay},
        {"params": no_decay, "use_muon": False, "weight_decay": 0.0},
    ]


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _like(full: Tensor, p: Tensor) -> Tensor:
    """The part of a full tensor that `p` holds (p's own shard when p is a DTensor)."""
    if not hasattr(p, "device_mesh"):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)


class Muon(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        betas=(0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "use_muon": False,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["use_muon"]:
                    self._muon(p, group)
                else:
                    self._adamw(p, group)
        return loss

    def _muon(self, p: Tensor, group: dict) -> None:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf = state["momentum_buffer"]
        buf.mul_(group["momentum"]).add_(p.grad)
        update = p.grad.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf
        full = newton_schulz(_full(update), group["ns_steps"])
        full = full * (0.2 * math.sqrt(max(full.shape)))
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(_like(full.to(p.dtype), p), alpha=-group["lr"])

    def _adamw(self, p: Tensor, group: dict) -> None:
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        step = float(state["step"])
        state["exp_avg"].lerp_(p.grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        denom = (state["exp_avg_sq"] / (1 - beta2**step)).sqrt_().add_(group["eps"])
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1**step))


def make_optimizer(model: nn.Module, cfg) -> torch.optim.Optimizer:
    """The optimiser `train.optim.name` names, on a (possibly sharded) Generator, storing the weights as
    `train.optim.weights` says. cfg: TrainConfig."""
    opt = _make_optimizer(model, cfg)
    if cfg.optim.weights == "bf16":
        from training.core.bf16_weights import store_in_bf16

        store_in_bf16(opt)
    return opt


def _make_optimizer(model: nn.Module, cfg) -> torch.optim.Optimizer:
    if cfg.optim.name == "adamw":
        decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=cfg.optim.adam_eps, foreach=False)
    o = cfg.optim
    return Muon(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        momentum=o.muon_momentum,
        nesterov=o.muon_nesterov,
        ns_steps=o.muon_ns_steps,
    )
