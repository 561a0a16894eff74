"""TDM distillation under FSDP2 (+ TP) computes what one process computes (training/post/distill.py on the
shared runner, training/post/runner.py).

A tiny teacher whose heads split over tp=2 is distilled once in this process and once by two gloo ranks
launched like torchrun (RANK / WORLD_SIZE / MASTER_ADDR in the environment, so `distill` joins the group
itself): with its batch of 3 prompts split unevenly over dp=2 (so each rank's share of the global mean is
tested), with tp=2, and over dp=2 killed after iteration 2 and resumed. The exported students must agree
with the one-process student within float tolerance, and the logged terms must be the global means."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
from safetensors.torch import load_file

from kiln.config import KilnConfig, PostConfig, TrainConfig
from training.core.checkpoint import STATE_FILE, TrainState, verify_export
from training.core.data import DataPosition

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SIDE = 16
DISTILL = {
    "student_steps": 2,
    "iterations": 3,
    "batch": 3,
    "fake_updates": 2,
    "save_every": 2,
    "lr": 1e-3,
    "fake_lr": 1e-3,
    "teacher_cfg": 2.0,
    "seed": 5,
}
RUNS = ("tdm_dp2", "tdm_tp2", "tdm_dp2_resumed")


def config(te_dir, tp: int = 1) -> KilnConfig:
    from model.testing import micro_model_config

    post = PostConfig.model_validate({"judge": "demo_pixel", "resolution": SIDE, "distill": DISTILL})
    return KilnConfig(model=micro_model_config(te_dir), train=TrainConfig(threads=1, parallel={"tp": tp}), post=post)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, text_encoder_dir):
    """A checkpoint folder of a micro generator with 4 heads / 2 kv heads (tp=2 divides them), every weight
    perturbed from its zero-closing init so student and fake score get gradients everywhere."""
    from model.dit import DiTConfig
    from model.generator import Generator

    torch.manual_seed(0)
    gen = Generator.build(
        config(text_encoder_dir).model,
        DiTConfig(
            width=64, depth=2, heads=4, kv_heads=2, mlp_hidden=128, patch_size=2, in_channels=3, pad_to_multiple=16
        ),
    )
    with torch.no_grad():
        for p in gen.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ckpt = tmp_path_factory.mktemp("tdm_ranks") / "teacher"
    gen.save_pretrained(ckpt)
    state = TrainState(
        step=0,
        position=DataPosition(),
        final_loss=None,
        loss_ema=None,
        bucket=f"{SIDE}x{SIDE}",
        rows=0,
        holdout=0,
        num_params=gen.num_params(),
    )
    (ckpt / STATE_FILE).write_text(state.to_json())
    return ckpt


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, ports: list[int], ckpt: str, out: str, te_dir: str) -> None:
    """One rank of torchrun-style jobs, each run a job of its own on a port of its own."""
    import faulthandler

    from training.post.distill import distill

    faulthandler.dump_traceback_later(240, exit=True)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    runs = [lambda: distill(ckpt, f"{out}/tdm_dp2", config(te_dir)),
            lambda: distill(ckpt, f"{out}/tdm_tp2", config(te_dir, tp=2)),
            lambda: distill(ckpt, f"{out}/tdm_dp2_resumed", config(te_dir), stop_at=2),  # "killed" after the checkpoint at iteration 2
            lambda: distill(ckpt, f"{out}/tdm_dp2_resumed", config(te_dir), resume=True)]  # fmt: skip
    for port, run in zip(ports, runs, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        run()


def weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def history(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "tdm_history.jsonl").read_text().splitlines()]


def test_two_ranks_distil_the_student_one_process_distils(teacher, tmp_path, text_encoder_dir):
    from training.post.distill import distill

    one = distill(teacher, tmp_path / "tdm_one", config(text_encoder_dir))
    torch.multiprocessing.spawn(
        _rank,
        args=(2, [_free_port() for _ in range(4)], str(teacher), str(tmp_path), str(text_encoder_dir)),
        nprocs=2,
        join=True,
    )

    initial, ref = weights(teacher), weights(one)
    assert max(float((ref[k] - initial[k]).abs().max()) for k in ref) > 1e-3, (
        "the student did not train: the comparison would be empty"
    )
    for name in RUNS:
        got = weights(tmp_path / name)
        assert sorted(got) == sorted(ref), name
        # fp32 sums in another order give ~1e-7 in a loss, which Adam's normalised steps can turn into ~1e-5
        # on weights whose gradient is near zero; a wrong share of the batch or another rank's noise is > 1e-2
        diffs = {k: float((got[k] - ref[k]).abs().max()) for k in ref}
        assert max(diffs.values()) < 2e-4, (
            f"{name}: differs from one process by {max(diffs.values())} ({sorted(diffs, key=diffs.get)[-3:]})"
        )
        steps = history(tmp_path / name)
        assert [h["iteration"] for h in steps] == [1, 2, 3]  # the resumed run logs each iteration once
        for a, b in zip(steps, history(one), strict=True):  # the logged terms are global means, not rank 0's
            for key in (
                "fake_loss",
                "student_loss",
                "teacher_gap",
                "importance_weight",
                "student_grad_norm",
                "fake_grad_norm",
            ):
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (name, key)
        assert verify_export(tmp_path / name)  # the export is the single-process folder, with its checksums
        assert json.loads((tmp_path / name / "sampler.json").read_text()) == json.loads(
            (one / "sampler.json").read_text()
        )
        assert json.loads((tmp_path / name / "tdm.json").read_text())["parallel"] == {
            "world_size": 2,
            "tp": 2 if name == "tdm_tp2" else 1,
        }
