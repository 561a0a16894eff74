"""Self-supervised style training (training/style/train.py) from a tiny checkpoint without a reference
pathway, its DCP kill-and-resume, the demo's style pairs and the transfer / leakage metrics."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from components.demo_scenes import Background, Scene, Shape, render
from kiln.config import KilnConfig, StyleConfig
from model.generator import Generator
from training.style.data import (
    content_prompt,
    family_member,
    style_cases,
    style_pair,
    style_scores,
)
from training.style.evaluate import evaluate_style
from training.style.train import style_train
from training.testing import trained_micro_model

STYLE = {
    "steps": 4,
    "batch_size": 4,
    "save_every": 2,
    "lr": 1e-3,
    "eval_cases": 4,
    "eval_steps": 2,
    "eval_strengths": [0.0, 0.5, 1.0],
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return trained_micro_model(tmp_path_factory.mktemp("style"), 16, seed=3, steps=10)


def with_style(cfg: KilnConfig, **style) -> KilnConfig:
    return cfg.model_copy(update={"style": StyleConfig.model_validate({**STYLE, **style})})


def weights(folder):
    return load_file(str(folder / "model.safetensors"))


# ------------------------------------------------------------------------------------------ the pairs
def test_a_family_reference_keeps_background_and_palette_and_changes_the_shape():
    rng = np.random.default_rng(0)
    scene = Scene("single_shape", Background("blue"), (Shape("red", "circle", "large", "left"),))
    other = family_member(scene, rng)
    assert other.background == scene.background and other.shapes[0].color == "red"
    assert other.shapes[0].shape != "circle" and other.shapes[0].position != "left"
    assert content_prompt(scene) == "a large red circle on the left"


def test_pairs_are_a_pure_function_of_the_seed_and_crops_come_from_the_target():
    a = style_pair(np.random.default_rng(5), 32, 32, "crop", 0.5)
    b = style_pair(np.random.default_rng(5), 32, 32, "crop", 0.5)
    assert np.array_equal(a.reference, b.reference) and a.prompt == b.prompt
    h, w = a.reference.shape[:2]
    assert 16 <= h == w <= 32
    windows = np.lib.stride_tricks.sliding_window_view(a.target, (h, w, 3)).reshape(-1, h, w, 3)
    assert any(np.array_equal(win, a.reference) for win in windows)
    assert "background" not in a.prompt
    with pytest.raises(ValueError, match="family or crop"):
        style_pair(np.random.default_rng(5), 32, 32, "view", 0.5)


def test_transfer_and_leakage_read_background_and_shape_of_crafted_images():
    """The ideal output (the prompt's shape on the reference's background) transfers without leaking; a
    copy of the reference transfers and leaks; the prompt's shape on another background does neither."""
    cases = style_cases(6, seed=0, height=32, width=32)
    ideal = [
        render(
            Scene("single_shape", Background(c.reference_background), (Shape(c.color, c.shape, "large", c.position),)),
            32,
            32,
        )
        for c in cases
    ]
    assert style_scores(np.stack(ideal), cases) == {"transfer": 1.0, "leakage": 0.0, "content": 1.0, "color": 1.0}
    copies = style_scores(np.stack([c.reference for c in cases]), cases)
    assert copies["transfer"] == 1.0 and copies["leakage"] == 1.0 and copies["content"] == 0.0
    elsewhere = ["white" if c.reference_background != "white" and c.color != "white" else "black" for c in cases]
    other = [
        render(Scene("single_shape", Background(bg), (Shape(c.color, c.shape, "large", c.position),)), 32, 32)
        for c, bg in zip(cases, elsewhere, strict=True)
    ]
    assert style_scores(np.stack(other), cases)["transfer"] == 0.0


# ---------------------------------------------------------------------------------------- the trainer
@pytest.mark.slow
def test_style_training_adds_the_pathway_and_trains_it(base, tmp_path):
    ckpt, cfg = base
    out = style_train(ckpt, tmp_path / "style", with_style(cfg))
    history = [json.loads(line) for line in (out / "style_history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3, 4] and all(np.isfinite(h["loss"]) for h in history)
    before, after, start = weights(ckpt), weights(out), weights(out / "start")
    assert {k for k in after if k.startswith("reference.")} and not {k for k in before if k.startswith("reference.")}
    assert any(not torch.equal(start[k], after[k]) for k in after if k.startswith("reference."))
    assert all(torch.equal(before[k], start[k]) for k in before)  # the start is the checkpoint plus the new pathway
    gen = Generator.from_pretrained(out)
    assert gen.cfg.reference.enabled
    report = evaluate_style(gen, with_style(cfg), 32, 32)
    assert [r["strength"] for r in report["per_strength"]] == [0.0, 0.5, 1.0]
    assert all(0.0 <= r["transfer"] <= 1.0 and 0.0 <= r["leakage"] <= 1.0 for r in report["per_strength"])
    assert (out / "train_state.json").exists() and json.loads((out / "style.json").read_text())["steps"] == 4


@pytest.mark.slow
def test_a_killed_style_run_resumes_to_the_weights_of_an_uninterrupted_one(base, tmp_path):
    ckpt, cfg = base
    straight = style_train(ckpt, tmp_path / "straight", with_style(cfg))
    style_train(ckpt, tmp_path / "resumed", with_style(cfg), stop_at=2)  # "killed" after the checkpoint at step 2
    resumed = style_train(ckpt, tmp_path / "resumed", with_style(cfg), resume=True)
    a, b = weights(straight), weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [json.loads(line)["step"] for line in (resumed / "style_history.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


@pytest.mark.slow
def test_crop_references_train_too(base, tmp_path):
    ckpt, cfg = base
    out = style_train(ckpt, tmp_path / "crop", with_style(cfg, reference="crop", steps=2))
    assert [json.loads(line)["step"] for line in (out / "style_history.jsonl").read_text().splitlines()] == [1, 2]
