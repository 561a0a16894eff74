"""The pack stage: bucketed, exactly sized, pre-shuffled batches; every row kept or rejected."""

from __future__ import annotations

import hashlib
import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from assets.pack import Bucket, bucket_for, buckets_for, fit_to_bucket, nearest_bucket, pack_rows
from kiln.config import load_config
from kiln.reasons import Reason
from kiln.sampling import FORMS
from kiln.schemas import REWRITTEN
from kiln.stage import read_dataset, run_stage, write_table
from kiln.trainshards import Shard, decode_image, read_manifest

# (width, height) of the test images: square, landscape, portrait, in between
SIZES = [(96, 96)] * 9 + [(192, 96)] * 5 + [(96, 192)] * 4 + [(128, 96)] * 3 + [(90, 110)] * 2


def train_set_rows(root: Path) -> list[dict]:
    """Every sample of a pack output's shards, in stream order: its metadata, packed batch and decoded pixels."""
    manifest = read_manifest(root)
    out = []
    for info in manifest.shards:
        shard = Shard(str(root), info)
        for (meta, image), batch in zip(shard.read(range(shard.rows)), shard.column("batch")):
            out.append(meta | {"batch": batch, "pixels": decode_image(image)})
    return out


def rewritten_table(paths: list[Path]) -> pa.Table:
    """REWRITTEN rows for image files, with plausible values for the columns pack does not read."""
    rows = []
    for i, p in enumerate(paths):
        id_ = hashlib.sha1(str(p).encode()).hexdigest()[:16]
        rows.append({
            "id": id_, "uri": str(p), "bytes": p.stat().st_size, "md5": hashlib.md5(p.read_bytes()).hexdigest(), "format": "PNG",
            "width": 0, "height": 0, "mode": "RGB", "exif_orientation": 1, "n_frames": 1,
            "aspect": 1.0, "laplacian_var": 300.0, "entropy": 5.5, "white_ratio": 0.0, "black_ratio": 0.0, "border_share": 0.0, "flat_share": 0.2,
            "phash": bytes(18), "colorhash": bytes(8), "dup_group": id_,
            "ocr_text": "", "ocr_boxes": "[]", "ocr_engine": "test", "contains_text": False,
            "text_area_share": 0.0, "text_density": 0.0, "text_complexity": 0.0, "min_text_height": 0.0,
            "caption": f"a picture number {i}, on a plain background", "caption_source": "test", "caption_decoding": "{}",
            "caption_short": f"picture {i}", "caption_medium": f"a picture number {i}", "caption_long": f"a picture number {i}, on a plain background",
            "caption_tags": f"picture, {i}", "caption_json": json.dumps({"subject": f"picture {i}"}), "rewrite_source": "test", "rewrite_decoding": "{}",
        })  # fmt: skip
    return pa.Table.from_pylist(rows, schema=REWRITTEN)  # source columns (nullable): none carried


@pytest.fixture
def images(tmp_path) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for i, (w, h) in enumerate(SIZES):
        p = tmp_path / "img" / f"{i:03d}.png"
        p.parent.mkdir(exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(p)
        paths.append(p)
    broken = tmp_path / "img" / "broken.png"
    broken.write_bytes(paths[0].read_bytes()[:200])
    return paths + [broken]


@pytest.mark.parametrize(
    "aspect, name", [(1.0, "32x32"), (2.0, "24x48"), (0.5, "48x24"), (1.333, "24x32"), (0.75, "32x24")]
)
def test_buckets_at_resolution_32(aspect, name):
    assert bucket_for(aspect, 32).name == name


def test_bucket_sides_are_multiples_of_8_at_about_the_target_area():
    for res in (32, 64, 256, 512):
        for b in buckets_for([0.5, 0.75, 1.0, 1.333, 2.0], res):
            assert b.height % 8 == 0 and b.width % 8 == 0
            assert 0.7 < b.height * b.width / res**2 < 1.3


def test_a_latent_models_buckets_are_whole_tokens_of_it(tmp_path):
    """The pack stage cuts buckets in whole DiT tokens: the autoencoder's downsample x model.patch_size, read
    from the VAE's config.json (here a Qwen-Image class VAE that halves, at patch 8: 16 px), never 8-px sides
    the model cannot patchify; pixel space at the demo's patch 4 keeps its 8-px sides."""
    from assets.pack import side_step
    from model.testing import write_tiny_autoencoder_qwenimage

    vae = write_tiny_autoencoder_qwenimage(tmp_path / "vae")
    latent = load_config(["model.autoencoder=kl", f"model.autoencoder_path={vae}", "model.patch_size=8"])
    assert side_step(latent) == 16 and side_step(load_config([])) == 8
    for res in (32, 64, 256):
        for b in buckets_for([0.5, 0.75, 1.0, 1.333, 2.0], res, side_step(latent)):
            assert b.height % 16 == 0 and b.width % 16 == 0, (res, b)
    assert "24x48" in {b.name for b in buckets_for([2.0], 32)}  # what an 8-px step gives and 16 px cannot


def test_the_trainer_refuses_a_train_set_packed_for_a_coarser_token_grid():
    from kiln.config import ConfigError
    from training.core.data import check_buckets

    check_buckets(["32x32", "16x48"], 16, "set")
    with pytest.raises(ConfigError, match=r"set: bucket\(s\) 24x48 are not whole tokens of this model \(16 px"):
        check_buckets(["32x32", "24x48"], 16, "set")


def test_nearest_bucket_and_centre_crop():
    buckets = buckets_for([0.5, 1.0, 2.0], 32)
    assert nearest_bucket(200, 100, buckets).name == "24x48"
    assert nearest_bucket(100, 210, buckets).name == "48x24"
    assert nearest_bucket(110, 100, buckets).name == "32x32"
    # a 3:1 picture, red | green | blue thirds, cropped into 2:1 keeps the green middle and both sides' edges
    a = np.zeros((60, 180, 3), np.uint8)
    a[:, :60, 0] = a[:, 60:120, 1] = a[:, 120:, 2] = 255
    out = np.asarray(fit_to_bucket(Image.fromarray(a), Bucket(24, 48)))
    assert out.shape == (24, 48, 3)
    assert out[12, 24, 1] > 200 and out[12, 2, 0] > 200 and out[12, 45, 2] > 200


def test_pack_stage_accounts_for_every_row_and_batches_share_a_bucket(images, tmp_path):
    write_table(rewritten_table(images), tmp_path / "rewritten" / "part-00000.parquet")
    cfg = load_config(["data.pack.batch_size=4", "cluster.workers=1"])

    summary = run_stage("pack", tmp_path / "rewritten", tmp_path / "train", cfg)

    assert (summary.input_rows, summary.kept, summary.rejected) == (len(images), len(SIZES), 1)
    assert summary.by_reason == {Reason.PACK_ERROR: 1}
    rejected = read_dataset(tmp_path / "train" / "rejected").to_pylist()
    assert rejected[0]["uri"].endswith("broken.png") and rejected[0]["detail"]
    rows = train_set_rows(tmp_path / "train")  # in stream order
    by_batch = defaultdict(list)
    for order, r in enumerate(rows):
        assert r["pixels"].shape == (r["height"], r["width"], 3) and r["bucket"] == f"{r['height']}x{r['width']}"
        by_batch[r["batch"]].append(order)
    assert sorted(by_batch) == list(range(len(by_batch)))
    for orders in by_batch.values():
        assert len({rows[k]["bucket"] for k in orders}) == 1 and len(orders) <= 4
        assert orders == list(range(orders[0], orders[0] + len(orders)))  # a batch is one contiguous run
    # only a bucket's last batch may be short, and nothing is dropped
    per_bucket = Counter(r["bucket"] for r in rows)
    assert per_bucket == {"32x32": 9, "24x48": 5, "48x24": 4, "24x32": 3, "32x24": 2}  # 90x110 is nearest 0.75
    short = Counter(rows[b[0]]["bucket"] for b in by_batch.values() if len(b) < 4)
    assert all(n <= 1 for n in short.values())


def test_pack_is_deterministic_whatever_the_input_order(images):
    cfg = load_config(["data.pack.batch_size=4"])
    table = rewritten_table(images)
    first = pack_rows(table, cfg).kept
    again = pack_rows(table.take(pa.array(range(table.num_rows - 1, -1, -1))), cfg).kept
    assert first.equals(again)
    other_seed = pack_rows(table, load_config(["data.pack.batch_size=4", "data.pack.seed=1"])).kept
    assert other_seed.column("id").to_pylist() != first.column("id").to_pylist()
    assert sorted(other_seed.column("id").to_pylist()) == sorted(first.column("id").to_pylist())


def test_every_packed_row_carries_all_caption_forms_and_the_long_caption(images):
    table = rewritten_table(images)
    kept = pack_rows(table, load_config(["data.pack.batch_size=4"])).kept
    source = {r["id"]: r for r in table.to_pylist()}
    for row in kept.to_pylist():
        src = source[row["id"]]
        assert row["caption_forms"] == json.dumps(
            {f: src[f"caption_{f}"] for f in sorted(FORMS)}, ensure_ascii=False
        )  # sorted keys: fixed bytes
        assert row["caption"] == src["caption"]
        assert row["sampling_weight"] == 1.0  # no weights file: every row weight 1


def test_weights_come_from_the_weights_file_by_id_and_a_row_it_misses_gets_one(images, tmp_path):
    table = rewritten_table(images)
    ids = sorted(
        r["id"] for r in table.to_pylist() if not r["uri"].endswith("broken.png")
    )  # ids hash the tmp path: the broken image (rejected) may sort anywhere
    named = {ids[0]: 3.0, ids[1]: 0.0, ids[2]: 0.25, "not-in-the-pool": 9.0}
    write_table(
        pa.table({"id": list(named), "concepts": ["[]"] * len(named), "sampling_weight": list(named.values())}),
        tmp_path / "weights.parquet",
    )
    cfg = load_config(
        ["data.pack.batch_size=1", f"data.pack.weights_file={tmp_path / 'weights.parquet'}"]
    )  # no remainder: every row kept

    kept = pack_rows(table, cfg).kept
    got = dict(zip(kept.column("id").to_pylist(), kept.column("sampling_weight").to_pylist()))
    assert {i: got[i] for i in ids[:3]} == {
        ids[0]: 3.0,
        ids[1]: 0.0,
        ids[2]: 0.25,
    }  # weight 0 is kept: the loader never draws it
    assert {got[i] for i in ids[3:] if i in got} == {1.0}


def test_a_weights_file_that_names_none_of_the_rows_or_a_negative_weight_is_refused(images, tmp_path):
    table = rewritten_table(images)
    for name, weights in (("other_pool", {"x": 2.0}), ("negative", {table.column("id")[0].as_py(): -1.0})):
        path = tmp_path / f"{name}.parquet"
        write_table(pa.table({"id": list(weights), "sampling_weight": list(weights.values())}), path)
        with pytest.raises(ValueError, match="names none|must be finite"):
            pack_rows(table, load_config([f"data.pack.weights_file={path}"]))


def test_the_codec_and_the_shard_size_are_settings(images, tmp_path):
    write_table(rewritten_table(images), tmp_path / "rewritten" / "part-00000.parquet")
    png = tmp_path / "png"
    run_stage("pack", tmp_path / "rewritten", png, load_config(["data.pack.batch_size=4", "cluster.workers=1"]))
    small = ["data.pack.batch_size=4", "cluster.workers=1", "data.pack.image_format=jpeg", "data.pack.shard_mb=0.002"]
    jpeg = tmp_path / "jpeg"
    run_stage("pack", tmp_path / "rewritten", jpeg, load_config(small))
    assert len(read_manifest(png).shards) == 1 and len(read_manifest(jpeg).shards) > 2
    assert read_manifest(jpeg).image_format == "jpeg" and all(
        p.suffix == ".tar" for p in (jpeg / "shards").glob("*.tar")
    )
    lossless, lossy = train_set_rows(png), train_set_rows(jpeg)
    assert [r["id"] for r in lossless] == [r["id"] for r in lossy]  # the same stream, cut into more shards
    assert any(not np.array_equal(a["pixels"], b["pixels"]) for a, b in zip(lossless, lossy))
