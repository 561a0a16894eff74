"""The demo corpus: reproducible bytes, every kind of good and bad input, and truth that matches the files."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, UnidentifiedImageError

from assets.demo_corpus import CATEGORY_COUNTS, DERIVED, write_demo_corpus
from components.demo_scenes import COLORS, FAMILIES, POSITIONS, SHAPES, Scene, caption_for, demo_prompts, render
from kiln.imageio import open_rgb
from kiln.reasons import Reason


def file_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.md5(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("demo")
    truth = write_demo_corpus(out, n=480, seed=0)
    return out, truth.to_pylist()


def rows_of(truth: list[dict], category: str) -> list[dict]:
    rows = [r for r in truth if r["category"] == category]
    assert rows, f"no {category} rows"
    return rows


def test_same_seed_gives_byte_identical_files_and_truth(tmp_path):
    write_demo_corpus(tmp_path / "a", n=120, seed=7)
    write_demo_corpus(tmp_path / "b", n=120, seed=7)
    write_demo_corpus(tmp_path / "c", n=120, seed=8)
    a, b, c = (file_hashes(tmp_path / x) for x in "abc")
    assert len(a) == 122  # 120 images + truth.parquet + demo.json
    assert a == b
    assert a != c


def test_every_category_is_present_and_about_a_fifth_is_rejected(corpus):
    _, truth = corpus
    assert len(truth) == 480
    assert {r["category"] for r in truth} == set(CATEGORY_COUNTS) | {"scene"}
    rejected = [r for r in truth if r["expected"] == "reject"]
    assert 0.2 <= len(rejected) / len(truth) <= 0.25
    assert all(r["expected_reason"] in set(Reason) for r in rejected)
    assert all(r["expected_reason"] is None for r in truth if r["expected"] == "keep")
    assert {r["family"] for r in truth if r["category"] == "scene"} == set(FAMILIES)


def test_truth_md5_and_sizes_match_the_files(corpus):
    out, truth = corpus
    on_disk = {str(p.relative_to(out / "images")) for p in (out / "images").rglob("*") if p.is_file()}
    assert on_disk == {r["file"] for r in truth}
    for r in truth:
        data = (out / "images" / r["file"]).read_bytes()
        assert hashlib.md5(data).hexdigest() == r["md5"] and len(data) == r["bytes"]
        if r["format"] and r["category"] != "truncated":
            with Image.open(io.BytesIO(data)) as im:
                assert (im.format, im.width, im.height) == (r["format"], r["width"], r["height"])


def test_broken_files_really_are_broken(corpus):
    out, truth = corpus
    read = lambda r: (out / "images" / r["file"]).read_bytes()  # noqa: E731
    assert all(read(r) == b"" for r in rows_of(truth, "zero_bytes"))
    for r in rows_of(truth, "truncated"):
        im = Image.open(io.BytesIO(read(r)))  # the header is intact ...
        with pytest.raises(OSError):
            im.load()  # ... the payload is not
    for r in rows_of(truth, "not_image"):
        with pytest.raises(UnidentifiedImageError):
            Image.open(io.BytesIO(read(r)))


def test_bad_images_fail_the_rule_they_are_labelled_with(corpus):
    out, truth = corpus
    img = lambda r: np.asarray(open_rgb((out / "images" / r["file"]).read_bytes()))  # noqa: E731
    assert all(min(img(r).shape[:2]) < 32 for r in rows_of(truth, "tiny"))
    assert all(max(img(r).shape[:2]) / min(img(r).shape[:2]) > 3 for r in rows_of(truth, "extreme_aspect"))
    for r in rows_of(truth, "few_colors"):
        assert len(np.unique(img(r).reshape(-1, 3), axis=0)) <= 3
    for r in rows_of(truth, "flat"):
        g = img(r).astype(np.float64).mean(-1)
        lap = -4 * g[1:-1, 1:-1] + g[:-2, 1:-1] + g[2:, 1:-1] + g[1:-1, :-2] + g[1:-1, 2:]
        assert lap.var() < 5 and len(np.unique(img(r).reshape(-1, 3), axis=0)) > 50
    for r in rows_of(truth, "border"):
        a = img(r).astype(int)
        h, w = a.shape[:2]
        bands = [a[: h // 8], a[-(h // 8) :]] if (a[: h // 8] == a[0, 0]).all() else [a[:, : w // 8], a[:, -(w // 8) :]]
        assert all((band == a[0, 0]).all() for band in bands)  # exactly flat bands on two opposite sides


def test_derived_files_point_at_an_earlier_original(corpus):
    out, truth = corpus
    by_file = {r["file"]: r for r in truth}
    derived = [r for r in truth if r["dup_of"] or r["variant_of"]]
    assert len(derived) == sum(CATEGORY_COUNTS[c] for c in DERIVED)
    for r in derived:
        original = by_file[r["dup_of"] or r["variant_of"]]
        assert original["file"] < r["file"] and original["expected"] == "keep"
        if r["category"] == "exact_dup":
            assert r["md5"] == original["md5"]
        elif r["dup_of"]:
            assert r["md5"] != original["md5"] and r["caption"] == original["caption"]


def test_color_variants_keep_the_layout_and_change_every_colour(corpus):
    out, truth = corpus
    by_file = {r["file"]: r for r in truth}
    for r in rows_of(truth, "color_variant"):
        original = by_file[r["variant_of"]]
        a, b = Scene.from_json(original["scene"]), Scene.from_json(r["scene"])
        assert a.layout_seed == b.layout_seed
        layout = lambda scene: [(s.shape, s.size, s.position, s.count) for s in scene.shapes]  # noqa: E731
        assert layout(a) == layout(b)
        assert not a.colors() & b.colors()
        assert r["expected"] == "keep" and r["caption"] != original["caption"]
        pa_, pb = (
            np.asarray(open_rgb((out / "images" / x["file"]).read_bytes()), dtype=np.float64) for x in (original, r)
        )
        assert pa_.shape == pb.shape
        assert np.abs(pa_.mean((0, 1)) - pb.mean((0, 1))).max() > 30  # other colours ...
        # ... same layout: where each picture departs from its own background, the other does too
        fg_a = np.abs(pa_ - np.median(pa_, (0, 1))).max(-1) > 60
        fg_b = np.abs(pb - np.median(pb, (0, 1))).max(-1) > 60
        assert (fg_a & fg_b).sum() / max((fg_a | fg_b).sum(), 1) > 0.6


def test_tricky_but_good_files_decode_to_their_scene(corpus):
    out, truth = corpus
    for r in rows_of(truth, "exif_rotated"):
        stored = Image.open(out / "images" / r["file"])
        upright = open_rgb((out / "images" / r["file"]).read_bytes())
        assert upright.size == (stored.height, stored.width)
        drawn = render(Scene.from_json(r["scene"]), *upright.size)
        assert np.abs(np.asarray(upright, float) - np.asarray(drawn, float)).mean() < 6
    for r in rows_of(truth, "wrong_extension"):
        assert r["file"].endswith(".png") and (out / "images" / r["file"]).read_bytes()[:2] == b"\xff\xd8"
    assert all(Image.open(out / "images" / r["file"]).mode == "L" for r in rows_of(truth, "greyscale"))
    assert all(Image.open(out / "images" / r["file"]).mode == "RGBA" for r in rows_of(truth, "png_alpha"))
    assert {r["format"] for r in truth if r["category"] == "scene"} == {"PNG", "JPEG", "WEBP", "BMP", "GIF", "TIFF"}
    assert all("photograph of" in r["caption"] for r in rows_of(truth, "photo"))


def test_captions_are_written_from_the_scene(corpus):
    _, truth = corpus
    for r in truth:
        if r["caption"] and r["family"] != "photo":
            assert r["caption"] == caption_for(Scene.from_json(r["scene"]))
    assert "a large red circle on the left, on a blue background" in [p.prompt for p in demo_prompts()]


def test_demo_prompts_use_the_training_vocabulary():
    prompts = demo_prompts()
    assert 8 <= len(prompts) <= 16 and len({p.prompt for p in prompts}) == len(prompts)
    for p in prompts:
        assert p.color in COLORS and p.background in COLORS and p.shape in SHAPES and p.position in POSITIONS
        assert p.prompt == caption_for(p.scene)
        assert 1 <= p.count <= 3
    assert {p.count for p in prompts} == {1, 2, 3}
    assert {p.position for p in prompts} == set(POSITIONS)
