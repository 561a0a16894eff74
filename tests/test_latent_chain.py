"""The latent path end to end, as `kiln run model=latent_tiny` wires it (conf/model/latent_tiny.yaml): the micro
DiT in the latent space of a tiny random AutoencoderKL trains through the ladder's Dagster assets (pretrain,
SFT), is averaged (PMA), sampled and evaluated, then takes DPO, GRPO and TDM steps; every checkpoint is a
latent model and every image it shows comes through the VAE's decoder."""

from __future__ import annotations

import json

import dagster as dg
import pytest
from safetensors.torch import load_file

from dagster_project.assets import profile_assets
from dagster_project.resources import KilnResource
from model.generator import Generator
from training.testing import scene_rows, write_pack_output

pytestmark = [pytest.mark.slow, pytest.mark.integration]

SHRINK = [
    "model.text_encoder.layers=[-1,-2,-3]", "train.resolution=16", "train.threads=1", "train.log_every=0",
    "train.steps=3", "train.warmup_steps=1", "train.batch_size=4", "train.holdout=4", "train.dcp.every=1",
    "train.repa.teacher_path=null", "train.sample.steps=2", "train.sample.n_per_prompt=1", "train.eval.steps=2",
    "train.eval.n_per_prompt=1", "metrics.n_per_prompt=1", "ladder.domains=[]",
    "post.pair_prompts=8", "post.pair_k=4", "post.pair_margin=0.0", "post.dpo_steps=1", "post.dpo_batch=4",
    "post.iterations=1", "post.prompts_per_iter=2", "post.group_size=3", "post.sample_steps=2", "post.save_every=1",
    "post.distill.iterations=1", "post.distill.batch=2", "post.distill.save_every=1", "post.distill.student_steps=2",
]  # fmt: skip
CHAIN = ["checkpoint_pretrain", "checkpoint_sft", "checkpoint", "samples", "evaluation", "preference_pairs",
         "reward_model", "checkpoint_dpo", "checkpoint_grpo", "checkpoint_student"]  # fmt: skip


def test_the_latent_profile_trains_averages_evaluates_and_post_trains_in_latent_space(
    tmp_path, monkeypatch, latent_tiny
):
    monkeypatch.chdir(tmp_path)  # the evaluation's history (metrics.history) is relative to where kiln runs
    overrides = [*latent_tiny, *SHRINK]
    data = tmp_path / "data"
    for rung in ("pretrain", "sft"):  # the pack stage's output for each rung, images only: the trainer encodes
        write_pack_output(data / f"train_set_{rung}", scene_rows(24, seed=3, buckets=((16, 16),), batch_size=4))

    result = dg.materialize(
        profile_assets(overrides, CHAIN),
        resources={"kiln": KilnResource(overrides=overrides, data_dir=str(data))},
        instance=dg.DagsterInstance.ephemeral(),
    )
    assert result.success
    for key in (
        "checkpoint_pretrain",
        "checkpoint_sft",
        "checkpoint",
        "checkpoint_dpo",
        "checkpoint_grpo",
        "checkpoint_student",
    ):
        gen = Generator.from_pretrained(data / key)
        assert gen.cfg.autoencoder == "kl" and gen.autoencoder.downsample == 2, key  # a latent model throughout
        assert (
            gen.dit_cfg.in_channels == 4
            and gen.autoencoder.identity()
            == Generator.from_pretrained(data / "checkpoint_pretrain").autoencoder.identity()
        ), key
    assert json.loads((data / "checkpoint" / "pma.json").read_text())["k"] >= 2  # PMA over the SFT rung's steps
    assert json.loads((data / "eval" / "metrics.json").read_text())
    assert any(load_file(str(data / "checkpoint_dpo" / "model.safetensors")))
