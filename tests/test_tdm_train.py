"""TDM distillation on a tiny checkpoint: a student with its own sampler settings, a history per iteration,
DCP checkpoints holding student and fake score, and a killed run that resumes to the same weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from kiln.cli import main as kiln_main
from kiln.config import KilnConfig, PostConfig
from training.evaluation.sampling import read_sampler_settings, sample_to_dir, with_sampler_settings
from training.post.distill import distill
from training.testing import trained_micro_model

pytestmark = [pytest.mark.slow]

DISTILL = {
    "student_steps": 3,
    "iterations": 4,
    "batch": 3,
    "fake_updates": 2,
    "save_every": 2,
    "lr": 1e-3,
    "fake_lr": 1e-3,
    "teacher_cfg": 2.0,
}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return trained_micro_model(
        tmp_path_factory.mktemp("tdm"), 24, seed=3, steps=30
    )  # 30: the output layer has left its zero init


def with_distill(cfg: KilnConfig, **distill_fields) -> KilnConfig:
    return cfg.model_copy(
        update={"post": PostConfig.model_validate({"judge": "demo_pixel", "distill": {**DISTILL, **distill_fields}})}
    )


def weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def test_distill_trains_a_student_that_carries_its_own_sampler_settings(teacher, tmp_path):
    ckpt, cfg = teacher
    out = distill(ckpt, tmp_path / "student", with_distill(cfg))
    history = [json.loads(line) for line in (out / "tdm_history.jsonl").read_text().splitlines()]
    assert [h["iteration"] for h in history] == [1, 2, 3, 4]
    assert all(
        h["fake_loss"] > 0 and h["student_grad_norm"] > 0 and h["fake_grad_norm"] > 0 and h["importance_weight"] > 0
        for h in history
    )
    before, after = weights(ckpt), weights(out)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the student moved; the teacher file did not
    own = read_sampler_settings(out)
    assert own.steps == 3 and own.cfg_scale == 1.0 and own.shift > 0
    assert json.loads((out / "sampler.json").read_text())["teacher_cfg"] == 2.0
    assert (out / "train_state.json").exists() and json.loads((out / "tdm.json").read_text())["iterations"] == 4
    # the sampler and the evaluation read the student's settings instead of train.sample / train.eval
    assert (
        with_sampler_settings(cfg, own).train.eval.steps == 3
        and with_sampler_settings(cfg, own).train.sample.cfg_scale == 1.0
    )
    assert (sample_to_dir(out, tmp_path / "samples", cfg)).exists()
    # the sampler settings are under the export's checksums: an edited sampler.json is caught before use
    from training.core.checkpoint import verify_export
    from training.core.manifest import CheckpointCorrupt

    (out / "sampler.json").write_text((out / "sampler.json").read_text().replace('"steps": 3', '"steps": 30'))
    with pytest.raises(CheckpointCorrupt, match="sampler.json"):
        verify_export(out)


def test_a_killed_distillation_resumes_to_the_weights_of_an_uninterrupted_one(teacher, tmp_path):
    ckpt, cfg = teacher
    straight = distill(ckpt, tmp_path / "straight", with_distill(cfg))
    distill(ckpt, tmp_path / "resumed", with_distill(cfg), stop_at=2)  # "killed" after the checkpoint at iteration 2
    with (tmp_path / "resumed" / "tdm_history.jsonl").open("a") as f:  # and after logging an iteration it never saved
        f.write(json.dumps({"iteration": 3, "lost": True}) + "\n")
    resumed = distill(ckpt, tmp_path / "resumed", with_distill(cfg), resume=True)
    a, b = weights(straight), weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lines = [json.loads(line) for line in (resumed / "tdm_history.jsonl").read_text().splitlines()]
    assert [h["iteration"] for h in lines] == [1, 2, 3, 4] and not any("lost" in h for h in lines)
    # the fake score and both optimisers came back too: the resumed iterations log what the straight run logged
    straight_lines = [json.loads(line) for line in (straight / "tdm_history.jsonl").read_text().splitlines()]
    for key in ("fake_loss", "student_loss", "teacher_gap"):
        assert [h[key] for h in lines] == [h[key] for h in straight_lines]


def test_kiln_distill_runs_from_the_command_line_and_refuses_to_replace_an_earlier_run(teacher, tmp_path, capsys):
    ckpt, _ = teacher
    out = tmp_path / "cli"
    args = [
        "distill",
        "--checkpoint",
        str(ckpt),
        "--out",
        str(out),
        "post.distill.iterations=1",
        "post.distill.batch=2",
        "post.distill.student_steps=2",
    ]
    assert kiln_main(args) == 0
    assert read_sampler_settings(out).steps == 2 and read_sampler_settings(out).cfg_scale == 1.0
    before = weights(out)
    assert kiln_main(args) == 2  # a fresh run into the folder would replace its checkpoints: refused, nothing touched
    assert "--resume" in capsys.readouterr().err
    assert all(torch.equal(before[k], weights(out)[k]) for k in before)
    assert kiln_main([*args, "--resume"]) == 0  # already at its last iteration: exported again, unchanged
    assert all(torch.equal(before[k], weights(out)[k]) for k in before)


def test_post_distill_weight_decay_reaches_the_students_optimiser(teacher, tmp_path):
    """The shared runner's AdamW takes TDM's weight decay (DPO and GRPO keep 0): one iteration at a large
    decay pulls the student's weights towards zero, beyond what the same iteration without decay does."""
    ckpt, cfg = teacher
    plain = weights(distill(ckpt, tmp_path / "plain", with_distill(cfg, iterations=1, weight_decay=0.0)))
    decayed = weights(distill(ckpt, tmp_path / "decayed", with_distill(cfg, iterations=1, weight_decay=10.0)))
    # AdamW's decoupled decay multiplies every weight by 1 - lr * weight_decay = 0.99 before its step
    norm = lambda w: sum(float(v.float().pow(2).sum()) for v in w.values())
    assert norm(decayed) < 0.995 * norm(plain)
