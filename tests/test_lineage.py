"""One lineage: a single connected graph from raw images to the evaluation, one registry behind every door
(Dagster, DVC, the CLI: tests/test_registry.py), and versions that say what is stale."""

from __future__ import annotations

import shutil
from pathlib import Path

import dagster as dg
import pytest

from kiln.config import load_config
from kiln.dvcgen import render, write_dvc_files
from kiln.ladder import rungs
from kiln.lineage import node_code_files, node_code_version
from kiln.outputs import VOLATILE_FILES, output_hash
from kiln.registry import asset_of, curation_nodes, ladder_train_sets, node

MAIN_CHAIN = curation_nodes(load_config([]))

REPO = Path(__file__).resolve().parent.parent


def test_the_asset_graph_is_one_connected_chain_from_raw_images_to_the_evaluation(defs):
    graph = defs.resolve_asset_graph()
    keys = graph.get_all_asset_keys()
    neighbours = {k: set(graph.get(k).parent_keys) | set(graph.get(k).child_keys) for k in keys}
    seen, todo = set(), [dg.AssetKey("raw_images")]
    while todo:
        k = todo.pop()
        if k not in seen:
            seen.add(k)
            todo.extend(neighbours[k])
    assert seen == set(keys), f"islands: {sorted(k.to_user_string() for k in set(keys) - seen)}"
    # and the main chain is a path: each step reads the one before it, and every rung's train set reads the last
    packs = ladder_train_sets(load_config([]))
    upstream = lambda n: asset_of(n.read_paths[0])  # noqa: E731 - what a data step reads first: its upstream
    assert [upstream(s) for s in MAIN_CHAIN[1:]] == [s.key for s in MAIN_CHAIN[:-1]] and {
        upstream(p) for p in packs
    } == {MAIN_CHAIN[-1].key}
    for s in [*MAIN_CHAIN, *packs]:
        assert dg.AssetKey(upstream(s)) in graph.get(dg.AssetKey(s.key)).parent_keys


def test_the_ladder_chains_its_rungs_and_ends_in_the_pma_checkpoint(defs):
    graph = defs.resolve_asset_graph()
    parents = lambda key: {k.to_user_string() for k in graph.get(dg.AssetKey(key)).parent_keys}
    assert [r.name for r in rungs(load_config([]))] == ["pretrain", "sft"]  # conf/ladder/demo.yaml
    assert parents("train_set_sft") == {"rewritten", "coverage", "mixes"}
    assert parents("checkpoint_pretrain") == {"train_set_pretrain"}
    assert parents("checkpoint_sft") == {"train_set_sft", "checkpoint_pretrain"}
    assert parents("checkpoint") == {"checkpoint_sft"} and parents("samples") == {"checkpoint"}


def test_the_main_job_runs_the_whole_chain(defs):
    main = {k.to_user_string() for k in defs.resolve_job_def("main").asset_layer.selected_asset_keys}
    ladder = {"train_set_pretrain", "checkpoint_pretrain", "train_set_sft", "checkpoint_sft", "checkpoint"}
    assert {s.key for s in MAIN_CHAIN} | ladder | {"raw_images", "coverage", "mixes", "samples", "evaluation"} <= main


def test_the_committed_dvc_files_are_the_ones_the_lineage_generates():
    assert write_dvc_files(check=True) == [], "run `kiln dvc write` and commit dvc.yaml and params.yaml"


def test_each_dvc_stage_depends_on_its_code_its_config_files_and_its_params():
    import yaml

    stages = yaml.safe_load(render()[0])["stages"]
    assert "data/raw/truth.parquet" in stages["captioned"]["deps"]  # the demo's captioner reads the ground truth
    assert {"assets/filters.py", "assets/decode.py", "kiln/config/data.py"} <= set(stages["filtered"]["deps"])
    assert stages["filtered"]["params"] == ["data.filters"]
    evaluation = stages["evaluation"]["params"]  # each key, or a section above it: `-S train.eval.steps=5` reruns it
    assert all(any(k == p or k.startswith(p + ".") for p in evaluation) for k in ("train.eval", "train.sample"))
    sft = stages["train_set_sft"]
    assert "data/coverage" in sft["deps"] and "data.pack.weights_file=data/coverage/weights.parquet" in sft["cmd"]
    assert (
        "data.pack.mix_file=data/mixes/sft/part-00000.parquet" in sft["cmd"] and "conf/train/demo.yaml" in sft["deps"]
    )
    assert (
        "train.init_from=data/checkpoint_pretrain" in stages["checkpoint_sft"]["cmd"]
        and "data/checkpoint_pretrain" in stages["checkpoint_sft"]["deps"]
    )
    assert stages["checkpoint"]["cmd"].startswith("kiln pma --run data/checkpoint_sft")
    assert "--data data/train_set_pretrain" in stages["evaluation"]["cmd"]
    assert stages["coverage"]["cmd"].startswith("kiln coverage") and stages["mixes"]["cmd"].startswith("kiln mixes")


def test_a_code_version_moves_with_the_config_sections_of_its_step_and_no_other():
    cfg = load_config([])
    filtered, deduped = node("filtered", cfg), node("deduped", cfg)
    changed = ["data.filters.min_side=40"]
    assert node_code_version(filtered, changed) != node_code_version(filtered, [])
    assert node_code_version(deduped, changed) == node_code_version(deduped, [])


def test_a_stage_is_versioned_by_the_code_it_runs_and_not_by_the_executor_that_runs_it():
    files = node_code_files(node("filtered", load_config([])))
    assert {"assets/filters.py", "assets/decode.py", "assets/hashes.py", "kiln/config/data.py"} <= set(files)
    assert "assets/dedup.py" not in files and not any(f.startswith(("kiln/executors", "slurm/")) for f in files)


def test_the_output_hash_is_the_one_dvc_records(tmp_path):
    from dvc_data.hashfile.build import build
    from dvc_data.hashfile.db import HashFileDB
    from dvc_objects.fs.local import LocalFileSystem

    (tmp_path / "out" / "kept").mkdir(parents=True)
    (tmp_path / "out" / "kept" / "part-00000.parquet").write_bytes(b"rows")
    (tmp_path / "out" / "summary.json").write_text("{}\n")
    fs = LocalFileSystem()
    odb = HashFileDB(fs, str(tmp_path / "cache"))
    _, _, obj = build(odb, str(tmp_path / "out"), fs, "md5")
    assert output_hash(tmp_path / "out") == obj.hash_info.value


def test_dvc_and_the_output_hash_leave_out_the_same_wall_clock_records(tmp_path):
    from dvc.ignore import DvcIgnoreFilter
    from dvc_objects.fs.local import LocalFileSystem

    shutil.copyfile(REPO / ".dvcignore", tmp_path / ".dvcignore")
    run = tmp_path / "data" / "checkpoint_sft"
    (run / "dcp").mkdir(parents=True)
    (run / "model.safetensors").write_bytes(b"weights")
    before = output_hash(run)
    for name in VOLATILE_FILES:
        (run / name).write_text("seconds that differ on every run\n")
    assert output_hash(run) == before
    ignored = DvcIgnoreFilter(LocalFileSystem(), str(tmp_path))
    assert all(ignored.is_ignored_file(str(run / name)) for name in VOLATILE_FILES)
    assert not ignored.is_ignored_file(str(run / "model.safetensors"))


@pytest.mark.integration
def test_a_config_change_marks_the_right_assets_stale(tmp_path, monkeypatch, defs):
    """Materialize the chain's head, change one step's config section: that step and what follows are stale."""
    from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
    from dagster._core.loader import LoadingContextForTest

    import kiln.lineage as lineage
    from dagster_project.run import job_for

    monkeypatch.chdir(tmp_path)
    instance = dg.DagsterInstance.ephemeral()
    run_config = {
        "resources": {"kiln": {"config": {"overrides": ["data.demo.n=40"], "data_dir": str(tmp_path / "data")}}}
    }
    assert (
        job_for(["raw_images", "manifest", "filtered", "deduped"], False)
        .execute_in_process(run_config=run_config, instance=instance)
        .success
    )

    def status(graph) -> dict[str, StaleStatus]:
        resolver = CachingStaleStatusResolver(instance, graph, LoadingContextForTest(instance))
        return {k: resolver.get_status(dg.AssetKey(k)) for k in ("manifest", "filtered", "deduped")}

    assert set(status(defs.resolve_asset_graph()).values()) == {StaleStatus.FRESH}
    # the definitions reloaded under a profile whose dedup radius changed (an edit of conf/data/demo.yaml, or KILN_OVERRIDES)
    monkeypatch.setenv("KILN_OVERRIDES", "data.dedup.phash_radius=20")
    lineage.default_config.cache_clear()
    import importlib

    import dagster_project.assets as assets_module
    import dagster_project.checks as checks_module
    import dagster_project.definitions as definitions_module

    modules = (assets_module, checks_module, definitions_module)
    for m in modules:
        importlib.reload(m)
    try:
        after = status(definitions_module.defs.resolve_asset_graph())
    finally:
        monkeypatch.undo()
        lineage.default_config.cache_clear()
        for m in modules:
            importlib.reload(m)
    assert after == {"manifest": StaleStatus.FRESH, "filtered": StaleStatus.FRESH, "deduped": StaleStatus.STALE}


@pytest.mark.slow
def test_the_graph_is_built_for_the_profile_in_kiln_overrides(defs, krea):
    """`KILN_OVERRIDES="ladder=krea"` (what `kiln run ladder=krea` sets) gives Dagster the krea ladder's assets."""
    import os
    import subprocess
    import sys

    code = "from dagster_project.definitions import defs; print(sorted(k.to_user_string() for k in defs.resolve_asset_graph().get_all_asset_keys()))"
    env = {**os.environ, "KILN_OVERRIDES": " ".join(krea)}
    keys = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    for rung in ("pretrain_256", "pretrain_512", "pretrain_1024", "midtrain", "sft"):
        assert f"'checkpoint_{rung}'" in keys and f"'train_set_{rung}'" in keys
    assert "'checkpoint_pretrain'" not in keys


def test_kiln_run_refuses_a_ladder_other_than_the_loaded_graphs(krea):
    from dagster_project.run import check_graph_profile
    from kiln.config import ConfigError

    check_graph_profile(load_config([]))  # the graph this process loaded: the demo ladder
    with pytest.raises(ConfigError, match="built for the ladder"):
        check_graph_profile(load_config(krea))
