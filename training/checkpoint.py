"""Checkpoint folders: what a later stage, the sampler, the evaluator or a resume reads.

    out/config.json, out/model.safetensors   Generator.save_pretrained (trainable weights only)
    out/optimizer.safetensors                AdamW moments + step per parameter name, for exact resume
    out/train_state.json                     step, data position, final loss, data facts, config dump

Everything in them is deterministic for the same data and config (wall-clock throughput lives in
throughput.json next to them), so a checkpoint is a reproducible asset.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from training.data import DataPosition

STATE_FILE = "train_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"


@dataclass(frozen=True)
class TrainState:
    step: int  # optimiser steps done
    position: DataPosition  # where the data stream continues
    final_loss: float | None  # loss of the last step
    loss_ema: float | None  # smoothed loss at the last step
    bucket: str  # the main training bucket "HxW": the resolution samples and evals use
    rows: int  # training rows (after the hold-out)
    holdout: int  # rows held out for evaluation
    num_params: int
    config: dict = field(default_factory=dict)  # the full KilnConfig that produced it

    def to_json(self) -> str:
        d = asdict(self) | {"position": self.position.to_dict()}
        return json.dumps(d, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "TrainState":
        d = json.loads(text)
        d["position"] = DataPosition.from_dict(d["position"])
        return cls(**d)


def read_train_state(checkpoint: Path) -> TrainState:
    path = Path(checkpoint) / STATE_FILE
    if not path.exists():
        raise FileNotFoundError(f"{checkpoint} has no {STATE_FILE}: not a kiln training checkpoint")
    return TrainState.from_json(path.read_text())


def optimizer_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """AdamW state keyed by parameter name (not by position), so it survives module re-ordering."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in opt.state.get(p, {}).items():
                t = value if torch.is_tensor(value) else torch.tensor(float(value))
                out[f"{names[id(p)]}::{key}"] = t.detach().contiguous().cpu()
    return out


def load_optimizer_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    for full, value in tensors.items():
        name, key = full.rsplit("::", 1)
        p = params[name]
        opt.state[p][key] = value.to(p.device) if key != "step" else value.clone()


def save_checkpoint(gen, opt: torch.optim.Optimizer, out_dir: Path, state: TrainState) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    gen.save_pretrained(out_dir)
    save_file(optimizer_tensors(gen, opt), str(out_dir / OPTIMIZER_FILE))
    (out_dir / STATE_FILE).write_text(state.to_json())
    return out_dir


def load_optimizer(gen, opt: torch.optim.Optimizer, checkpoint: Path) -> None:
    load_optimizer_tensors(gen, opt, load_file(str(Path(checkpoint) / OPTIMIZER_FILE)))
