"""Expander RL (training/expander/rewards.py, training/expander/rl.py): GDPO's per-reward normalisation,
faithfulness on crafted expansions, the safety gate, diversity, and a killed run that resumes exactly."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from kiln.config import load_config
from training.evaluation.rubric import RubricPrompt
from training.expander.model import load_lm
from training.expander.rewards import (
    DemoGrammarExtractor,
    LLMAttributeExtractor,
    diversity,
    diversity_of_faithful,
    faithfulness,
    gate,
    gdpo_advantages,
)
from training.expander.rl import ShortPrompt, train_rl
from training.expander.sft import train_sft
from training.testing import EXPANDER_PAIRS


def test_gdpo_normalises_each_reward_in_its_group_then_sums_and_standardises_the_batch():
    faith = torch.tensor([[1.0, 0.5, 0.5, 0.0], [1.0, 1.0, 1.0, 1.0]])
    image = torch.tensor([[0.0, 10.0, 20.0, 30.0], [2.0, 4.0, float("nan"), 6.0]])
    got = gdpo_advantages(
        {"faithfulness": faith, "image": image},
        {"faithfulness": 1.0, "image": 0.5},
        eps=0.0,
    )

    def z(
        row,
    ):  # by hand: the population std of the finite entries; NaN and constant groups give 0
        vals = [v for v in row if not math.isnan(v)]
        m = sum(vals) / len(vals)
        s = (sum((v - m) ** 2 for v in vals) / len(vals)) ** 0.5
        return [0.0 if math.isnan(v) or s == 0 else (v - m) / s for v in row]

    total = [[1.0 * a + 0.5 * b for a, b in zip(z(f), z(i))] for f, i in zip(faith.tolist(), image.tolist())]
    flat = [v for row in total for v in row]
    m = sum(flat) / len(flat)
    s = (sum((v - m) ** 2 for v in flat) / len(flat)) ** 0.5
    want = torch.tensor([[(v - m) / s for v in row] for row in total])
    assert torch.allclose(got, want, atol=1e-6)
    # GRPO on the raw sum would let the image reward's scale decide: not what GDPO does
    raw = faith + 0.5 * torch.nan_to_num(image)
    assert not torch.allclose(
        got,
        (raw - raw.mean(1, keepdim=True)) / raw.std(1, unbiased=False, keepdim=True),
        atol=1e-3,
    )


def test_faithfulness_counts_the_short_prompts_attributes_that_survive():
    short = "red circle left, blue background"
    expansions = [
        "a large red circle on the left, on a blue background",  # all kept, details added
        "a large red circle on the right, on a blue background",  # position overridden
        "a large red circle on the left",  # background dropped
        "a large blue circle on the left, on a red background",  # colours swapped
        "",  # nothing
    ]
    assert faithfulness(DemoGrammarExtractor(), short, expansions).tolist() == [
        1.0,
        0.75,
        0.75,
        0.5,
        0.0,
    ]
    counted = faithfulness(
        DemoGrammarExtractor(),
        "can you make me two pink diamonds?",
        ["two small pink diamonds at the top", "a small pink diamond at the top"],
    )
    assert counted.tolist() == [1.0, 2 / 3]
    sign = faithfulness(
        DemoGrammarExtractor(),
        'Draw a red sign with the word "SALE".',
        [
            'a red sign with the word "SALE", on a grey background',
            'a red sign with the word "STOP"',
        ],
    )
    assert sign.tolist() == [1.0, 0.5]


def test_the_safety_gate_zeroes_every_reward_of_a_blocked_expansion():
    rewards = {
        "faithfulness": np.array([1.0, 0.9, 0.8]),
        "image": np.array([0.5, 0.7, 0.2]),
    }
    out, mask = gate(
        rewards,
        ["a red circle", "a GORY red circle", "a red circle, gore"],
        ["gore", "gory"],
    )
    assert mask.tolist() == [False, True, True]
    assert out["faithfulness"].tolist() == [1.0, 0.0, 0.0] and out["image"].tolist() == [0.5, 0.0, 0.0]
    assert gate(rewards, ["gorgeous red circle"], ["gore"])[1].tolist() == [False]  # whole words only


def test_diversity_is_each_images_mean_cosine_distance_to_its_group():
    same = np.ones((3, 4))
    assert np.allclose(diversity(same), 0.0)
    spread = np.eye(3)
    assert np.allclose(diversity(spread), 1.0)
    assert np.allclose(diversity(np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])), [0.5, 0.5, 1.0])


def test_rl_pays_diversity_only_to_expansions_that_keep_every_attribute():
    """Overriding the prompt's background spreads a group's images most; that spread must earn nothing."""
    extractor = DemoGrammarExtractor()
    short = "red square, black background"
    texts = [
        "a large red square at the top, on a black background",
        "a small red square on the left, on a black background",
        "a large red square at the top and a green circle at the bottom, on a white background",
    ]
    rewards = {"faithfulness": faithfulness(extractor, short, texts), "diversity": np.array([0.2, 0.3, 0.9])}
    out = diversity_of_faithful(rewards)
    assert out["diversity"].tolist() == [0.2, 0.3, 0.0]
    assert out["faithfulness"] is rewards["faithfulness"]  # the other rewards are untouched
    # GDPO then ranks the overriding expansion last on diversity too, where it ranked first before
    adv = gdpo_advantages({k: torch.tensor(v[None]) for k, v in out.items()}, {"faithfulness": 1.0, "diversity": 1.0})
    assert adv[0, 2] == adv.min()
    assert diversity_of_faithful({"faithfulness": np.ones(2)}).keys() == {"faithfulness"}  # no DiT: no diversity


def test_an_llm_extractor_by_path_lists_attributes_and_checks_their_words(tmp_path):
    from training.expander.model import build_tiny_lm, build_word_tokenizer

    tok = build_word_tokenizer(["List every visual attribute red circle blue background"], tmp_path)
    cfg = load_config(["expander.tiny_hidden=16", "expander.tiny_heads=2", "expander.tiny_layers=1"]).expander
    build_tiny_lm(cfg, len(tok), tmp_path, 64)
    ex = LLMAttributeExtractor(str(tmp_path), max_new_tokens=8)
    attrs = ex.attributes("red circle, blue background")  # a random LM lists noise; the plumbing is what is tested
    assert all(isinstance(a, str) and a for a in attrs)
    assert ex.survives("large red circle", "a large red circle on the left") and not ex.survives(
        "blue circle", "a red circle"
    )
    assert 0.0 <= faithfulness(ex, "red circle", ["a red circle"])[0] <= 1.0


def test_an_llm_extractor_without_a_path_is_refused_before_any_work(tmp_path):
    cfg = load_config(["expander.extractor=llm"])
    with pytest.raises(
        ValueError,
        match=r"expander\.extractor_path: the attribute extractor's LLM folder is not set",
    ):
        train_rl(tmp_path / "sft", None, tmp_path / "rl", cfg)
    assert not (tmp_path / "rl").exists()


SHORT = [ShortPrompt(p["prompt"], RubricPrompt(p["target"])) for p in EXPANDER_PAIRS]


def test_a_killed_rl_run_resumes_to_the_weights_and_history_of_an_uninterrupted_one(
    tmp_path,
):
    over = {
        "tiny_hidden": 16,
        "tiny_heads": 2,
        "tiny_layers": 1,
        "sft_steps": 4,
        "sft_batch": 2,
        "max_length": 32,
        "max_new_tokens": 8,
    }
    over |= {
        "rl_iterations": 4,
        "rl_prompts": 2,
        "group_size": 3,
        "save_every": 2,
        "rl_lr": 0.01,
    }
    cfg = load_config([f"expander.{k}={v}" for k, v in over.items()])
    sft = train_sft(EXPANDER_PAIRS, tmp_path / "sft", cfg)
    train_rl(sft, None, tmp_path / "full", cfg, prompts=SHORT)  # no DiT: faithfulness only
    assert train_rl(sft, None, tmp_path / "killed", cfg, stop_at=3, prompts=SHORT) is None
    train_rl(sft, None, tmp_path / "killed", cfg, resume=True, prompts=SHORT)
    a, b, s = (
        load_lm(tmp_path / "full")[0],
        load_lm(tmp_path / "killed")[0],
        load_lm(sft)[0],
    )
    assert any(
        not torch.equal(x, y) for x, y in zip(a.state_dict().values(), s.state_dict().values())
    )  # it learnt something
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    read = lambda d: [
        json.loads(x) | {"seconds": 0} for x in (tmp_path / d / "expander_rl_history.jsonl").read_text().splitlines()
    ]
    assert read("killed") == read("full") and [h["step"] for h in read("full")] == [
        1,
        2,
        3,
        4,
    ]
