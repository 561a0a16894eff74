"""`checkpoint_style` as a Dagster asset on a tiny checkpoint, and `kiln style-train` from the command line."""

from __future__ import annotations

import json

import dagster as dg
import pytest

from dagster_project.resources import KilnResource
from kiln.cli import main
from model.testing import write_tiny_text_encoder
from training.core.trainer import train
from training.testing import scene_rows, tiny_config, write_pack_output

SMALL = [
    "style.steps=2",
    "style.batch_size=2",
    "style.save_every=2",
    "style.eval_cases=2",
    "style.eval_steps=2",
    "style.eval_strengths=[0.0,0.5,1.0]",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("style_assets")
    te = write_tiny_text_encoder(root / "text_encoder")
    train(
        write_pack_output(root / "data" / "train_set_pretrain", scene_rows(16, seed=5)),
        root / "data" / "checkpoint",
        tiny_config(te, steps=4),
    )
    return root / "data"


@pytest.mark.slow
@pytest.mark.integration
def test_checkpoint_style_materializes_with_transfer_and_leakage_per_strength(data, assets_of_nodes):
    result = dg.materialize(
        [assets_of_nodes["checkpoint_style"]],
        resources={"kiln": KilnResource(overrides=SMALL, data_dir=str(data))},
        instance=dg.DagsterInstance.ephemeral(),
    )
    assert result.success
    md = result.asset_materializations_for_node("checkpoint_style")[0].metadata
    for s in ("0", "0.5", "1"):
        assert 0.0 <= md[f"transfer@{s}"].value <= 1.0 and 0.0 <= md[f"leakage@{s}"].value <= 1.0
    assert {"transfer_monotone", "max_leakage", "leakage_bound", "leakage_ok", "last10.loss"} <= set(md)
    report = json.loads((data / "checkpoint_style" / "style_eval.json").read_text())
    assert [r["strength"] for r in report["per_strength"]] == [0.0, 0.5, 1.0]


def test_the_asset_depends_on_checkpoint_and_is_in_the_definitions():
    from dagster_project.definitions import defs

    spec = defs.resolve_asset_graph().get(dg.AssetKey("checkpoint_style"))
    assert dg.AssetKey("checkpoint") in spec.parent_keys and spec.group_name == "style"


def test_style_train_refuses_a_folder_that_is_no_checkpoint_and_writes_nothing(tmp_path, capsys):
    assert main(["style-train", "--checkpoint", str(tmp_path / "missing"), "--out", str(tmp_path / "out")]) == 2
    assert "not a checkpoint folder" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_style_train_from_the_command_line_trains_and_evaluates(data, tmp_path, capsys):
    assert (
        main(
            [
                "style-train",
                "--checkpoint",
                str(data / "checkpoint"),
                "--out",
                str(tmp_path / "out"),
                "--evaluate",
                *SMALL,
            ]
        )
        == 0
    )
    assert (tmp_path / "out" / "model.safetensors").exists() and (tmp_path / "out" / "style_eval.json").exists()
