"""The expander's Dagster assets: user_prompts (a lineage step) -> expander_sft -> expander_rl in the `expander`
job, each page leading with faithfulness, prompt following short vs expanded, and diversity."""

from __future__ import annotations

import dagster as dg
import pytest

from dagster_project.resources import KilnResource
from kiln.schemas import PROMPT_PAIRS
from kiln.stage import run_stage, write_shards
from model.testing import write_tiny_text_encoder
from training.core.trainer import train
from training.testing import scene_rows, tiny_config, write_pack_output

SMALL = [
    "expander.tiny_hidden=16", "expander.tiny_heads=2", "expander.tiny_layers=1", "expander.sft_steps=8", "expander.sft_batch=4",
    "expander.max_new_tokens=12", "expander.rl_iterations=2", "expander.rl_prompts=2", "expander.group_size=2", "expander.image_steps=2",
    "expander.save_every=4",
]  # fmt: skip


def test_the_expander_assets_and_job_are_in_the_definitions():
    from dagster_project.definitions import defs

    graph = defs.resolve_asset_graph()
    parents = {
        k: {p.to_user_string() for p in graph.get(dg.AssetKey(k)).parent_keys}
        for k in ("user_prompts", "expander_sft", "expander_rl")
    }
    assert parents == {
        "user_prompts": {"prompt_pairs"},
        "expander_sft": {"user_prompts", "checkpoint"},
        "expander_rl": {"expander_sft", "checkpoint"},
    }
    job = defs.resolve_job_def("expander")
    assert {k.to_user_string() for k in job.asset_layer.executable_asset_keys} == {
        "user_prompts",
        "expander_sft",
        "expander_rl",
    }


@pytest.mark.slow
def test_the_expander_assets_materialize_with_their_evaluation(tmp_path, assets_of_nodes):
    import pyarrow as pa

    data = tmp_path / "data"
    te = write_tiny_text_encoder(tmp_path / "text_encoder")
    train(
        write_pack_output(tmp_path / "pack", scene_rows(16, seed=5)),
        data / "checkpoint",
        tiny_config(te, steps=2),
    )
    import numpy as np

    from components.demo_scenes import caption_for, sample_scene
    from components.rule_text import make_prompt

    rng = np.random.default_rng(0)
    captions = [caption_for(sample_scene(rng, "single_shape")) for _ in range(12)]
    rows = [(f"r{i}", *make_prompt(c, f"r{i}", 0.5), c) for i, c in enumerate(captions)]
    table = pa.table(
        {
            "id": [r[0] for r in rows],
            "prompt": [r[1] for r in rows],
            "target": [r[3] for r in rows],
            "dropped": [str(r[2]).replace("'", '"') for r in rows],
        },
        schema=PROMPT_PAIRS,
    )
    write_shards([table], tmp_path / "pairs", PROMPT_PAIRS)
    cfg_resource = KilnResource(overrides=SMALL, data_dir=str(data))
    run_stage(
        "user_prompts",
        tmp_path / "pairs",
        data / "user_prompts",
        cfg_resource.config(),
        workers=0,
    )
    result = dg.materialize(
        [assets_of_nodes["expander_sft"], assets_of_nodes["expander_rl"]],
        resources={"kiln": cfg_resource},
        instance=dg.DagsterInstance.ephemeral(),
    )
    assert result.success
    for key in ("expander_sft", "expander_rl"):
        md = result.asset_materializations_for_node(key)[0].metadata
        assert 0.0 <= md["faithfulness"].value <= 1.0 and 0.0 <= md["diversity"].value <= 2.0
        assert md["following_gain"].value == pytest.approx(md["following_expanded"].value - md["following_short"].value)
        assert "->" in md["examples"].value and (data / key / "config.json").exists()
