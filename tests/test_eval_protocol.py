"""The evaluation protocol: fixed reference set per dataset version, recorded setup, distribution
metrics through real (tiny) extractors, the history across checkpoints, and shape/count checking."""

import csv
from dataclasses import replace

import numpy as np
import pytest

from components.demo_scenes import (
    BACKGROUND_COLORS,
    POSITIONS,
    SHAPE_COLORS,
    SHAPES,
    Background,
    Scene,
    Shape,
    _contrast,
    demo_prompts,
    render,
)
from kiln.config import KilnConfig, MetricsConfig
from training.core.data import dataset_version, holdout_ids
from training.core.trainer import init_generator
from training.evaluation.extractors import write_tiny_extractor
from training.evaluation.prompt_check import Expected, accuracy, check_image, expected_from_specs
from training.evaluation.protocol import (
    HISTORY_COLUMNS,
    distribution_metrics,
    evaluate_distribution,
    history_row,
    load_extractors,
    read_history,
    record,
    reference_images,
    reference_rows,
    upsert,
)
from training.testing import scene_rows, tiny_config, write_pack_output


@pytest.fixture(scope="module")
def setup(tmp_path_factory, text_encoder_dir):
    root = tmp_path_factory.mktemp("protocol")
    data = write_pack_output(root / "pack", scene_rows(30, seed=3, buckets=((32, 32), (24, 40))))
    extractors = {k: str(write_tiny_extractor(k, root / k, seed=i)) for i, k in enumerate(("backbone", "clip", "dino"))}
    return root, data, extractors, text_encoder_dir


def metrics_config(extractors, **kw):
    return MetricsConfig(
        fid_extractor=extractors["backbone"], clip_extractor=extractors["clip"], dino_extractor=extractors["dino"], **kw
    )


def test_the_reference_set_is_the_main_buckets_smallest_sha1_rows_held_out_rows_first(setup):
    _, data, _, _ = setup
    table = scene_rows(30, seed=3, buckets=((32, 32), (24, 40)))  # what `data` holds
    rows = reference_rows(data, 6, 32, 32)
    main_ids = [i for i, b in zip(table.column("id").to_pylist(), table.column("bucket").to_pylist()) if b == "32x32"]
    assert set(rows.column("bucket").to_pylist()) == {"32x32"} and rows.num_rows == 6
    assert set(rows.column("id").to_pylist()) == holdout_ids(main_ids, 6)
    assert (
        rows.column("id").to_pylist()[:3] == reference_rows(data, 3, 32, 32).column("id").to_pylist()
    )  # growing n only appends
    assert reference_images(data, 6, 32, 32).shape == (6, 32, 32, 3)


def test_the_dataset_version_follows_the_data_and_nothing_else(setup, tmp_path):
    _, data, _, _ = setup
    again = write_pack_output(tmp_path / "again", scene_rows(30, seed=3, buckets=((32, 32), (24, 40))))
    other = write_pack_output(tmp_path / "other", scene_rows(30, seed=4, buckets=((32, 32), (24, 40))))
    assert dataset_version(data) == dataset_version(again) != dataset_version(other)


def test_without_extractors_every_metric_is_reported_skipped_not_as_a_number(setup):
    _, data, _, te = setup
    cfg = tiny_config(te)
    gen = init_generator(cfg.model, 0)
    scores, info = evaluate_distribution({"trained": gen}, cfg, data, 32, 32)
    assert scores == {"trained": {"fid": None, "cmmd": None, "dino_mmd": None}}
    assert info["extractors"]["cmmd"] == "skipped: metrics.clip_extractor is not set" and info["reference_images"] == 0


def test_distribution_metrics_are_zero_against_the_reference_itself_and_positive_against_noise(setup):
    _, data, paths, _ = setup
    extractors = load_extractors(metrics_config(paths))
    ref = reference_images(data, 12, 32, 32)
    noise = np.random.default_rng(0).integers(0, 256, ref.shape, dtype=np.uint8)
    same, far = distribution_metrics(ref, ref, extractors), distribution_metrics(noise, ref, extractors)
    assert (
        same["cmmd"] == pytest.approx(0, abs=1e-6)
        and same["dino_mmd"] == pytest.approx(0, abs=1e-6)
        and same["fid"] == pytest.approx(0, abs=1e-4)
    )
    assert all(far[m] > same[m] + 1e-6 for m in ("fid", "cmmd", "dino_mmd"))


def test_generation_is_fixed_seed_and_the_setup_records_cfg_steps_seed_and_data(setup):
    _, data, paths, te = setup
    base = tiny_config(te)
    cfg = KilnConfig(
        model=base.model, train=base.train, metrics=metrics_config(paths, n_per_prompt=1, reference_images=8, seed=7)
    )
    scores, info = evaluate_distribution({"a": init_generator(cfg.model, 0)}, cfg, data, 32, 32)
    again, _ = evaluate_distribution({"a": init_generator(cfg.model, 0)}, cfg, data, 32, 32)
    other_seed = cfg.model_copy(update={"metrics": cfg.metrics.model_copy(update={"seed": 8})})
    reseeded, _ = evaluate_distribution({"a": init_generator(cfg.model, 0)}, other_seed, data, 32, 32)
    assert again == scores and all(
        v is not None and v >= 0 for v in scores["a"].values()
    )  # same checkpoint + protocol: same numbers
    assert reseeded["a"] != scores["a"]  # the seed is part of the protocol
    assert (
        info["steps"] == cfg.train.eval.steps and info["cfg_scale"] == cfg.train.sample.cfg_scale and info["seed"] == 7
    )
    assert info["prompts"] == len(demo_prompts()) and info["n_per_prompt"] == 1 and info["reference_images"] == 8
    assert info["dataset_version"] == dataset_version(data) and info["extractors"] == {
        "fid": "resnet",
        "cmmd": "clip_vision_model",
        "dino_mmd": "dinov2",
    }


def fake_metrics(step, pf, fid):
    return {
        "checkpoint": {"step": step},
        "heldout_loss": {"mean": 1.0 / step},
        "prompt_following": {"color": pf, "shape": pf, "count": pf, "position": pf, "background": pf, "all": pf},
        "distribution": {"fid": fid, "cmmd": None, "dino_mmd": None},
        "baseline": {"prompt_following": {"all": 0.1}},
        "throughput": {"samples_per_s": 25.0, "tokens_per_s": 1600.0},
    }


def test_the_history_keeps_one_row_per_step_sorted_and_survives_a_round_trip(tmp_path):
    cfg = KilnConfig(metrics=MetricsConfig(history=str(tmp_path / "kept" / "history.csv")))
    record(fake_metrics(200, 0.5, 30.0), tmp_path / "eval1", cfg)
    record(fake_metrics(100, 0.3, 40.0), tmp_path / "eval2", cfg)
    rows = record(fake_metrics(200, 0.6, 28.0), tmp_path / "eval3", cfg)  # step 200 re-evaluated: replaced
    assert [(r["step"], r["prompt_following"], r["fid"]) for r in rows] == [(100, 0.3, 40.0), (200, 0.6, 28.0)]
    assert read_history(tmp_path / "kept" / "history.csv") == rows == read_history(tmp_path / "eval3" / "history.csv")
    assert rows[0]["cmmd"] is None  # a skipped metric stays empty
    assert (
        "samples_per_s" not in rows[0]
    )  # wall-clock: in the checkpoint's throughput.json, not in a file dvc.lock pins
    with (tmp_path / "eval3" / "history.csv").open() as fh:
        assert tuple(next(csv.reader(fh))) == HISTORY_COLUMNS
    assert (tmp_path / "eval3" / "history.png").stat().st_size > 0
    assert upsert([], history_row(fake_metrics(5, 0.1, 1.0)))[0]["step"] == 5


# ------------------------------------------------------------------------------- shape and count checks
def random_scenes(n, seed):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        shape, pos, size, count = (
            SHAPES[i % 4],
            POSITIONS[rng.integers(5)],
            ("small", "large")[rng.integers(2)],
            int(rng.integers(1, 4)),
        )
        bg = BACKGROUND_COLORS[rng.integers(len(BACKGROUND_COLORS))]
        ok = [c for c in SHAPE_COLORS if _contrast(c, bg) >= 120]
        color = ok[rng.integers(len(ok))]
        scene = Scene(
            "single_shape" if count == 1 else "counted_shapes",
            Background(bg),
            (Shape(color, shape, size, pos, count),),
            layout_seed=i,
        )
        out.append((scene, Expected(color, pos, bg, shape, count, size)))
    return out


def test_count_and_shape_are_right_about_the_renderers_own_images():
    results = [check_image(np.asarray(render(s, 32, 32)), e) for s, e in random_scenes(160, seed=11)]
    assert all(r["count"] for r in results)
    shaped = [r["shape"] for r in results if "shape" in r]
    assert len(shaped) > 15 and all(shaped)


def test_wrong_counts_and_shapes_fail():
    specs = demo_prompts()
    imgs = np.stack([np.asarray(render(replace(s.scene, layout_seed=1), 32, 32)) for s in specs])[:, None]
    other_shape = {"circle": "square", "square": "triangle", "triangle": "diamond", "diamond": "circle"}
    right = expected_from_specs(specs)
    wrong_count = accuracy(imgs, [replace(e, count=e.count % 3 + 1) for e in right])
    wrong_shape = accuracy(imgs, [replace(e, shape=other_shape[e.shape]) for e in right])
    assert wrong_count["count"] == 0.0 and "shape" not in wrong_count  # a counted prompt's shape is not scored
    assert wrong_shape["shape"] == 0.0 and wrong_shape["count"] == 1.0
    assert wrong_count["color"] == wrong_count["position"] == wrong_count["background"] == 1.0


def test_shape_is_only_scored_where_the_rule_is_reliable():
    assert Expected("red", "left", "blue", "circle", 1, "large").checkable() == {"shape": True, "count": True}
    assert Expected("red", "left", "blue", "circle", 1, "small").checkable() == {"shape": False, "count": True}
    assert Expected("red", "left", "blue", "circle", 2, "large").checkable() == {"shape": False, "count": True}
    blank = np.full((32, 32, 3), 128, np.uint8)
    assert check_image(blank, Expected("red", "left", "grey", "circle", 1, "large")) == {
        "color": False,
        "position": False,
        "background": True,
        "shape": False,
        "count": False,
    }
