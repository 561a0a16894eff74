"""`train.optim.weights=bf16`, the demo ablation's stand-in for training without fp32 master weights: the
weights are bf16 numbers after every step, so an update below bf16's precision is lost; fp32 keeps it."""

import pytest
import torch

from kiln.config import TrainConfig
from training.core.muon import make_optimizer


def _one_step(weights: str, name: str, init: dict) -> torch.Tensor:
    lin = torch.nn.Linear(8, 8)
    lin.load_state_dict(init)
    opt = make_optimizer(lin, TrainConfig.model_validate({"lr": 1e-5, "optim": {"name": name, "weights": weights}}))
    lin(torch.ones(4, 8)).square().sum().backward()
    opt.step()
    return lin.weight.detach().clone()


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_bf16_stored_weights_lose_an_update_below_bf16_precision_that_fp32_master_weights_keep(name):
    torch.manual_seed(0)
    init = {k: v.to(torch.bfloat16).float() for k, v in torch.nn.Linear(8, 8).state_dict().items()}  # equal starts
    fp32, bf16 = _one_step("fp32", name, init), _one_step("bf16", name, init)
    assert not torch.equal(fp32, init["weight"])  # a 1e-5 step moves fp32 weights
    assert torch.equal(bf16, bf16.to(torch.bfloat16).float())  # bf16 numbers after the step
    assert (bf16 != init["weight"]).float().mean() < 0.1  # and almost every update was rounded away
