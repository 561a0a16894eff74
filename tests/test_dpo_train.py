"""Preference pairs and Diffusion-DPO on a tiny checkpoint: pairs keep the best and worst sample when their
reward gap is large enough, DPO logs both likelihood terms every step, starts at the reference, moves the
weights, resumes exactly, and calibration refuses a pairs table without human labels."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from kiln.config import KilnConfig, PostConfig
from training.post.dpo import dpo
from training.post.pairs import PAIRS, PAIRS_FILE, make_pairs, pick_pair, png, read_pairs
from training.testing import trained_micro_model

POST = {
    "judge": "demo_pixel",
    "pair_prompts": 6,
    "pair_k": 3,
    "pair_margin": 0.0,
    "dpo_steps": 4,
    "dpo_batch": 4,
    "dpo_lr": 1e-3,
    "dpo_beta": 50.0,
    "save_every": 2,
}


def test_a_pair_is_the_best_and_worst_sample_when_their_gap_passes_the_margin():
    assert pick_pair(np.array([0.2, 0.9, 0.1, 0.5]), margin=0.5) == (1, 2)
    assert pick_pair(np.array([0.2, 0.9, 0.1, 0.5]), margin=0.9) is None
    assert pick_pair(np.array([np.nan, 0.4, 0.4]), margin=0.0) is None  # no distinct winner and loser
    assert pick_pair(np.array([np.nan, 0.7, 0.3]), margin=0.1) == (1, 2)


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    return trained_micro_model(tmp_path_factory.mktemp("dpo"), 24, seed=4, steps=6)


def with_post(cfg: KilnConfig, **post) -> KilnConfig:
    return cfg.model_copy(update={"post": PostConfig.model_validate({**POST, **post})})


def demo_pairs(folder, size: int = 32):
    """Pairs a judge would make on the demo: the renderer's own drawing of a prompt beats another prompt's."""
    from components.demo_scenes import demo_prompts, render

    specs = demo_prompts()
    ims = [np.asarray(render(s.scene, size, size)) for s in specs]
    n = len(specs)
    rows = {f.name: [] for f in PAIRS}
    for i, s in enumerate(specs):
        row = {
            "pair_id": str(i),
            "prompt": s.prompt,
            "source": "on_policy",
            "winner_png": png(ims[i]),
            "loser_png": png(ims[(i + 1) % n]),
        }
        row |= {
            "winner_reward": 1.0,
            "loser_reward": 0.2,
            "winner_rewards": "{}",
            "loser_rewards": "{}",
            "seed": 0,
            "winner_index": i,
            "loser_index": -1,
        }
        for k, v in row.items():
            rows[k].append(v)
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(rows, schema=PAIRS), folder / PAIRS_FILE)
    return folder


@pytest.mark.slow
def test_on_policy_pairs_record_both_images_their_rewards_and_seeds(sft, tmp_path):
    ckpt, cfg = sft
    report = make_pairs(ckpt, tmp_path / "pairs", with_post(cfg))
    table = read_pairs(tmp_path / "pairs")
    assert report["prompts"] == 6 and report["pairs"] == table.num_rows <= 6
    for row in table.to_pylist():
        assert row["winner_reward"] - row["loser_reward"] >= 0.0 and row["winner_index"] != row["loser_index"]
        assert set(json.loads(row["winner_rewards"])) == {"rubric"} and row["source"] == "on_policy"


@pytest.mark.slow
def test_dpo_logs_both_likelihood_terms_from_the_reference_and_moves_the_weights(sft, tmp_path):
    ckpt, cfg = sft
    out = dpo(ckpt, demo_pairs(tmp_path / "pairs"), tmp_path / "dpo", with_post(cfg))
    history = [json.loads(x) for x in (out / "dpo_history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert (
        history[0]["winner_loglik"] == 0.0 and history[0]["loser_loglik"] == 0.0
    )  # the policy starts as the reference
    assert history[0]["loss"] == pytest.approx(np.log(2), rel=1e-6)
    assert any(h["winner_loglik"] != 0.0 for h in history[1:])
    before, after = load_file(str(ckpt / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_a_killed_dpo_run_resumes_to_the_same_weights(sft, tmp_path):
    ckpt, cfg = sft
    pairs = demo_pairs(tmp_path / "pairs")
    straight = dpo(ckpt, pairs, tmp_path / "a", with_post(cfg))
    dpo(ckpt, pairs, tmp_path / "b", with_post(cfg), stop_at=2)
    resumed = dpo(ckpt, pairs, tmp_path / "b", with_post(cfg), resume=True)
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [json.loads(x)["step"] for x in (resumed / "dpo_history.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_calibration_trains_on_human_labels_only_and_refuses_a_table_without_them(sft, tmp_path):
    ckpt, cfg = sft
    with pytest.raises(ValueError, match="no human pairs"):
        dpo(ckpt, demo_pairs(tmp_path / "pairs"), tmp_path / "cal", with_post(cfg), source="human")
