"""An exponential moving average of the trained weights: ema <- decay * ema + (1 - decay) * weights after
every applied optimiser step, starting from the initial weights.

The EMA is this module's buffers, one per trainable parameter, cloned from the parameter: under FSDP2 a
parameter is a sharded DTensor, so its EMA is a DTensor with the same sharding and each rank keeps (and
updates, with no communication) only its shard. It is saved and restored with the DCP step checkpoints as
one of the Checkpointer's `aux` entries, so a resumed run continues the same average. `swap_into` puts the
average into the model for the export (train.final_weights=ema). PMA (training/core/pma.py) is the alternative
that needs no extra copy during training.
"""

from __future__ import annotations

import torch
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (a DTensor's shard; a plain tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def buffer_name(param_name: str) -> str:
    """Buffer names may not contain dots."""
    return param_name.replace(".", "-")


class WeightEma(nn.Module):
    def __init__(self, model: nn.Module, decay: float):
        super().__init__()
        if not 0 < decay < 1:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        params = dict(model.named_parameters())
        with torch.no_grad():
            for n in self.names:
                self.register_buffer(buffer_name(n), params[n].detach().clone().float(), persistent=True)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One averaging step, on this rank's shards (after the optimiser step)."""
        params = dict(model.named_parameters())
        for n in self.names:
            _local(getattr(self, buffer_name(n))).lerp_(_local(params[n]).float(), 1.0 - self.decay)

    @torch.no_grad()
    def swap_into(self, model: nn.Module) -> None:
        """Copy the average into the model's parameters (each rank its shards)."""
        params = dict(model.named_parameters())
        for n in self.names:
            _local(params[n]).copy_(_local(getattr(self, buffer_name(n))))

    def averaged(self) -> dict[str, torch.Tensor]:
        """{parameter name: its EMA} (this rank's view)."""
        return {n: getattr(self, buffer_name(n)) for n in self.names}
