"""`kiln ablate` and `dvc exp run -S` on a tiny DVC project: DVC's Hydra composition of conf/ reaches the
kiln stages, and an ablation plan runs its variants as DVC experiments and compares them.

The project is a temp git + DVC repo holding the repo's conf/ (switched to a micro DiT over a tiny random
BERT and a few-step, one-thread run), a packed train set of demo scenes, and two stages (train, evaluate)
that call the same `kiln train` / `kiln eval` as the real dvc.yaml.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kiln.dvcgen import present_params
from kiln.paths import REPO_ROOT
from kiln.registry import EVAL_PARAMS, TRAIN_PARAMS

BIN = Path(sys.executable).parent
MICRO_TRAIN = {"steps": 3, "batch_size": 8, "holdout": 8, "log_every": 0, "warmup_steps": 1, "threads": 1, "dcp": {"every": 0},
               "sample": {"steps": 2, "n_per_prompt": 1}, "eval": {"steps": 2, "n_per_prompt": 1}}  # fmt: skip


def _env(root: Path) -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1", "KILN_CONF": str(root / "conf"),
            "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip


def sh(root: Path, *cmd: str, timeout: int = 600) -> str:
    proc = subprocess.run(cmd, cwd=root, env=_env(root), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def tiny_dvc_project(root: Path) -> Path:
    """A git + DVC repo with Hydra enabled: conf/ (micro model, 3-step run), train_set/, and the stages
    `checkpoint` (kiln train) and `evaluation` (kiln eval, its headline metrics in data/eval/headline.json)."""
    from model.testing import write_tiny_text_encoder
    from training.testing import scene_rows, write_pack_output

    root.mkdir(parents=True)
    shutil.copytree(REPO_ROOT / "conf", root / "conf")
    te = write_tiny_text_encoder(root / "text_encoder")
    write_pack_output(root / "train_set", scene_rows(48, seed=1, batch_size=8))
    model = {"size": "micro", "patch_size": 2, "in_channels": 3, "pad_to_multiple": 16,
             "text_encoder": {"path": str(te), "max_length": 16, "layers": [-1, -2, -3], "refiner_layers": 1}}  # fmt: skip
    (root / "conf" / "model" / "micro.yaml").write_text(yaml.safe_dump(model))
    train = yaml.safe_load((root / "conf" / "train" / "demo.yaml").read_text())
    (root / "conf" / "train" / "micro.yaml").write_text(yaml.safe_dump(_merge(train, MICRO_TRAIN), sort_keys=False))
    top = (
        (root / "conf" / "config.yaml")
        .read_text()
        .replace("- model: nano", "- model: micro")
        .replace("- train: demo", "- train: micro")
    )
    (root / "conf" / "config.yaml").write_text(top)
    from dvc.utils.hydra import compose_and_dump

    compose_and_dump(
        root / "params.yaml", str(root / "conf"), None, "config", str(root), []
    )  # what `dvc exp run` writes
    composed = yaml.safe_load((root / "params.yaml").read_text())
    stages = {  # the params the real dvc.yaml gives its training and evaluation stages
        "checkpoint": {"cmd": "kiln train --data train_set --out data/checkpoint", "deps": ["train_set"],
                       "params": present_params(TRAIN_PARAMS, composed), "outs": ["data/checkpoint"]},
        "evaluation": {"cmd": "kiln eval --checkpoint data/checkpoint --data train_set --out data/eval", "deps": ["data/checkpoint", "train_set"],
                       "params": present_params(EVAL_PARAMS, composed), "outs": ["data/eval"]},
    }  # fmt: skip
    (root / "dvc.yaml").write_text(
        yaml.safe_dump({"stages": stages, "metrics": ["data/eval/headline.json"]}, sort_keys=False)
    )
    sh(root, "git", "init", "-q")
    sh(root, "dvc", "init", "-q")
    for key, value in (("hydra.enabled", "true"), ("hydra.config_dir", "conf"), ("hydra.config_name", "config")):
        sh(root, "dvc", "config", key, value)
    sh(root, "git", "add", "-A")
    sh(root, "git", "commit", "-q", "-m", "tiny kiln project")
    return root


def _merge(a: dict, b: dict) -> dict:
    return {
        **a,
        **{k: _merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v for k, v in b.items()},
    }


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    return tiny_dvc_project(tmp_path_factory.mktemp("ablate") / "template")


@pytest.fixture
def project(template, tmp_path) -> Path:
    """A fresh copy of the tiny project (git history and DVC config included) for one test."""
    root = tmp_path / "project"
    shutil.copytree(template, root, symlinks=True)
    conf = root / "conf" / "model" / "micro.yaml"  # the text encoder path points into the copy
    conf.write_text(conf.read_text().replace(str(template), str(root)))
    sh(root, "git", "commit", "-q", "-am", "copy")
    from dvc.utils.hydra import compose_and_dump

    compose_and_dump(root / "params.yaml", str(root / "conf"), None, "config", str(root), [])
    sh(root, "git", "commit", "-q", "--allow-empty", "-am", "params")
    return root


def _steps_trained(checkpoint: Path) -> int:
    return json.loads((checkpoint / "train_state.json").read_text())["step"]


@pytest.mark.slow
@pytest.mark.integration
def test_dvc_exp_run_with_a_hydra_key_changes_what_trains(project):
    """`dvc exp run -S train.steps=2`: DVC composes conf/ with the override into params.yaml, and the
    `kiln train` the stage runs (whose command names no steps) trains 2 steps, not conf/'s 3."""
    assert yaml.safe_load((project / "params.yaml").read_text())["train"]["steps"] == 3
    sh(project, "dvc", "exp", "run", "-n", "two-steps", "-S", "train.steps=2", "checkpoint")
    assert yaml.safe_load((project / "params.yaml").read_text())["train"]["steps"] == 2
    assert _steps_trained(project / "data" / "checkpoint") == 2
    shown = {
        r["Experiment"]: r
        for r in csv.DictReader(io.StringIO(sh(project, "dvc", "exp", "show", "--no-pager", "--csv")))
    }
    assert shown["two-steps"]["train.steps"] == "2"  # `dvc exp show` lists it with kiln's real key


@pytest.mark.slow
@pytest.mark.integration
def test_kiln_ablate_runs_each_variant_as_a_dvc_experiment_and_compares_them(project):
    """Two variants (2 vs 4 steps), one seed: each is a DVC experiment that `dvc exp show` lists, and the
    table's rows differ in the checkpoint's step count, the field their overrides change."""
    import pyarrow.parquet as pq

    plan = project / "plan.yaml"
    plan.write_text(yaml.safe_dump({
        "name": "ci", "base": ["train.threads=1"], "seeds": [0],
        "variants": [{"name": "short", "overrides": ["train.steps=2"]}, {"name": "longer", "overrides": ["train.steps=4"]}],
        "metrics": ["checkpoint.step", "heldout_loss.mean"],
    }))  # fmt: skip
    out = project / "out"
    sh(project, "kiln", "ablate", str(plan), "--out", str(out), timeout=900)

    rows = {r["variant"]: r for r in pq.read_table(out / "comparison.parquet").to_pylist()}
    assert rows["short"]["baseline"] and not rows["longer"]["baseline"]
    assert (rows["short"]["checkpoint.step_mean"], rows["longer"]["checkpoint.step_mean"]) == (2, 4)
    assert rows["longer"]["checkpoint.step_delta"] == 2 and rows["short"]["checkpoint.step_std"] == 0
    assert rows["short"]["heldout_loss.mean_mean"] != rows["longer"]["heldout_loss.mean_mean"]
    assert "| longer | 1 | 4 ± 0 [4, 4] (+2)" in (out / "comparison.md").read_text()
    assert (out / "comparison.png").read_bytes()[:4] == b"\x89PNG" and (out / "runs.parquet").exists()
    shown = sh(project, "dvc", "exp", "show", "--no-pager", "--csv")
    assert "ci-short-s0" in shown and "ci-longer-s0" in shown


# ----------------------------------------------------------------------------- refusals, before any run
def _plan(tmp_path: Path, **fields) -> Path:
    doc = {
        "name": "p",
        "variants": [{"name": "a", "overrides": []}, {"name": "b", "overrides": ["train.steps=5"]}],
    } | fields
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def bare_repo_template(tmp_path_factory) -> Path:
    """conf/, a dvc.yaml with an `evaluation` stage and Hydra enabled: enough for a plan to be checked."""
    root = tmp_path_factory.mktemp("bare") / "repo"
    root.mkdir()
    shutil.copytree(REPO_ROOT / "conf", root / "conf")
    sh(root, "dvc", "init", "-q", "--no-scm")
    sh(root, "dvc", "config", "hydra.enabled", "true")
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"evaluation": {"cmd": "true"}}}))
    return root


@pytest.fixture
def bare_repo(bare_repo_template, tmp_path) -> Path:
    """A fresh copy of the template for each test (a test may write into it)."""
    return Path(shutil.copytree(bare_repo_template, tmp_path / "repo"))


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"variants": [{"name": "a", "overrides": []}, {"name": "a", "overrides": ["train.steps=5"]}]}, "repeated: a"),
        ({"baseline": "nope"}, "baseline 'nope' is not a variant"),
        ({"variants": [{"name": "a", "overrides": []}]}, "at least 2"),
        ({"seeds": [0, 0]}, "seeds repeat"),
        ({"seeds": [-1]}, "greater than or equal to 0"),
        (
            {"variants": [{"name": "a"}, {"name": "b", "overrides": []}], "colour": 1},
            "colour: Extra inputs are not permitted",
        ),
    ],
)
def test_a_malformed_plan_is_refused_naming_what_is_wrong(tmp_path, fields, says):
    from kiln.ablate import load_plan
    from kiln.errors import UserError

    with pytest.raises(UserError, match=None) as e:
        load_plan(_plan(tmp_path, **fields))
    assert says in str(e.value)


def test_a_key_repeated_in_the_plan_file_is_refused_not_silently_dropped(tmp_path):
    from kiln.ablate import load_plan
    from kiln.errors import UserError

    path = tmp_path / "plan.yaml"
    path.write_text("name: p\nname: q\nvariants: []\n")
    with pytest.raises(UserError, match="key repeated in one mapping.*name"):
        load_plan(path)


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("train.stepz=5", "Could not override 'train.stepz'"),  # DVC's composition refuses it (Hydra suggests the '+')
        ("+train.stepz=5", "train.stepz: unknown key"),  # composed, then kiln's schema refuses it
        ("train.steps=-5", "train.steps: Input should be greater than or equal to 1"),
        ("train.steps=5,6", "is a sweep"),
    ],
)
def test_a_variant_override_kiln_or_dvc_would_refuse_stops_the_plan_before_anything_is_queued(
    bare_repo, tmp_path, override, says
):
    from kiln.ablate import check_plan, load_plan
    from kiln.errors import UserError

    plan = load_plan(
        _plan(tmp_path, variants=[{"name": "a", "overrides": []}, {"name": "bad", "overrides": [override]}])
    )
    with pytest.raises(UserError) as e:
        check_plan(plan, bare_repo)
    assert "variant bad" in str(e.value) and says in str(e.value)
    assert not (bare_repo / ".dvc" / "tmp" / "exps").exists()  # nothing queued


def test_an_unknown_target_stage_is_refused(bare_repo, tmp_path):
    from kiln.ablate import check_plan, load_plan
    from kiln.errors import UserError

    with pytest.raises(UserError, match="target stage 'evaluate' is not in"):
        check_plan(load_plan(_plan(tmp_path, target="evaluate")), bare_repo)


@pytest.mark.slow
def test_the_demo_plan_is_a_valid_plan_for_this_repo(bare_repo):
    """conf/ablate/demo.yaml: long vs short captions and fp32 vs bf16-stored weights, each variant's config
    accepted by DVC's composition and by kiln, against the repo's own dvc.yaml."""
    from kiln.ablate import check_plan, load_plan
    from kiln.config import load_config

    shutil.copy(
        REPO_ROOT / "dvc.yaml", bare_repo / "dvc.yaml"
    )  # a copy: opening the repo itself writes DVC's .dvc/tmp there
    plan = load_plan(REPO_ROOT / "conf" / "ablate" / "demo.yaml")
    check_plan(plan, bare_repo)
    cfgs = {v.name: load_config([*plan.base, *v.overrides]) for v in plan.variants}
    assert (
        cfgs["long_captions"].data.rewrite.form_probs["long"] == 1.0
        and cfgs["short_captions"].data.rewrite.form_probs["short"] == 1.0
    )
    assert (cfgs["long_captions"].train.optim.weights, cfgs["bf16_weights"].train.optim.weights) == ("fp32", "bf16")


def test_the_stages_a_train_or_eval_override_changes_list_it_as_a_param():
    """DVC reruns a stage only when its deps or its params changed, and otherwise restores it from its run
    cache: a training or evaluation stage that did not list `train` would ignore `-S train.steps=50`."""
    stages = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())["stages"]
    training = [k for k, st in stages.items() if st["cmd"].startswith("kiln train ")]
    assert training and "evaluation" in stages
    for key in training:
        assert {"train", "model", "data.rewrite"} <= set(stages[key]["params"]), key
    assert {"train", "metrics"} <= set(stages["evaluation"]["params"])  # train.eval and train.sample live in train


# ----------------------------------------------------------------------------- the comparison
def test_the_table_gives_mean_spread_and_delta_to_the_baseline_per_variant():
    from kiln.ablate_report import markdown, summarize

    records = [
        {"variant": "base", "seed": 0, "overrides": "", "loss": 1.0},
        {"variant": "base", "seed": 1, "overrides": "", "loss": 3.0},
        {"variant": "lr", "seed": 0, "overrides": "train.lr=0.01", "loss": 0.5},
        {"variant": "lr", "seed": 1, "overrides": "train.lr=0.01", "loss": 1.5},
    ]
    base, lr = summarize(records, ["loss"], "base")
    assert (base["loss_mean"], base["loss_min"], base["loss_max"], base["loss_delta"]) == (2.0, 1.0, 3.0, 0.0)
    assert base["loss_std"] == pytest.approx(2**0.5)  # sample std of (1, 3)
    assert (lr["loss_mean"], lr["loss_delta"], lr["n_seeds"]) == (1.0, -1.0, 2)
    table = markdown([base, lr], ["loss"], "t")
    assert (
        "| **base** (baseline) | 2 | 2 ± 1.414 [1, 3] |" in table and "| lr | 2 | 1 ± 0.7071 [0.5, 1.5] (-1) |" in table
    )


# ----------------------------------------------------------------------------- params.yaml -> overrides
def test_the_overrides_read_from_params_yaml_recompose_it_exactly():
    """What `dvc exp run -S` composed (a changed leaf, a replaced dict, an added and a dropped key) comes
    back from conf/ plus the derived overrides, so a kiln stage sees exactly params.yaml."""
    from kiln.config import compose_raw
    from kiln.dvc_params import diff_overrides

    base, _ = compose_raw([])
    target, _ = compose_raw(
        [
            "train.steps=7",
            "+data.rewrite.form_probs={long: 1.0, short: 0.0}",
            "~train.log_every",
            "train.lr=1e-4",
            "+data.demo.n=41",
        ]
    )
    overrides = diff_overrides(base, target)
    assert "train.steps=7" in overrides and "~train.log_every" in overrides
    assert compose_raw(overrides)[0] == target
    assert diff_overrides(base, base) == []


def test_params_yaml_is_read_only_in_a_stage_of_a_dvc_experiment(tmp_path, monkeypatch):
    """`dvc exp run` has just composed params.yaml; a plain `dvc repro` has not (it may predate an edit of conf/)."""
    from kiln.config import stage_overrides

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("train:\n  steps: 2\n")
    for var in ("DVC_STAGE", "DVC_EXP_NAME"):
        monkeypatch.delenv(var, raising=False)
    assert stage_overrides() == []  # kiln run by hand, Dagster
    monkeypatch.setenv("DVC_STAGE", "checkpoint")
    assert stage_overrides() == []  # dvc repro
    monkeypatch.setenv("DVC_EXP_NAME", "two-steps")
    assert "train.steps=2" in stage_overrides()  # dvc exp run
