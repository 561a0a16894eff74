"""The filter stage: one decode, every statistic, and the first failed check as the reason."""

import io
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
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
    expected = {name: reason for name, (_, reason) in mixed_files().items() if reason and reason not in ("empty_file", "not_an_image")}
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
    row = {"id": "x", "uri": str(tmp_path / "never-read.jpg"), "bytes": 1, "md5": "", "format": "JPEG",
           "width": 200, "height": 200, "mode": "RGB", "exif_orientation": 0, "n_frames": 1}
    from assets.filters import filter_row

    assert filter_row(row, cfg.data.filters)[1][0] == "too_many_pixels"
    assert filter_row({**row, "width": 20, "height": 20}, cfg.data.filters)[1][0] == "too_small"
    assert filter_row({**row, "width": 90, "height": 20}, cfg.data.filters)[1][0] == "too_small"
    assert filter_row({**row, "width": 100, "height": 33}, cfg.data.filters)[1][0] == "bad_aspect"
    assert filter_row({**row, "format": "ICNS"}, cfg.data.filters)[1][0] == "unsupported_format"


@pytest.mark.integration
def test_demo_corpus_gets_every_expected_reason(tmp_path):
    """Ingest -> filter -> dedup on `kiln demo-data --n 480`: each bad file gets its reason, no good file is lost."""
    from assets.demo_corpus import write_demo_corpus

    cfg = load_config()
    truth = write_demo_corpus(tmp_path / "demo", n=480, seed=0, size=cfg.data.demo.size).to_pylist()
    run_stage("ingest", tmp_path / "demo" / "images", tmp_path / "m", cfg)
    run_stage("filter", tmp_path / "m", tmp_path / "f", cfg)
    run_stage("dedup", tmp_path / "f", tmp_path / "d", cfg)
    prefix = (tmp_path / "demo" / "images").as_posix() + "/"
    rejected = {}
    for stage in "mfd":
        rejected.update({r["uri"][len(prefix) :]: r for r in read_dataset(tmp_path / stage / "rejected").to_pylist()})
    kept = {r["uri"][len(prefix) :]: r["id"] for r in read_dataset(tmp_path / "d" / "kept").to_pylist()}
    assert len(kept) + len(rejected) == len(truth)
    wrong = []
    for t in truth:
        f, reason = t["file"], t["expected_reason"]
        got = rejected.get(f, {}).get("reason")
        if got == reason:
            continue
        # a duplicate pair may keep the copy instead of the original: fine if the original points at it
        original = rejected.get(t["dup_of"] or "", {})
        if t["dup_of"] and f in kept and original.get("detail") == kept[f] and original.get("reason") == reason:
            continue
        if not reason and got in ("exact_duplicate", "near_duplicate") and rejected[f]["detail"] in {
            kept.get(u["file"]) for u in truth if u["dup_of"] == f
        }:
            continue
        wrong.append((f, t["category"], reason, got))
    assert wrong == []
    assert pq.read_table(tmp_path / "f" / "kept").num_rows > 300
