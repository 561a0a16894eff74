"""What a person sees first on the Dagster pages, built from small output folders written here (no training):
a checkpoint leads with its key figures and keeps its config as one JSON entry; the evaluation leads with a
table against the untrained baseline and names every skipped metric's reason; every reject reason gets tiles,
an undecodable file a placeholder."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import dagster as dg
import numpy as np
import pytest
from PIL import Image

from dagster_project.metadata import rejects_grid
from dagster_project.pages import KEY_FIGURES, checkpoint_page, checkpoint_samples, evaluation_page
from kiln.config import load_config
from kiln.stage import Rejects
from kiln.viz import placeholder_tile

INLINE_LIMIT = 1000  # Dagster 1.13 shows a markdown value inline below this many characters (MetadataEntry.tsx)


def decode_md_png(md: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(md.split("base64,", 1)[1].rstrip(")")))).convert("RGB")


@pytest.fixture
def checkpoint_dir(tmp_path) -> Path:
    """A trainer checkpoint's records, as training/core/telemetry.py and the trainer write them."""
    out = tmp_path / "checkpoint"
    out.mkdir()
    config = json.loads(load_config([]).model_dump_json())
    state = {
        "bucket": "32x32",
        "config": config,
        "final_loss": 0.183,
        "holdout": 32,
        "loss_ema": 0.133,
        "num_params": 4802225,
        "position": {"batch": 3, "epoch": 11},
        "rows": 164,
        "step": 140,
    }
    (out / "train_state.json").write_text(json.dumps(state))
    (out / "throughput.json").write_text(
        json.dumps({"mfu": None, "samples_per_s": 6.9, "tokens_per_s": 412.2, "steps": 140, "wall_s": 279.0})
    )
    (out / "train_data.json").write_text(
        json.dumps({"train_set_version": "89386b03", "mix": "sft", "caption_forms_drawn": {"long": 926}})
    )
    (out / "loss.csv").write_text(
        "step,loss,grad_norm,lr\n" + "".join(f"{i},{1 / i:.5f},0.2,0.001\n" for i in range(1, 141))
    )
    return out


def test_a_checkpoint_page_leads_with_its_key_figures(checkpoint_dir):
    md = checkpoint_page(checkpoint_dir, samples="![samples](data:image/png;base64,AAAA)")
    assert list(md)[: len(KEY_FIGURES)] == list(KEY_FIGURES)
    assert md["final_loss"] == 0.183 and md["tokens_per_s"] == 412.2 and md["train_set_version"] == "89386b03"
    assert "peak FLOP/s" in md["mfu"].value  # a CPU run has no MFU: the page says why instead of leaving it out
    assert (
        len(md["loss_curve"].value) < INLINE_LIMIT and "data:image/svg+xml;base64," in md["loss_curve"].value
    )  # shown without a click


def test_a_checkpoint_keeps_its_config_as_one_json_entry(checkpoint_dir):
    md = checkpoint_page(checkpoint_dir)
    config = json.loads((checkpoint_dir / "train_state.json").read_text())["config"]
    assert isinstance(md["config"], dg.JsonMetadataValue) and md["config"].data == config
    assert not [k for k in md if k.startswith(("config.", "train.", "data.", "model."))]
    assert list(md)[-2:] == ["config", "path"]


def test_a_post_training_checkpoint_leads_with_its_gain_and_its_own_curve(checkpoint_dir):
    (checkpoint_dir / "dpo_history.jsonl").write_text(
        "".join(json.dumps({"step": i, "loss": 0.7 - i / 100}) + "\n" for i in range(20))
    )
    md = checkpoint_page(
        checkpoint_dir,
        headline={"prompt_following_gain.all": 0.12},
        curve=(checkpoint_dir / "dpo_history.jsonl", "loss"),
    )
    assert list(md)[:3] == ["prompt_following_gain.all", "loss_curve", "samples"]
    assert (
        "final_loss" not in md and "tokens_per_s" not in md
    )  # the base's run, copied into the folder, is not this one's


def metrics_json(eval_dir: Path, baseline: bool = True) -> dict:
    """metrics.json as training/evaluation/evaluate.py writes it, with no distribution extractor configured."""
    unset = {m: None for m in ("fid", "cmmd", "dino_mmd")}
    metrics = {
        "checkpoint": {"step": 140, "final_loss": 0.18},
        "heldout_loss": {"mean": 0.142, "t=0.5": 0.108},
        "prompt_following": {
            "all": 0.0,
            "color": 0.42,
            "shape": 0.07,
            "count": 0.33,
            "position": 0.04,
            "background": 0.67,
        },
        "distribution": unset,
        "distribution_setup": {
            "extractors": {
                "fid": "skipped: metrics.fid_extractor is not set",
                "cmmd": "skipped: metrics.clip_extractor is not set",
                "dino_mmd": "skipped: metrics.dino_extractor is not set",
            }
        },  # fmt: skip
        "throughput": {"tokens_per_s": 412.2, "mfu": None},
    }
    if baseline:
        metrics["baseline"] = {
            "heldout_loss": {"mean": 1.388},
            "prompt_following": {
                "all": 0.0,
                "color": 0.0,
                "shape": 0.0,
                "count": 0.0,
                "position": 0.0,
                "background": 0.08,
            },
            "distribution": unset,
        }
    eval_dir.mkdir(parents=True, exist_ok=True)
    (eval_dir / "metrics.json").write_text(json.dumps(metrics))
    return metrics


def test_the_evaluation_page_leads_with_a_table_against_the_untrained_baseline_and_its_charts(tmp_path):
    from training.evaluation.protocol import history_csv, history_row

    metrics = metrics_json(tmp_path / "eval")
    (tmp_path / "eval" / "history.csv").write_text(
        history_csv([history_row({**metrics, "checkpoint": {"step": s}}) for s in (70, 140)])
    )
    md = evaluation_page(tmp_path / "eval")
    assert list(md)[0] == "vs_untrained_baseline"
    table = md["vs_untrained_baseline"].value
    assert "| held-out loss ↓ | 0.142 | 1.388 | -1.246 |" in table and len(table) < INLINE_LIMIT
    for chart in ("prompt_following_chart", "history_chart"):
        assert decode_md_png(md[chart].value).size[0] > 100


def test_a_skipped_metric_carries_its_reason(tmp_path):
    metrics_json(tmp_path / "eval")
    md = evaluation_page(tmp_path / "eval")
    assert md["fid"].value == "skipped: metrics.fid_extractor is not set"
    assert md["dino_mmd"].value == "skipped: metrics.dino_extractor is not set"
    assert "- cmmd: skipped: metrics.clip_extractor is not set" in md["vs_untrained_baseline"].value


def test_an_evaluation_without_a_baseline_says_so(tmp_path):
    metrics_json(tmp_path / "eval", baseline=False)
    md = evaluation_page(tmp_path / "eval")
    assert md["baseline"].value == "no untrained baseline recorded in metrics.json"
    assert "untrained" not in md["vs_untrained_baseline"].value.splitlines()[0]


def test_an_undecodable_reject_gets_a_placeholder_tile_and_every_reason_a_row(tmp_path):
    good, bad = tmp_path / "good.png", tmp_path / "bad.png"
    Image.fromarray(np.full((40, 40, 3), 200, np.uint8)).save(good)
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really a png")  # what the ingest stage rejects as decode_error
    rejects = Rejects("ingest")
    rejects.add("a", str(bad), "decode_error")
    rejects.add("b", str(good), "too_small", 40.0)
    rejected = rejects.table()
    grid = decode_md_png(rejects_grid(rejected, per_reason=3))
    cell = 72
    row_h = grid.height // 2  # one row per reason: decode_error, then too_small
    assert grid.size == (3 * cell, 2 * row_h)
    tile = grid.crop((0, 0, cell, cell))
    assert np.array_equal(np.asarray(tile), np.asarray(placeholder_tile(cell)))


def test_a_long_reason_label_wraps_instead_of_being_cut():
    from kiln.viz import image_grid

    tiles = [placeholder_tile(72)] * 2
    short = image_grid(tiles, cols=2, cell=72, labels=["dup", "dup"])
    long = image_grid(
        tiles, cols=2, cell=72, labels=["too_small_for_every_bucket", "dup"]
    )  # 26 characters, 12 fit a line
    assert long.height - short.height == 2 * 11  # two more lines of 11 px carry the rest of the label


@pytest.mark.slow
def test_a_real_trainer_output_makes_the_same_page_with_its_samples(tmp_path):
    """The fixture folders above mirror what the trainer writes: a real micro run gives the same key figures
    first, and its samples are drawn in memory (nothing is added to the checkpoint folder, a DVC output)."""
    from model.testing import write_tiny_text_encoder
    from training.core.trainer import train
    from training.testing import scene_rows, tiny_config, write_pack_output

    data = write_pack_output(tmp_path / "pack", scene_rows(24, seed=1, buckets=((32, 32),)))
    cfg = tiny_config(write_tiny_text_encoder(tmp_path / "te"), steps=6)
    out = train(data, tmp_path / "ckpt", cfg)
    files = sorted(p.name for p in out.iterdir())
    samples = checkpoint_samples(out, cfg, prompts=3)
    md = checkpoint_page(out, samples=samples)
    assert list(md)[: len(KEY_FIGURES)] == list(KEY_FIGURES) and "6 steps" in md["loss_curve"].value
    assert decode_md_png(samples).height >= 3 * 96  # one row per prompt
    assert sorted(p.name for p in out.iterdir()) == files
