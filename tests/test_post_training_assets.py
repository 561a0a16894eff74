"""Post-training as Dagster assets on a tiny checkpoint: preference pairs -> reward model, DPO, then GRPO from
the DPO checkpoint, then the TDM student, each page leading with its evaluation before and after and sample grids."""

from __future__ import annotations

import dagster as dg
import pytest

from dagster_project.resources import KilnResource
from model.testing import write_tiny_text_encoder
from training.core.trainer import train
from training.testing import scene_rows, tiny_config, write_pack_output

pytestmark = [pytest.mark.slow, pytest.mark.integration]

SMALL = [
    "post.pair_prompts=8", "post.pair_k=4", "post.pair_margin=0.0", "post.dpo_steps=3", "post.dpo_batch=4",
    "post.iterations=2", "post.prompts_per_iter=2", "post.group_size=3", "post.sample_steps=3", "post.save_every=2",
    "train.eval.n_per_prompt=1", "train.eval.steps=3", "train.sample.steps=3", "ladder.domains=[]",  # from `checkpoint`, no domain merge
    "post.distill.iterations=2", "post.distill.batch=2", "post.distill.save_every=2", "post.distill.student_steps=2",
]  # fmt: skip


def test_the_post_training_assets_materialize_in_order_with_their_comparisons(tmp_path):
    te = write_tiny_text_encoder(tmp_path / "text_encoder")
    data = tmp_path / "data"
    train(
        write_pack_output(data / "train_set_pretrain", scene_rows(24, seed=5)),
        data / "checkpoint",
        tiny_config(te, steps=6),
    )
    from dagster_project.assets import profile_assets

    post_assets = profile_assets(
        SMALL, ["preference_pairs", "reward_model", "checkpoint_dpo", "checkpoint_grpo", "checkpoint_student"]
    )
    result = dg.materialize(
        post_assets,
        resources={"kiln": KilnResource(overrides=SMALL, data_dir=str(data))},
        instance=dg.DagsterInstance.ephemeral(),
    )
    assert result.success
    order = [
        e.asset_key.to_user_string() for e in result.get_asset_materialization_events() for e in [e.materialization]
    ]
    assert sorted(order) == sorted(
        ["preference_pairs", "reward_model", "checkpoint_dpo", "checkpoint_grpo", "checkpoint_student"]
    )
    assert order[0] == "preference_pairs" and order.index("checkpoint_dpo") < order.index(
        "checkpoint_grpo"
    ) < order.index("checkpoint_student")
    for key in ("checkpoint_dpo", "checkpoint_grpo"):
        md = result.asset_materializations_for_node(key)[0].metadata
        assert (
            0.0 <= md["prompt_following_after.all"].value <= 1.0 and "data:image/png;base64," in md["samples"].value
        )  # the "after" grid
        assert (
            "prompt_following_gain.all" in md
            and md["heldout_loss_after"].value > 0
            and md["nfe_per_image_after"].value == 3 * 2
        )  # 3 steps, CFG
        assert "skipped" in md["distribution_metrics"].value  # no extractor set: said, not silently dropped
        assert all(
            0.0 <= md[f"reward_mean_{when}.{r}"].value <= 1.0 for when in ("before", "after") for r in ("mix", "rubric")
        )  # the reward mix on the evaluation's images
        assert "data:image/png;base64," in md["samples_before"].value  # and the "before" grid
    student = result.asset_materializations_for_node("checkpoint_student")[0].metadata
    assert (
        student["nfe_per_image_after"].value == 2 and student["nfe_per_image_teacher_2_steps"].value == 2 * 2
    )  # no CFG; the naive teacher keeps CFG
    assert "prompt_following_teacher_2_steps.all" in student and "speedup_vs_teacher" in student
    assert (data / "checkpoint_grpo" / "model.safetensors").exists() and (
        data / "reward_model" / "weights.npy"
    ).exists()
