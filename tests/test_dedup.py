"""Dedup: exact by md5, near by pHash AND colour hash, exact search without all pairs, one keeper per group."""

import io

import numpy as np
import pytest
from PIL import Image, ImageOps
from samples import scene

from assets.dedup import dedup, find_groups, groups_table, keepers, near_pairs
from assets.filters import filter_stage
from assets.hashes import hamming_rows, mirror_phash, to_words
from assets.ingest import ingest, list_inputs
from kiln.config import load_config
from kiln.schemas import FILTERED
from kiln.stage import check_accounting, read_dataset, run_stage


def flip(h: np.ndarray, k: int, rng) -> np.ndarray:
    out = np.unpackbits(h)
    out[rng.choice(len(out), k, replace=False)] ^= 1
    return np.packbits(out)


def brute_force(phash, color, rp, rc):
    pw, cw = to_words(phash, 18), to_words(color, 8)
    i, j = np.triu_indices(len(phash), 1)
    ok = (hamming_rows(pw[i], pw[j]) <= rp) & (hamming_rows(cw[i], cw[j]) <= rc)
    return np.stack([i[ok], j[ok]], 1)


@pytest.mark.parametrize("radius,bands", [(12, 7), (12, 16), (32, 11), (5, 3)])
def test_band_search_finds_every_planted_pair_like_brute_force(radius, bands):
    rng = np.random.default_rng(radius)
    n = 1500
    phash = rng.integers(0, 256, (n, 18), dtype=np.uint8)
    color = rng.integers(0, 256, (n, 8), dtype=np.uint8)
    for a in range(0, 300, 2):  # plant pairs at every distance up to radius + 2
        phash[a + 1] = flip(phash[a], a // 2 % (radius + 3), rng)
        color[a + 1] = color[a]
    found = near_pairs(phash, color, radius, 0, bands)
    assert np.array_equal(found, brute_force(phash, color, radius, 0))
    assert len(found) >= 150 * (radius + 1) // (radius + 3)


@pytest.mark.parametrize("radius,bands", [(16, 6), (12, 7), (5, 3)])
def test_mirror_search_finds_every_pair_within_the_radius_of_the_hash_or_its_mirror(radius, bands):
    rng = np.random.default_rng(100 + radius)
    n = 1200
    phash = rng.integers(0, 256, (n, 18), dtype=np.uint8)
    color = np.zeros((n, 8), np.uint8)
    for a in range(0, 300, 2):  # planted flipped copies at every distance up to radius + 2
        phash[a + 1] = flip(mirror_phash(phash[a]), a // 2 % (radius + 3), rng)
    pw, mw = to_words(phash, 18), to_words(mirror_phash(phash), 18)
    i, j = np.triu_indices(n, 1)
    d = np.minimum(hamming_rows(pw[i], pw[j]), hamming_rows(mw[i], pw[j]))
    expected = np.stack([i[d <= radius], j[d <= radius]], 1)
    found = near_pairs(phash, color, radius, 0, bands, mirror=True)
    assert np.array_equal(found, expected)
    assert len(found) >= 150 * (radius + 1) // (radius + 3)
    assert np.array_equal(
        near_pairs(phash, color, radius, 0, bands), brute_force(phash, color, radius, 0)
    )  # off: unchanged


def test_keeper_is_largest_then_least_compressed_then_smallest_id():
    labels = np.array([0, 0, 0, 1, 1, 2])
    pixels = np.array([100, 400, 400, 50, 50, 9])
    sizes = np.array([10, 20, 30, 7, 7, 1])
    ids = np.array(["a", "b", "c", "e", "d", "f"])
    assert keepers(labels, pixels, sizes, ids).tolist() == [2, 2, 2, 4, 4, 5]


def jpeg(im, q=90):
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=q)
    return buf.getvalue()


@pytest.fixture
def dup_folder(tmp_path):
    """Originals, an exact copy, resized / recompressed / cropped copies, and a colour variant."""
    root = tmp_path / "raw"
    root.mkdir()
    files = {f"orig{i}.jpg": jpeg(scene(20 + i, 200)) for i in range(4)}
    files["copy_of_0.jpg"] = files["orig0.jpg"]
    files["smaller_1.jpg"] = jpeg(scene(21, 200).resize((150, 150), Image.Resampling.LANCZOS))
    files["recompressed_2.jpg"] = jpeg(scene(22, 200), 40)
    files["cropped_3.jpg"] = jpeg(scene(23, 200).crop((3, 2, 197, 196)))
    h, s, v = scene(20, 200).convert("HSV").split()
    files["variant_of_0.jpg"] = jpeg(Image.merge("HSV", (h.point(lambda x: (x + 100) % 256), s, v)).convert("RGB"))
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root


def run_all(folder, tmp_path, overrides=()):
    cfg = load_config(list(overrides))
    for stage, src, dst in (("ingest", folder, "m"), ("filter", tmp_path / "m", "f"), ("dedup", tmp_path / "f", "d")):
        run_stage(stage, src, tmp_path / dst, cfg)
    return read_dataset(tmp_path / "d" / "kept"), read_dataset(tmp_path / "d" / "rejected")


def test_near_duplicates_found_colour_variants_kept(dup_folder, tmp_path):
    kept, rejected = run_all(dup_folder, tmp_path)
    name = {r["id"]: r["uri"].rsplit("/", 1)[1] for r in kept.to_pylist() + rejected.to_pylist()}
    got = {name[r["id"]]: (r["reason"], name[r["detail"]]) for r in rejected.to_pylist()}
    assert got["smaller_1.jpg"] == ("near_duplicate", "orig1.jpg")  # the larger one stays
    assert got["recompressed_2.jpg"] == ("near_duplicate", "orig2.jpg")  # same size: the bigger file stays
    assert got["cropped_3.jpg"] == ("near_duplicate", "orig3.jpg")
    assert {k for k, v in got.items() if v[0] == "exact_duplicate"} | {
        v[1] for v in got.values() if v[0] == "exact_duplicate"
    } == {
        "orig0.jpg",
        "copy_of_0.jpg",
    }
    assert "variant_of_0.jpg" in {name[i] for i in kept.column("id").to_pylist()}
    assert len(got) == 4 and kept.num_rows == 5

    groups = groups_table(kept, rejected)
    assert groups.num_rows == 8  # four groups of two
    assert groups.column("role").to_pylist()[::2] == ["keeper"] * 4


def test_mirror_groups_a_flipped_copy_with_its_original(dup_folder, tmp_path):
    (dup_folder / "mirrored_2.jpg").write_bytes(
        jpeg(ImageOps.mirror(scene(22, 200)).resize((180, 180), Image.Resampling.LANCZOS))
    )
    cfg = load_config()
    filtered = filter_stage(ingest(list_inputs(dup_folder), cfg).kept, cfg).kept
    names = [u.rsplit("/", 1)[1] for u in filtered.column("uri").to_pylist()]
    m, o = names.index("mirrored_2.jpg"), names.index("orig2.jpg")
    d = cfg.data.dedup
    off = find_groups(filtered, d.phash_radius, d.color_radius, d.bands)
    on = find_groups(filtered, d.phash_radius, d.color_radius, d.bands, mirror=True)
    assert off.keeper[m] == m and off.distance[m] == 0  # the plain pHash does not see it
    assert on.keeper[m] == o and on.distance[m] <= d.phash_radius  # the larger original stays; mirrored distance
    kept_off = set(np.flatnonzero(off.keeper == np.arange(len(names))).tolist()) - {m}
    assert kept_off == set(np.flatnonzero(on.keeper == np.arange(len(names))).tolist())  # nothing else changes


def test_dedup_output_is_byte_identical_across_runs(dup_folder, tmp_path):
    run_all(dup_folder, tmp_path / "one")
    run_all(dup_folder, tmp_path / "two")
    for sub in ("kept/part-00000.parquet", "rejected/part-00000.parquet"):
        assert (tmp_path / "one/d" / sub).read_bytes() == (tmp_path / "two/d" / sub).read_bytes()


def test_mixed_folder_goes_through_all_three_stages_with_every_file_accounted(mixed_folder):
    cfg = load_config()
    listed = list_inputs(mixed_folder)
    m = ingest(listed, cfg)
    f = filter_stage(m.kept, cfg)
    d = dedup(f.kept, cfg)
    check_accounting("dedup", f.kept, d)
    ids = set(listed.column("id").to_pylist())
    out = (
        m.rejected.column("id").to_pylist() + f.rejected.column("id").to_pylist() + d.rejected.column("id").to_pylist()
    )
    assert sorted(out + d.kept.column("id").to_pylist()) == sorted(ids)


def test_empty_input_is_an_empty_output():
    out = dedup(FILTERED.empty_table(), load_config())
    assert out.kept.num_rows == 0 and out.rejected.num_rows == 0
    assert groups_table(out.kept, out.rejected).num_rows == 0
