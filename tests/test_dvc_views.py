"""What DVC shows of a run: `dvc plots show` (PNGs drawn offline by the stages, plus vega curves for
`dvc plots diff`), `dvc metrics show` (one short headline row), and the evaluation history (a persisted,
cached output that outlives `rm -rf data`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from kiln.config import KilnConfig, MetricsConfig
from kiln.paths import REPO_ROOT
from training.core.plots import plot_loss
from training.evaluation.protocol import history_row, plot_history, record

DVC = str(Path(sys.executable).parent / "dvc")
ENV = {**os.environ, "DVC_NO_ANALYTICS": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
SERIES_BLUE = np.array([31, 119, 180])  # matplotlib's first series colour


def eval_metrics(step: int, heldout_loss: float, pf: float) -> dict:
    """The shape of training.evaluation.evaluate's metrics.json, with only the fields the views read."""
    attrs = {a: pf for a in ("color", "shape", "count", "position", "background")}
    return {
        "checkpoint": {"step": step, "final_loss": 0.21, "loss_ema": 0.2, "num_params": 1000, "bucket": "32x32"},
        "heldout": {"rows": 8, "held_out": True, "timesteps": [0.25, 0.5, 0.75], "seed": 0},
        "heldout_loss": {"t=0.25": heldout_loss, "t=0.5": heldout_loss, "t=0.75": heldout_loss, "mean": heldout_loss},
        "prompt_following": {**attrs, "all": pf},
        "distribution": {"fid": None, "cmmd": None, "dino_mmd": None},
        "distribution_setup": {"skipped": {"fid": "metrics.fid_extractor is not set"}, "prompts": 12, "seed": 0},
        "baseline": {"heldout_loss": {"mean": 1.02}, "prompt_following": {**{a: 0.1 for a in attrs}, "all": 0.1}},
        "throughput": {"samples_per_s": 120.5, "tokens_per_s": 7712.0, "mfu": 0.01},
    }


def dvc(root: Path, *args: str) -> str:
    return subprocess.run(
        [DVC, *args], cwd=root, env=ENV, capture_output=True, text=True, check=True, timeout=300
    ).stdout


def not_blank(path: Path) -> Image.Image:
    """A PNG with a drawing on it: a real size, and more than a frame of non-white pixels in several colours."""
    im = Image.open(path)
    assert im.format == "PNG" and im.width >= 200 and im.height >= 100, path
    px = np.asarray(im.convert("RGB")).reshape(-1, 3)
    inked = px[(px < 240).any(axis=1)]
    assert len(inked) > 0.02 * len(px), f"{path} is nearly blank"
    assert len(np.unique(inked, axis=0)) > 10, f"{path} has almost no colours"
    return im


def series_pixels(im: Image.Image) -> int:
    px = np.asarray(im.convert("RGB")).reshape(-1, 3).astype(int)
    return int((np.abs(px - SERIES_BLUE).sum(axis=1) < 40).sum())


@pytest.fixture(scope="module")
def a_run(tmp_path_factory) -> Path:
    """A DVC project holding what a run leaves for the views: the checkpoints' loss curves and one evaluation
    (drawn by the real plotting code), with dvc.yaml's plots and metrics as `kiln dvc write` renders them.
    Shared by the tests of this module, which only read it."""
    root = tmp_path_factory.mktemp("views") / "repo"
    root.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    dvc(root, "init", "-q")
    shutil.copytree(REPO_ROOT / ".dvc" / "plots", root / ".dvc" / "plots")
    doc = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())
    (root / "dvc.yaml").write_text(yaml.safe_dump({"metrics": doc["metrics"], "plots": doc["plots"]}, sort_keys=False))
    record(eval_metrics(400, 0.133, 0.25), root / "data" / "eval", KilnConfig(metrics=MetricsConfig(history=None)))
    for plot in doc["plots"]:
        if isinstance(plot, dict):
            for csv_path in (p for spec in plot.values() for p in spec["y"] if p.endswith("loss.csv")):
                records = [{"step": i, "loss": 1.0 / i} for i in range(1, 60)]
                (root / csv_path).parent.mkdir(parents=True, exist_ok=True)
                (root / csv_path).write_text("step,loss\n" + "".join(f"{r['step']},{r['loss']}\n" for r in records))
                plot_loss(records, root / csv_path.replace("loss.csv", "loss.png"))
    return root


def test_the_evaluation_history_draws_each_quantity_on_its_own_scale_and_one_checkpoint_as_a_visible_point(tmp_path):
    one = [history_row(eval_metrics(400, 0.133, 0.25))]
    plot_history(one, tmp_path / "one.png")
    im = not_blank(tmp_path / "one.png")
    assert series_pixels(im) > 20, "a history of one checkpoint must show its point, not an empty axis"
    three = [history_row(eval_metrics(s, 1.0 / s, s / 1000)) for s in (100, 200, 400)]
    plot_history(three, tmp_path / "three.png")
    assert not_blank(tmp_path / "three.png").width > im.width * 0.9


@pytest.mark.integration
def test_dvc_plots_show_offline_shows_every_png_the_stages_draw(a_run, tmp_path):
    """Each image plot is a PNG that a stage writes inside one of its outputs; `dvc plots show` copies it
    next to its page, which shows it without any network (vega plots need the CDN; the PNGs do not)."""
    doc = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())
    images = [p for p in doc["plots"] if isinstance(p, str)]
    outs = [o if isinstance(o, str) else next(iter(o)) for st in doc["stages"].values() for o in st.get("outs", [])]
    assert {"data/eval/history.png", "data/eval/prompt_following.png", "data/checkpoint_pretrain/loss.png"} <= set(
        images
    )
    for image in images:
        assert image.endswith(".png") and any(image.startswith(out + "/") for out in outs), (
            f"{image} is in no stage's output"
        )
        not_blank(a_run / image)
    shown = json.loads(dvc(a_run, "plots", "show", "--json"))["data"]
    assert all(shown[image][0]["type"] == "image" for image in images)
    dvc(a_run, "plots", "show", "-o", str(tmp_path / "page"))
    page = (tmp_path / "page" / "index.html").read_text()
    for image in images:
        static = tmp_path / "page" / "static" / ("workspace_" + image.replace("/", "_"))
        assert static.read_bytes() == (a_run / image).read_bytes() and f'src="static/{static.name}"' in page


@pytest.mark.integration
def test_the_eval_history_vega_plot_shows_the_recorded_values_without_smoothing(a_run):
    """The default template fits a loess curve; on one checkpoint's row it had nothing to fit and the axis
    read heldout_loss = 0 for 0.133. The points template plots the values as recorded."""
    shown = json.loads(dvc(a_run, "plots", "show", "--json"))["data"]
    spec = shown["eval_heldout_loss"][0]["content"]
    assert "loess" not in json.dumps(spec) and spec["mark"]["point"] is True
    assert [float(v["heldout_loss"]) for v in spec["data"]["values"]] == [0.133]
    assert "eval_prompt_following" in shown


@pytest.mark.integration
def test_dvc_metrics_show_prints_the_evaluation_headline_as_one_short_row(a_run):
    """The default `dvc metrics show` is the evaluation's headline (a subset of metrics.json under the same
    keys, so `kiln ablate` plans name the same keys), not every setup field of every stage."""
    table = dvc(a_run, "metrics", "show").rstrip("\n").splitlines()
    assert len(table) == 2 and max(len(line.rstrip()) for line in table) <= 320, "\n".join(table)
    headline = json.loads((a_run / "data" / "eval" / "headline.json").read_text())
    full = eval_metrics(400, 0.133, 0.25)  # what the fixture's evaluation recorded

    def leaves(d: dict, prefix: str = "") -> dict:
        return {
            k2: v2
            for k, v in d.items()
            for k2, v2 in (leaves(v, f"{prefix}{k}.").items() if isinstance(v, dict) else [(f"{prefix}{k}", v)])
        }

    assert leaves(headline).items() <= leaves(full).items()
    assert {"heldout_loss.mean", "prompt_following.all", "baseline.prompt_following.all", "checkpoint.step"} <= leaves(
        headline
    ).keys()


@pytest.mark.slow
@pytest.mark.integration
def test_the_evaluation_history_is_a_cached_output_kept_across_runs_that_outlives_data(tmp_path):
    """The evaluation stage as `kiln dvc write` declares it, on a tiny project whose `metrics.history` is kept
    outside data/: an unchanged stage is not rerun, an experiment adds its row to the kept rows, `rm -rf data`
    leaves the history, and `dvc checkout` restores it from DVC's cache."""
    from dvc.utils.hydra import compose_and_dump
    from test_ablate import sh, tiny_dvc_project

    from kiln.config import load_config
    from kiln.dvcgen import stage_of
    from kiln.registry import node
    from training.evaluation.protocol import read_history

    history = "eval_history/history.csv"
    root = tiny_dvc_project(tmp_path / "project")
    metrics_conf = root / "conf" / "metrics" / "demo.yaml"
    metrics_conf.write_text(
        "".join(
            f"history: {history}\n" if line.startswith("history:") else line
            for line in metrics_conf.read_text().splitlines(keepends=True)
        )
    )
    compose_and_dump(root / "params.yaml", str(root / "conf"), None, "config", str(root), [])
    doc = yaml.safe_load((root / "dvc.yaml").read_text())
    doc["stages"]["evaluation"]["outs"] = stage_of(node("evaluation", load_config([f"metrics.history={history}"])), [])[
        "outs"
    ]
    (root / "dvc.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    sh(root, "git", "add", "-A")
    sh(root, "git", "commit", "-q", "-m", "history kept outside data/")

    sh(root, "dvc", "repro", "evaluation")
    assert [r["step"] for r in read_history(root / history)] == [3]
    assert "Stage 'evaluation' didn't change, skipping" in sh(root, "dvc", "repro", "evaluation")
    sh(root, "git", "add", "-A")
    sh(root, "git", "commit", "-q", "-m", "first run")

    sh(root, "dvc", "exp", "run", "-n", "two-steps", "-S", "train.steps=2", "evaluation")
    kept = (root / history).read_bytes()
    assert [r["step"] for r in read_history(root / history)] == [2, 3]  # persisted: the experiment added its row

    shutil.rmtree(root / "data")
    assert (root / history).read_bytes() == kept
    (root / history).unlink()
    sh(root, "dvc", "checkout", history)
    assert (root / history).read_bytes() == kept  # cached: DVC restores it
