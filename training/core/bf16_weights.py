"""bf16-stored weights, the ablation of fp32 master weights (PRX, part 2).

Without fp32 master weights, the optimiser's update is added to a bf16 copy, and any update below half a
bf16 ulp of its weight (about 2^-9 relative) is lost. This reproduces that storage on any device: the
weights are rounded to bf16 at the start and after every optimiser step, while the arithmetic (forward,
backward, the optimiser's own state) stays in the run's dtype. `train.optim.weights=bf16` turns it on."""

from __future__ import annotations

import torch


@torch.no_grad()
def round_to_bf16(params) -> None:
    for p in params:
        p.copy_(p.to(torch.bfloat16).to(p.dtype))


def store_in_bf16(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Round the optimiser's parameters to bf16 now and after each of its steps."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    round_to_bf16(params)
    optimizer.register_step_post_hook(lambda opt, args, kwargs: round_to_bf16(params))
    return optimizer
