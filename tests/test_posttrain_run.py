"""Post-training under FSDP2 (+ TP) computes what one process computes (training/post/runner.py).

A tiny generator whose heads split over tp=2 is trained by DPO and GRPO once in this process and once by two
gloo ranks launched like torchrun (RANK / WORLD_SIZE / MASTER_ADDR in the environment, so the loops join the
group themselves): DPO with its pairs split over dp=2, DPO with tp=2, and GRPO with its prompts split over
dp=2, killed after iteration 2 and resumed. The splits are uneven (5 pairs, 3 prompts over 2 ranks), so a
rank's share of the global mean is tested too. The exported weights must agree within float tolerance."""

from __future__ import annotations

import json
import os
import shutil
import socket

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from kiln.config import KilnConfig, PostConfig, TrainConfig
from training.core.checkpoint import STATE_FILE, TrainState, verify_export
from training.core.data import DataPosition
from training.core.dcp import step_dir
from training.post.pairs import PAIRS, PAIRS_FILE, png

pytestmark = pytest.mark.slow

SIDE = 16
POST = {"judge": "demo_pixel", "seed": 3, "save_every": 2, "grad_clip": 0.5,
        "dpo_steps": 3, "dpo_batch": 5, "dpo_lr": 1e-3, "dpo_beta": 50.0,
        "iterations": 3, "prompts_per_iter": 3, "group_size": 3, "sample_steps": 3, "resolution": SIDE, "lr": 1e-3, "kl": 0.05}  # fmt: skip


class Brightness:
    """A dense reward (mean pixel value): a sample's reward moves smoothly with its pixels, so float-level
    differences between layouts cannot flip a threshold and change a whole group's advantages."""

    name = "brightness"

    def score(self, prompt, images):
        return images.reshape(len(images), -1).mean(1) / 255.0


def brightness_mix():
    from training.evaluation.rewards import RewardMix

    return RewardMix([(Brightness(), 1.0)])


def config(te_dir, tp: int = 1) -> KilnConfig:
    from model.testing import micro_model_config

    return KilnConfig(
        model=micro_model_config(te_dir),
        train=TrainConfig(threads=1, parallel={"tp": tp}),
        post=PostConfig.model_validate(POST),
    )


@pytest.fixture(scope="module")
def start(tmp_path_factory, text_encoder_dir):
    """A checkpoint folder of a micro generator with 4 heads / 2 kv heads (tp=2 divides them), every weight
    perturbed from its zero-closing init so every parameter gets a gradient, and 16x16 preference pairs."""
    from components.demo_scenes import demo_prompts, render
    from model.dit import DiTConfig
    from model.generator import Generator

    root = tmp_path_factory.mktemp("posttrain")
    cfg = config(text_encoder_dir)
    torch.manual_seed(0)
    gen = Generator.build(
        cfg.model,
        DiTConfig(
            width=64, depth=2, heads=4, kv_heads=2, mlp_hidden=128, patch_size=2, in_channels=3, pad_to_multiple=16
        ),
    )
    with torch.no_grad():
        for p in gen.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ckpt = root / "start"
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

    specs = demo_prompts()[:6]
    ims = [np.asarray(render(s.scene, SIDE, SIDE)) for s in specs]
    rows = {f.name: [] for f in PAIRS}
    for i, s in enumerate(specs):
        for k, v in {"pair_id": str(i), "prompt": s.prompt, "source": "on_policy", "winner_png": png(ims[i]), "loser_png": png(ims[(i + 1) % len(specs)]),
                     "winner_reward": 1.0, "loser_reward": 0.0, "winner_rewards": "{}", "loser_rewards": "{}", "seed": 0, "winner_index": 0, "loser_index": 1}.items():  # fmt: skip
            rows[k].append(v)
    (root / "pairs").mkdir()
    pq.write_table(pa.table(rows, schema=PAIRS), root / "pairs" / PAIRS_FILE)
    return ckpt, root / "pairs"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, ports: list[int], ckpt: str, pairs: str, out: str, te_dir: str) -> None:
    """One rank of torchrun-style jobs: the environment names the group, and each run joins and leaves it
    (a job of its own, on a port of its own)."""
    import faulthandler

    from training.post.dpo import dpo
    from training.post.grpo import grpo

    faulthandler.dump_traceback_later(240, exit=True)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    runs = [lambda: dpo(ckpt, pairs, f"{out}/dpo_dp2", config(te_dir)),
            lambda: dpo(ckpt, pairs, f"{out}/dpo_tp2", config(te_dir, tp=2)),
            lambda: grpo(ckpt, f"{out}/grpo_dp2", config(te_dir), stop_at=2, mix=brightness_mix()),  # "killed" after the checkpoint at iteration 2
            lambda: grpo(ckpt, f"{out}/grpo_dp2", config(te_dir), resume=True, mix=brightness_mix())]  # fmt: skip
    for port, run in zip(ports, runs, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        run()


def weights(folder):
    return load_file(str(folder / "model.safetensors"))


def history(folder, kind):
    return [json.loads(line) for line in (folder / f"{kind}_history.jsonl").read_text().splitlines()]


@pytest.mark.distributed
def test_two_ranks_train_dpo_and_grpo_to_the_weights_of_one_process(start, tmp_path, text_encoder_dir):
    from training.post.dpo import dpo
    from training.post.grpo import grpo

    ckpt, pairs = start
    one = {
        "dpo": dpo(ckpt, pairs, tmp_path / "dpo_one", config(text_encoder_dir)),
        "grpo": grpo(ckpt, tmp_path / "grpo_one", config(text_encoder_dir), mix=brightness_mix()),
    }
    torch.multiprocessing.spawn(
        _rank,
        args=(2, [_free_port() for _ in range(4)], str(ckpt), str(pairs), str(tmp_path), str(text_encoder_dir)),
        nprocs=2,
        join=True,
    )

    initial = weights(ckpt)
    for name, kind in (("dpo_dp2", "dpo"), ("dpo_tp2", "dpo"), ("grpo_dp2", "grpo")):
        ref, got = weights(one[kind]), weights(tmp_path / name)
        assert sorted(got) == sorted(ref), name
        moved = max(float((ref[k] - initial[k]).abs().max()) for k in ref)
        assert moved > 1e-3, f"{name}: the weights did not train, the comparison would be empty"
        # fp32 sums in another order give ~1e-7 in a loss; Adam's normalised steps turn that into ~1e-5 on
        # weights whose gradient is near zero; a wrong share of the batch or a missed reduction is > 1e-2
        diffs = {k: float((got[k] - ref[k]).abs().max()) for k in ref}
        assert max(diffs.values()) < 2e-4, (
            f"{name}: differs from one process by {max(diffs.values())} ({sorted(diffs, key=diffs.get)[-3:]})"
        )
        steps = history(tmp_path / name, kind)
        assert len(steps) == len(history(one[kind], kind)) == 3  # the resumed GRPO run has each iteration once
        for a, b in zip(steps, history(one[kind], kind), strict=True):  # the logged terms are global means
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6), name
            assert a.get("reward", 0.0) == pytest.approx(b.get("reward", 0.0), rel=1e-5), name
            assert a.get("winner_loglik", 0.0) == pytest.approx(b.get("winner_loglik", 0.0), rel=1e-3, abs=1e-7), name
        assert verify_export(tmp_path / name)  # the export is the single-process folder, with its checksums
        assert json.loads((tmp_path / name / f"{kind}.json").read_text())["parallel"] == {
            "world_size": 2,
            "tp": 2 if name.endswith("tp2") else 1,
        }


def test_a_run_killed_between_checkpoints_resumes_from_the_last_one_and_logs_each_step_once(
    start, tmp_path, text_encoder_dir
):
    """Steps logged after the last checkpoint are done again by the resumed run: their lines are replaced, not repeated."""
    from training.post.dpo import dpo

    ckpt, pairs = start
    cfg = config(text_encoder_dir).model_copy(update={"post": PostConfig.model_validate({**POST, "dpo_steps": 4})})
    straight = dpo(ckpt, pairs, tmp_path / "straight", cfg)
    dpo(ckpt, pairs, tmp_path / "killed", cfg, stop_at=3)  # checkpoints at steps 2 and 3
    shutil.rmtree(step_dir(tmp_path / "killed", 3))  # killed after logging step 3, before its checkpoint was written
    resumed = dpo(ckpt, pairs, tmp_path / "killed", cfg, resume=True)
    assert [h["step"] for h in history(resumed, "dpo")] == [1, 2, 3, 4]
    assert history(resumed, "dpo") == history(straight, "dpo")
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
