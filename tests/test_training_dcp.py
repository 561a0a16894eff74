"""torch.distributed.checkpoint: a run killed at step k and resumed is the uninterrupted run.

The trainer in one process (the loop N ranks run, without a mesh) trains a micro DiT on demo scenes; DCP
holds model, optimiser, data position and RNG; async saves keep the last K."""

import json

import pytest
import torch
from safetensors.torch import load_file

from training.core.dcp import complete_checkpoints
from training.core.telemetry import read_metrics
from training.core.trainer import train
from training.testing import scene_rows, tiny_config, write_pack_output

STEPS = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory, text_encoder_dir):
    root = tmp_path_factory.mktemp("dcp")
    data = write_pack_output(root / "pack", scene_rows(40, seed=2, buckets=((32, 32), (24, 40)), batch_size=8))
    return root, data, text_encoder_dir


def _cfg(te, **train):
    return tiny_config(te, steps=STEPS, warmup_steps=2, **train)


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["adamw", "muon", "adamw+repa"])
def test_a_run_killed_at_step_k_and_resumed_has_the_uninterrupted_loss_trajectory(setup, optim, vit_teacher_dir):
    root, data, te = setup
    name, _, extra = optim.partition("+")
    repa = {"teacher_path": str(vit_teacher_dir), "block": 0, "hidden": 16, "weight": 0.5, "steps": 5} if extra else {}
    cfg = _cfg(te, optim={"name": name}, repa=repa)
    whole = train(data, root / f"whole-{optim}", cfg)
    train(data, root / f"split-{optim}", cfg, stop_at=3)  # "killed" after its step-3 checkpoint
    assert [r["step"] for r in read_metrics(root / f"split-{optim}" / "metrics.jsonl")] == [1, 2, 3]
    split = train(data, root / f"split-{optim}", cfg, resume=True)  # a new launch resumes from it

    a, b = read_metrics(whole / "metrics.jsonl"), read_metrics(split / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]
    wa, wb = load_file(str(whole / "model.safetensors")), load_file(str(split / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert json.loads((split / "train_state.json").read_text())["step"] == STEPS
    if extra:  # the REPA term is logged while on (steps 1-5), and its projector state resumed with the model
        assert [r.get("repa_loss") is not None for r in b] == [True] * 5 + [False]
        assert [r.get("repa_loss") for r in a] == [r.get("repa_loss") for r in b]


def test_periodic_async_saves_keep_the_last_k(setup):
    root, data, te = setup
    out = train(data, root / "keep", _cfg(te, dcp={"every": 1, "keep": 2, "async_save": True}))
    assert [d.name for d in complete_checkpoints(out)] == [f"step-{STEPS - 1:06d}", f"step-{STEPS:06d}"]
    state = json.loads((out / "dcp" / f"step-{STEPS:06d}" / "train_state.json").read_text())
    assert state["step"] == STEPS and state["tp"] == 1 and state["world_size"] == 1


def test_the_export_loads_as_a_generator(setup):
    from model.generator import Generator

    root, data, te = setup
    out = root / "whole-adamw"
    if not (out / "model.safetensors").exists():
        train(data, out, _cfg(te, optim={"name": "adamw"}))
    gen = Generator.from_pretrained(out)
    assert gen.num_params() == json.loads((out / "train_state.json").read_text())["num_params"]


def test_the_stage_configs_name_no_start_the_ladder_wires_it():
    from kiln.config import load_config

    stages = ["pretrain_256", "pretrain_512", "pretrain_1024", "midtrain", "sft"]
    cfgs = [load_config([f"train={s}"]).train for s in stages]
    assert all(cfg.init_from is None for cfg in cfgs)  # the chain itself: tests/test_training_ladder.py
    assert (
        load_config([]).train.optim.name == "adamw" and load_config([]).train.parallel.tp == 1
    )  # the demo is unchanged
