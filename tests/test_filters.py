"""The filter stage: one decode, every statistic, and the first failed check as the reason."""

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from samples import mixed_files, scene

from assets.decode import border_share, measure
from assets.filters import filter_stage
from assets.ingest import ingest, list_inputs
from kiln.config import load_config
from kiln.stage import check_accounting, read_dataset, run_stage


def png(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a.astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def stats_of(a: np.ndarray):
    return measure(png(a), a.shape[1], a.shape[0], 0, 256, 128)


def test_mixed_real_world_files_all_accounted_for(mixed_folder):
    cfg = load_config()
    manifest = ingest(list_inputs(mixed_folder), cfg)
    out = filter_stage(manifest.kept, cfg)
    check_accounting("filter", manifest.kept, out)
    got = {r["uri"][len(mixed_folder.as_posix()) + 1 :]: r["reason"] for r in out.rejected.to_pylist()}
    expected = {
        name: reason
        for name, (_, reason) in mixed_files().items()
        if reason and reason not in ("empty_file", "not_an_image")
    }
    assert got == expected
    kept = {Path(u).name for u in out.kept.column("uri").to_pylist()}
    assert {"deep.png", "print.jpg", "anim.gif", "alpha.png", "really_a_jpeg.png", "rotated.jpg"} <= kept


def test_each_statistic_rejects_with_its_measured_value():
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:128, 0:128]
    good = np.asarray(scene(0, 128))
    cases = {
        "too_white": np.full((128, 128, 3), 255),
        "too_black": np.zeros((128, 128, 3)),
        "low_laplacian": np.stack([xx, yy, 255 - xx], -1),  # a smooth wash, full histogram
        "low_entropy": np.where(((xx // 16 + yy // 16) % 2)[..., None] == 1, 120, 160) * np.ones(3),
        "high_laplacian": rng.integers(0, 256, (128, 128, 3)),
    }
    boxed = good.copy()
    boxed[:40], boxed[-40:] = 0, 0  # letterbox: 62% of the height is black bars
    cases["border"] = boxed
    cfg = load_config()
    from assets.filters import stats_failure

    for reason, a in cases.items():
        failed = stats_failure(stats_of(a), cfg.data.filters)
        assert failed is not None and failed[0] == reason, (reason, failed)
    assert stats_failure(stats_of(good), cfg.data.filters) is None


def test_border_share_measures_flat_bands_at_the_edges():
    a = np.asarray(scene(1, 128)).copy()
    assert border_share(a) == 0.0
    a[:, :32] = 255  # a white band a quarter of the width
    assert border_share(a) == pytest.approx(0.25, abs=0.02)


def test_header_checks_run_before_any_read(tmp_path):
    cfg = load_config(["data.filters.max_pixels=10000"])
    row = {
        "id": "x",
        "uri": str(tmp_path / "never-read.jpg"),
        "bytes": 1,
        "md5": "",
        "format": "JPEG",
        "width": 200,
        "height": 200,
        "mode": "RGB",
        "exif_orientation": 0,
        "n_frames": 1,
    }
    from assets.filters import filter_row

    assert filter_row(row, cfg.data.filters)[1][0] == "too_many_pixels"
    assert filter_row({**row, "width": 20, "height": 20}, cfg.data.filters)[1][0] == "too_small"
    assert filter_row({**row, "width": 90, "height": 20}, cfg.data.filters)[1][0] == "too_small"
    assert filter_row({**row, "width": 100, "height": 33}, cfg.data.filters)[1][0] == "bad_aspect"
    assert filter_row({**row, "format": "ICNS"}, cfg.data.filters)[1][0] == "unsupported_format"


def reason_scores(truth: list[dict], rejected: dict[str, dict], kept: dict[str, str]) -> dict[str, tuple[float, float]]:
    """(precision, recall) per expected reject reason, "kept" included for the good files.

    Duplicate pairs are scored group-wise: keeping the copy and rejecting the original is right when the
    original points at the kept copy with the expected reason, and a good file rejected as a duplicate of
    one of its own copies is right too."""
    got = {}
    for t in truth:
        f, reason = t["file"], t["expected_reason"] or "kept"
        g = rejected.get(f, {}).get("reason") or "kept"
        original = rejected.get(t["dup_of"] or "", {})
        if t["dup_of"] and f in kept and original.get("detail") == kept[f] and original.get("reason") == reason:
            g = reason
        if (
            reason == "kept"
            and g in ("exact_duplicate", "near_duplicate")
            and rejected[f]["detail"] in {kept.get(u["file"]) for u in truth if u["dup_of"] == f}
        ):
            g = reason
        got[f] = g
    scores = {}
    for reason in {t["expected_reason"] or "kept" for t in truth} | set(got.values()):
        expected = {t["file"] for t in truth if (t["expected_reason"] or "kept") == reason}
        predicted = {f for f, g in got.items() if g == reason}
        hit = len(expected & predicted)
        scores[reason] = (hit / len(predicted) if predicted else 1.0, hit / len(expected) if expected else 1.0)
    return scores


def run_demo_curation(tmp_path, seed: int):
    """`kiln demo-data --n 480 --seed <seed>` through ingest -> filter -> dedup: (truth, rejected by file, kept file -> id)."""
    from assets.demo_corpus import write_demo_corpus

    cfg = load_config()
    truth = write_demo_corpus(tmp_path / "demo", n=480, seed=seed, size=cfg.data.demo.size).to_pylist()
    run_stage("ingest", tmp_path / "demo" / "images", tmp_path / "m", cfg)
    run_stage("filter", tmp_path / "m", tmp_path / "f", cfg)
    run_stage("dedup", tmp_path / "f", tmp_path / "d", cfg)
    prefix = (tmp_path / "demo" / "images").as_posix() + "/"
    rejected = {}
    for stage in "mfd":
        rejected.update({r["uri"][len(prefix) :]: r for r in read_dataset(tmp_path / stage / "rejected").to_pylist()})
    kept = {r["uri"][len(prefix) :]: r["id"] for r in read_dataset(tmp_path / "d" / "kept").to_pylist()}
    assert len(kept) + len(rejected) == len(truth)  # nothing lost
    return truth, rejected, kept


# The thresholds were tuned on seed 0 (docs/curation.md), so they are tested on corpora they never saw, with the
# tolerances docs/curation.md states: every filter reason exact; the duplicate reasons and the good files may
# lose a little to look-alike scenes (seed 2: three merged, one 34-bit crop missed).
DUPLICATE_TOLERANCE = 0.85  # precision and recall of near/exact duplicates and of keeping good files
HELD_OUT_SEEDS = [1, 2]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("seed", HELD_OUT_SEEDS)
def test_demo_corpus_reasons_on_held_out_seeds_meet_the_documented_tolerances(tmp_path, seed):
    truth, rejected, kept = run_demo_curation(tmp_path, seed)
    scores = reason_scores(truth, rejected, kept)
    print(seed, scores)
    duplicate_like = {"exact_duplicate", "near_duplicate", "kept"}
    filter_misses = {r: s for r, s in scores.items() if r not in duplicate_like and s != (1.0, 1.0)}
    assert filter_misses == {}
    dup_misses = {r: s for r, s in scores.items() if r in duplicate_like and min(s) < DUPLICATE_TOLERANCE}
    assert dup_misses == {}
    assert len(scores) >= 12  # the 11 reasons and "kept": a corpus without some category proves nothing about it
