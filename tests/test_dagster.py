"""The Dagster door: every artifact is an asset with checks, and a failed Slurm job fails its materialization."""

from __future__ import annotations

import dagster as dg
import pytest

from dagster_project.resources import KilnResource

ARTIFACTS = [
    "raw_images",
    "manifest",
    "filtered",
    "deduped",
    "captioned",
    "train_set_pretrain",
    "checkpoint_pretrain",
    "checkpoint",
    "samples",
    "evaluation",
]


def test_definitions_show_every_artifact_from_raw_images_to_the_evaluation(defs):
    graph = defs.resolve_asset_graph()
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert set(ARTIFACTS) <= keys
    # evaluation reads the model and the first rung's train set, whose held-out rows no rung trained on
    assert graph.get(dg.AssetKey("evaluation")).parent_keys == {
        dg.AssetKey("checkpoint"),
        dg.AssetKey("train_set_pretrain"),
    }


def test_every_data_asset_has_an_accounting_check_and_a_great_expectations_check(defs):
    checks = {(k.asset_key.to_user_string(), k.name) for k in defs.resolve_asset_graph().asset_check_keys}
    for asset in ["manifest", "filtered", "deduped", "captioned", "train_set_pretrain", "train_set_sft"]:
        assert (asset, "rows_accounted_for") in checks and (asset, "great_expectations") in checks


@pytest.mark.integration
def test_the_data_assets_materialize_with_passing_checks(tmp_path, monkeypatch):
    from dagster_project.run import job_for
    from kiln.config import load_config
    from kiln.outputs import output_hash
    from kiln.registry import curation_nodes, ladder_train_sets

    monkeypatch.chdir(tmp_path)
    data_steps = [*curation_nodes(load_config([])), *ladder_train_sets(load_config([]))]
    result = job_for(
        ["raw_images", *[s.key for s in data_steps], "coverage", "mixes"], everything=False
    ).execute_in_process(
        run_config={
            "resources": {"kiln": {"config": {"overrides": ["data.demo.n=80"], "data_dir": str(tmp_path / "data")}}}
        },
        instance=dg.DagsterInstance.ephemeral(),
    )
    assert result.success
    evaluations = result.get_asset_check_evaluations()
    assert len(evaluations) == 2 * len(data_steps) and all(e.passed for e in evaluations), [
        e.check_name for e in evaluations if not e.passed
    ]
    event = result.asset_materializations_for_node("filtered")[0]
    assert event.tags["dagster/data_version"] == output_hash(
        tmp_path / "data" / "filtered"
    )  # the hash dvc.lock records
    md = event.metadata
    assert md["input_rows"].value == md["kept"].value + md["rejected"].value and md["rejected"].value > 0
    assert "data:image/png;base64," in md["kept_sample"].value


@pytest.mark.slurm
@pytest.mark.integration
def test_a_failing_slurm_training_job_fails_the_checkpoint_with_its_log_tail(slurm_cluster, tmp_path, monkeypatch):
    from dagster_project.assets import ASSETS

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "train_set_pretrain").mkdir(parents=True)  # no shards: the trainer fails inside the job
    result = dg.materialize(
        [ASSETS["checkpoint_pretrain"]],
        resources={
            "kiln": KilnResource(
                overrides=["cluster=test", f"cluster.log_dir={tmp_path / 'slurm'}", "cluster.poll_s=0.3"],
                data_dir=str(tmp_path / "data"),
            )
        },
        instance=dg.DagsterInstance.ephemeral(),
        raise_on_error=False,
    )
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    info = failure.step_failure_data.user_failure_data
    assert "slurm job" in info.description and "FAILED" in info.description
    assert (
        "MissingInput: no train set at" in info.metadata["log_tail"].value
    )  # the trainer's own error, from the job's log
