"""Sampling a checkpoint to a grid + Parquet, and the first evaluation's metrics.json."""

import io
import json

import pyarrow.parquet as pq
import pytest
from PIL import Image

from components.demo_scenes import demo_prompts
from model.testing import write_tiny_text_encoder
from training.core.trainer import train
from training.evaluation.evaluate import evaluate
from training.evaluation.sampling import SAMPLES, sample_to_dir
from training.testing import scene_rows, tiny_config, write_pack_output


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("sample_eval")
    te = write_tiny_text_encoder(root / "text_encoder")
    data = write_pack_output(root / "pack", scene_rows(40, seed=2, buckets=((24, 40), (32, 32), (32, 32))))
    cfg = tiny_config(te, steps=20)
    return train(data, root / "ckpt", cfg), data, cfg


def test_samples_come_as_a_labelled_grid_and_a_parquet_of_pngs_at_the_training_resolution(trained, tmp_path):
    ckpt, _, cfg = trained
    grid = sample_to_dir(ckpt, tmp_path, cfg)
    n, p = cfg.train.sample.n_per_prompt, len(demo_prompts())
    table = pq.read_table(tmp_path / "samples.parquet")
    assert table.schema.equals(SAMPLES) and table.num_rows == n * p
    assert table.column("index").to_pylist() == list(range(n * p))
    assert table.column("prompt").to_pylist()[:n] == [demo_prompts()[0].prompt] * n
    assert {Image.open(io.BytesIO(b)).size for b in table.column("png").to_pylist()} == {(32, 32)}  # the main bucket
    im = Image.open(grid)
    assert im.height >= p * 96 and im.width >= n * 96  # one row per prompt, 32 px cells upscaled to 96


def test_sampling_is_deterministic_and_takes_a_prompts_file(trained, tmp_path):
    ckpt, _, cfg = trained
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        "# two prompts\na large red circle on the left, on a blue background\n\na small white square at the top, on a black background\n"
    )
    sample_to_dir(ckpt, tmp_path / "one", cfg, prompts=str(prompts))
    sample_to_dir(ckpt, tmp_path / "two", cfg, prompts=str(prompts))
    assert (tmp_path / "one" / "samples.parquet").read_bytes() == (tmp_path / "two" / "samples.parquet").read_bytes()
    assert pq.read_table(tmp_path / "one" / "samples.parquet").num_rows == 2 * cfg.train.sample.n_per_prompt


def test_evaluation_reports_held_out_loss_prompt_following_baseline_and_throughput(trained, tmp_path):
    ckpt, data, cfg = trained
    metrics = evaluate(ckpt, data, tmp_path, cfg)
    # the wall-clock throughput sits beside metrics.json, outside DVC's hashes (.dvcignore), so a rerun pins the same file
    assert (
        json.loads((tmp_path / "metrics.json").read_text())
        | {"throughput": json.loads((tmp_path / "throughput.json").read_text())}
        == metrics
    )
    assert "throughput" not in json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["heldout"] == {
        "rows": 8,
        "held_out": True,
        "timesteps": cfg.train.eval.loss_timesteps,
        "seed": cfg.train.eval.seed,
    }
    for scores in (metrics, metrics["baseline"]):
        assert set(scores["heldout_loss"]) == {f"t={t:g}" for t in cfg.train.eval.loss_timesteps} | {"mean"}
        assert set(scores["prompt_following"]) == {"color", "shape", "count", "position", "background", "all"}
        assert all(0.0 <= v <= 1.0 for v in scores["prompt_following"].values())
    assert metrics["heldout_loss"]["mean"] < metrics["baseline"]["heldout_loss"]["mean"]
    assert metrics["throughput"]["samples_per_s"] > 0 and metrics["checkpoint"]["step"] == 20
    assert (tmp_path / "eval_samples.png").is_file()

    again = evaluate(ckpt, data, tmp_path / "again", cfg)
    assert again["heldout_loss"] == metrics["heldout_loss"] and again["prompt_following"] == metrics["prompt_following"]
