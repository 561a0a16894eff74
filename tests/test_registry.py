"""One registry drives the three doors: every Dagster asset, every DVC stage and every node command of `kiln`
is generated from a row of kiln.registry, and for every node the inputs of Dagster's code version are DVC's
deps and params. An edit marks the same nodes stale through either door, and only the nodes whose code or
config it touches: a curation file never retrains a checkpoint."""

from __future__ import annotations

import shlex
import shutil

import dagster as dg
import pytest
import yaml

import kiln.lineage as lineage
from kiln.cli import build_parser
from kiln.config import load_config
from kiln.dvcgen import present_params, render, stage_of
from kiln.lineage import call_args, node_code_version, version_inputs
from kiln.paths import REPO_ROOT
from kiln.registry import nodes, with_door

CFG = load_config([])


@pytest.fixture(scope="module")
def dvc():
    """The stages of the dvc.yaml the registry renders."""
    return yaml.safe_load(render()[0])["stages"]


def test_every_dagster_asset_is_a_registry_node_with_its_deps_and_code_version(defs):
    from dagster_project.assets import upstream_keys

    graph = defs.resolve_asset_graph()
    rows = {n.key: n for n in with_door("dagster", CFG)}
    assert {k.to_user_string() for k in graph.get_all_asset_keys()} == set(rows)
    for key, node in rows.items():
        asset = graph.get(dg.AssetKey(key))
        assert {k.to_user_string() for k in asset.parent_keys} == set(upstream_keys(node)), key
        if asset.is_materializable:
            assert asset.code_version == node_code_version(node), key


def test_every_dvc_stage_is_a_registry_node_rendered_from_its_row(dvc):
    rows = {n.key: n for n in with_door("dvc", CFG)}
    assert set(dvc) == set(rows)
    composed = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    for key, node in rows.items():
        want = stage_of(node, [])
        if "params" in want:
            want["params"] = present_params(want["params"], composed)
        assert dvc[key] == want, key


def test_for_every_node_dagster_versions_by_what_dvc_depends_on(dvc):
    """Dagster hashes (files, sections, call); DVC lists the same files as deps beside the data it reads, the
    same sections as params, and runs the same call."""
    composed = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    for node in with_door("dvc", CFG):
        if "dagster" not in node.doors:
            continue
        vi, stage = version_inputs(node), dvc[node.key]
        data = [d for d in stage["deps"] if d.startswith("data/")]
        assert [d for d in stage["deps"] if d not in data] == list(vi.files), node.key
        assert data == [f"data/{p}" for p in node.read_paths], node.key
        assert stage.get("params", []) == present_params(list(vi.params), composed), node.key
        assert stage["cmd"] == " ".join(["kiln", node.command, *map(shlex.quote, call_args(node, [], "data"))]), (
            node.key
        )


def test_every_dvc_command_is_a_kiln_command_that_parses_to_its_node_command(dvc):
    parser = build_parser()
    for key, stage in dvc.items():
        argv = shlex.split(stage["cmd"])
        assert argv[0] == "kiln", key
        args, extra = parser.parse_known_args(argv[1:])
        assert args.command == argv[1] and all("=" in x for x in extra), key


def test_every_node_command_is_a_kiln_subcommand():
    subcommands = set(build_parser()._subparsers._group_actions[0].choices)
    assert {n.command for n in nodes(CFG)} <= subcommands


@pytest.fixture
def repo_copy(tmp_path, monkeypatch):
    """The code and conf of this checkout in a scratch folder that the versions read instead."""
    for top in ("kiln", "assets", "components", "model", "training", "conf"):
        shutil.copytree(REPO_ROOT / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(lineage, "REPO_ROOT", tmp_path)
    lineage.code_files.cache_clear()
    yield tmp_path
    lineage.code_files.cache_clear()


def _versions(keys):
    lineage.code_files.cache_clear()
    found = {n.key: n for n in nodes(CFG)}
    return {k: node_code_version(found[k]) for k in keys}


@pytest.mark.parametrize("edited", ["assets/embed.py", "assets/ocr.py", "assets/classify.py"])
def test_editing_a_curation_file_does_not_touch_training_or_evaluation(repo_copy, edited, dvc):
    keys = ["checkpoint_pretrain", "checkpoint_sft", "checkpoint", "evaluation", "samples", "checkpoint_dpo"]
    before = _versions(keys)
    with (repo_copy / edited).open("a") as fh:
        fh.write("\n# an edit\n")
    assert _versions(keys) == before
    for key in keys:
        assert edited not in dvc[key]["deps"]


def test_editing_the_trainer_reruns_the_checkpoints_and_not_the_curation(repo_copy, dvc):
    keys = ["filtered", "rewritten", "train_set_pretrain", "checkpoint_pretrain", "evaluation"]
    before = _versions(keys)
    with (repo_copy / "training" / "core" / "trainer.py").open("a") as fh:
        fh.write("\n# an edit\n")
    after = _versions(keys)
    assert [k for k in keys if after[k] != before[k]] == ["checkpoint_pretrain"]
    assert (
        "training/core/trainer.py" in dvc["checkpoint_pretrain"]["deps"]
        and "training/core/trainer.py" not in dvc["filtered"]["deps"]
    )


def test_editing_a_rungs_train_file_marks_its_checkpoint_stale_in_both_doors(repo_copy, monkeypatch, dvc):
    """conf/train/demo.yaml: a dep of every demo rung's DVC stage, and its values are in their Dagster versions."""
    keys = ["checkpoint_pretrain", "train_set_pretrain", "filtered"]
    before = _versions(keys)
    monkeypatch.setenv("KILN_CONF", str(repo_copy / "conf"))
    conf = repo_copy / "conf" / "train" / "demo.yaml"
    conf.write_text(conf.read_text().replace("lr: 0.002", "lr: 0.003"))
    after = _versions(keys)
    assert after["checkpoint_pretrain"] != before["checkpoint_pretrain"] and after["filtered"] == before["filtered"]
    assert (
        "conf/train/demo.yaml" in dvc["checkpoint_pretrain"]["deps"]
        and "conf/train/demo.yaml" not in dvc["filtered"]["deps"]
    )


def test_every_asset_of_the_definitions_comes_from_the_registry_module(defs, assets_of_nodes):
    """No asset is written by hand: each is ASSETS[key], built from its row."""
    assert {id(a) for a in defs.assets} == {id(a) for a in assets_of_nodes.values()}


def test_each_node_says_what_one_task_needs_and_its_asset_carries_it(assets_of_nodes):
    rows = {n.key: n for n in with_door("dagster", CFG)}
    assert (
        rows["embedded"].resources.cpus == 2 and rows["filtered"].resources.gpus == 0
    )  # a data stage: its stage's own declaration
    assert (
        rows["checkpoint_pretrain"].resources.gpus == 1 and rows["evaluation"].resources.gpus == 1
    )  # a torch model: a GPU a task
    for key, node in rows.items():
        if key != "raw_images":
            assert assets_of_nodes[key].op.tags == {
                "kiln/cpus": str(node.resources.cpus),
                "kiln/gpus": str(node.resources.gpus),
            }, key


@pytest.mark.parametrize("krea_ladder", [False, True])
def test_every_node_versions_by_the_values_of_its_sections_in_the_config_it_composes(krea_ladder, request):
    """No silent fallback to code alone: each node's config (a rung's with its wiring) composes, and its
    sections' values are in its version; a rung's train set sees its own resolution."""
    from kiln.lineage import node_params

    profile = request.getfixturevalue("krea") if krea_ladder else []
    found = {n.key: n for n in nodes(load_config(profile))}
    values = {key: node_params(n, profile) for key, n in found.items()}
    assert all(set(v) == set(found[k].params) for k, v in values.items())
    if profile:
        assert values["train_set_pretrain_512"]["data.pack"]["resolution"] == 512
        assert values["train_set_pretrain_256"]["data.pack"]["resolution"] == 256


def test_every_param_of_every_dvc_stage_is_in_params_yaml(dvc):
    """DVC refuses a stage whose param is missing from params.yaml: a section conf/ never writes is left to the
    code that defines it (a dep), never listed."""
    composed = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    for key, stage in dvc.items():
        for param in stage.get("params", []):
            node = composed
            for part in param.split("."):
                assert isinstance(node, dict) and part in node, f"{key}: {param} is not in params.yaml"
                node = node[part]
