"""Flow-GRPO on a tiny checkpoint: rollouts scored by the demo rubric, group-relative updates against a
frozen reference, a history per iteration, DCP checkpoints, and a killed run that resumes to the same weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from kiln.config import ConfigError, KilnConfig, PostConfig
from training.post.grpo import grpo
from training.testing import trained_micro_model

pytestmark = [pytest.mark.slow]

POST = {
    "judge": "demo_pixel",
    "iterations": 4,
    "prompts_per_iter": 2,
    "group_size": 3,
    "sample_steps": 4,
    "save_every": 2,
    "lr": 1e-3,
    "kl": 0.05,
}


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    return trained_micro_model(
        tmp_path_factory.mktemp("grpo"), 24, seed=3, steps=30
    )  # 30: the output layer has left its zero init


def with_post(cfg: KilnConfig, **post) -> KilnConfig:
    return cfg.model_copy(update={"post": PostConfig.model_validate({**POST, **post})})


def test_grpo_updates_the_policy_and_records_rewards_per_iteration(sft, tmp_path):
    ckpt, cfg = sft
    out = grpo(ckpt, tmp_path / "rl", with_post(cfg))
    history = [json.loads(line) for line in (out / "grpo_history.jsonl").read_text().splitlines()]
    assert [h["iteration"] for h in history] == [1, 2, 3, 4]
    assert all(0.0 <= h["reward_rubric"] <= 1.0 and h["kl"] >= 0.0 and h["grad_norm"] >= 0 for h in history)
    assert any(h["grad_norm"] > 0 for h in history)  # a group whose rewards all tie has no advantage, so no gradient
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-9)  # the first update starts at the reference
    before, after = load_file(str(ckpt / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert (out / "train_state.json").exists() and json.loads((out / "grpo.json").read_text())["iterations"] == 4


def test_a_killed_grpo_run_resumes_to_the_weights_of_an_uninterrupted_one(sft, tmp_path):
    ckpt, cfg = sft
    straight = grpo(ckpt, tmp_path / "straight", with_post(cfg))
    grpo(ckpt, tmp_path / "resumed", with_post(cfg), stop_at=2)  # "killed" after the checkpoint at iteration 2
    resumed = grpo(ckpt, tmp_path / "resumed", with_post(cfg), resume=True)
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    iterations = [json.loads(line)["iteration"] for line in (resumed / "grpo_history.jsonl").read_text().splitlines()]
    assert iterations == [1, 2, 3, 4]


def test_a_real_profile_without_a_judge_fails_before_any_work(sft, tmp_path):
    ckpt, cfg = sft
    with pytest.raises(ConfigError, match="post.judge_vlm_path"):
        grpo(ckpt, tmp_path / "rl", with_post(cfg, judge="vlm"))
    assert not (tmp_path / "rl").exists()


class Brightness:
    """A dense reward the policy can always move: the mean pixel value."""

    name = "brightness"

    def score(self, prompt, images):
        return images.reshape(len(images), -1).mean(1) / 255.0


def test_grpo_climbs_a_reward_it_can_move(sft, tmp_path):
    """The policy gradient's sign and scale: eight iterations raise the mean brightness of the samples."""
    from training.evaluation.rewards import RewardMix

    ckpt, cfg = sft
    post = {
        "iterations": 8,
        "prompts_per_iter": 4,
        "group_size": 8,
        "sample_steps": 8,
        "lr": 1e-3,
        "kl": 0.0,
        "save_every": 100,
    }
    out = grpo(ckpt, tmp_path / "rl", with_post(cfg, **post), mix=RewardMix([(Brightness(), 1.0)]))
    rewards = [json.loads(line)["reward"] for line in (out / "grpo_history.jsonl").read_text().splitlines()]
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.1, rewards
