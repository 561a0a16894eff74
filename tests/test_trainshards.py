"""The train set's shard format (kiln.trainshards): WebDataset tars any reader streams, an index beside each
that turns a rank's rows into ranged reads, locally or from S3, and a manifest whose sha256 is the set's version.
A shard that is missing, truncated or changed is named, never read as if it were whole."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from kiln.trainshards import (
    MANIFEST,
    Sample,
    Shard,
    ShardError,
    decode_image,
    encode_image,
    manifest_version,
    read_manifest,
    verify_shard,
    write_train_set,
)


def samples(n: int = 23, per_batch: int = 4, side: int = 16) -> list[Sample]:
    """`n` samples in stream order, packed `per_batch` to a batch, alternating two buckets by batch."""
    rng = np.random.default_rng(0)
    out = []
    for k in range(n):
        batch = k // per_batch
        h, w = (side, side) if batch % 2 == 0 else (side // 2, side * 2)
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        forms = json.dumps({"long": f"caption {k}", "short": f"c{k}"}, sort_keys=True)
        out.append(
            Sample(
                f"id{k:03d}",
                f"caption {k}",
                forms,
                1.0 + (k % 3 == 0),
                f"{h}x{w}",
                h,
                w,
                encode_image(pixels, "png"),
                batch,
            )
        )
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("set")
    return root, write_train_set(samples(), root, "png", shard_bytes=3_000)


def digests(root) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_shards_are_cut_between_packed_batches_at_about_the_shard_size(written):
    root, manifest = written
    assert len(manifest.shards) >= 3 and manifest.rows == 23 and sum(s.rows for s in manifest.shards) == 23
    batches = [Shard(str(root), info).column("batch") for info in manifest.shards]
    assert all(not set(a) & set(b) for a, b in zip(batches, batches[1:]))  # no batch is split
    assert manifest.buckets == {"16x16": 12, "8x32": 11} and manifest.weighted
    assert read_manifest(root) == manifest


def test_the_same_rows_and_settings_write_the_same_bytes(written, tmp_path):
    root, manifest = written
    write_train_set(samples(), tmp_path, "png", shard_bytes=3_000)
    assert digests(tmp_path) == digests(root)  # what `dvc repro` needs of the pack stage
    assert (
        manifest_version(tmp_path)
        == manifest_version(root)
        == hashlib.sha256((root / MANIFEST).read_bytes()).hexdigest()
    )
    other = tmp_path / "other"
    write_train_set(samples()[:-1], other, "png", shard_bytes=3_000)
    assert manifest_version(other) != manifest_version(root)


def test_any_webdataset_reader_streams_the_shards_as_written(written):
    import webdataset as wds

    root, manifest = written
    urls = [str(root / s.tar) for s in manifest.shards]
    got = list(wds.WebDataset(urls, shardshuffle=False, empty_check=False))
    want = samples()
    assert [json.loads(g["json"])["id"] for g in got] == [s.id for s in want]
    assert all(g["png"] == s.image for g, s in zip(got, want))
    assert json.loads(got[5]["json"]) | {"crop": [0, 0]} == json.loads(want[5].meta())


def test_the_index_reads_any_rows_in_any_order_with_their_images(written):
    root, manifest = written
    shard = Shard(str(root), manifest.shards[1])
    ids = shard.column("id")
    rows = [2, 0, 2, 1]  # a weighted epoch may draw a row twice
    got = shard.read(rows)
    by_id = {s.id: s for s in samples()}
    assert [meta["id"] for meta, _ in got] == [ids[r] for r in rows]
    for meta, image in got:
        assert image == by_id[meta["id"]].image and meta["caption_forms"] == by_id[meta["id"]].caption_forms
        assert decode_image(image).shape == (meta["height"], meta["width"], 3)


@pytest.mark.parametrize("fmt", ["png", "webp"])
def test_the_default_codecs_are_lossless(fmt):
    pixels = np.random.default_rng(1).integers(0, 256, (24, 40, 3), dtype=np.uint8)
    assert np.array_equal(decode_image(encode_image(pixels, fmt)), pixels)


def test_jpeg_is_lossy_at_its_quality_setting():
    pixels = np.random.default_rng(1).integers(0, 256, (24, 40, 3), dtype=np.uint8)
    high, low = encode_image(pixels, "jpeg", 95), encode_image(pixels, "jpeg", 20)
    assert len(low) < len(high) and not np.array_equal(decode_image(high), pixels)


def copy_set(root, dst):
    import shutil

    shutil.copytree(root, dst)
    return dst


def test_a_missing_shard_is_named(written, tmp_path):
    root, manifest = written
    bad = copy_set(root, tmp_path / "set")
    (bad / manifest.shards[1].tar).unlink()
    with pytest.raises(ShardError, match=r"shard-000001\.tar: missing"):
        Shard(str(bad), manifest.shards[1])


def test_a_truncated_shard_is_named_before_anything_is_read(written, tmp_path):
    root, manifest = written
    bad = copy_set(root, tmp_path / "set")
    path = bad / manifest.shards[0].tar
    path.write_bytes(path.read_bytes()[:-700])
    with pytest.raises(ShardError, match=r"shard-000000\.tar: .* bytes, the manifest lists .*truncated"):
        Shard(str(bad), manifest.shards[0])


def test_a_member_changed_in_place_stops_the_read_and_the_full_check_finds_it(written, tmp_path):
    root, manifest = written
    bad = copy_set(root, tmp_path / "set")
    shard = Shard(str(bad), manifest.shards[0])
    offset = shard.columns["image_offset"][1]
    path = bad / manifest.shards[0].tar
    data = bytearray(path.read_bytes())
    data[offset + 40] ^= 0xFF  # same size: only the bytes differ
    path.write_bytes(bytes(data))
    assert len(shard.read([0])) == 1  # other members still read
    with pytest.raises(ShardError, match=r"shard-000000\.tar: the member at byte .* changed"):
        shard.read([1])
    with pytest.raises(ShardError, match="sha256"):
        verify_shard(str(bad), manifest.shards[0])
    verify_shard(str(root), manifest.shards[0])  # the intact copy passes


def test_an_index_changed_since_the_manifest_is_refused(written, tmp_path):
    root, manifest = written
    bad = copy_set(root, tmp_path / "set")
    other = write_train_set(samples()[4:8], tmp_path / "other", "png", shard_bytes=3_000)  # another batch
    (bad / manifest.shards[0].index).write_bytes((tmp_path / "other" / other.shards[0].index).read_bytes())
    with pytest.raises(ShardError, match=r"index\.parquet: changed"):
        Shard(str(bad), manifest.shards[0])


@pytest.mark.s3
def test_rows_stream_from_s3_by_ranged_reads(written, s3):
    root, manifest = written
    s3.create_bucket(Bucket="trainsets")
    for p in root.rglob("*"):
        if p.is_file():
            s3.put_object(Bucket="trainsets", Key=f"pretrain/{p.relative_to(root)}", Body=p.read_bytes())
    remote = "s3://trainsets/pretrain"
    assert read_manifest(remote) == manifest and manifest_version(remote) == manifest_version(root)
    local, there = Shard(str(root), manifest.shards[2]), Shard(remote, manifest.shards[2])
    assert there.read([1, 0]) == local.read([1, 0])
    s3.put_object(Bucket="trainsets", Key=f"pretrain/{manifest.shards[2].tar}", Body=b"short")
    with pytest.raises(ShardError, match=r"s3://trainsets/pretrain/shards/shard-000002\.tar: 5 bytes"):
        Shard(remote, manifest.shards[2])
