"""The filter stage's fast paths give the same bits as the plain definitions they replace.

assets/decode.py and assets/hashes.py compute some statistics by shortcuts (a band scan that stops at the
first line that is not part of a band, PIL's C histogram, per-value lookup tables for the colour hash).
Each test here writes the plain, slow definition out and checks that the shortcut agrees exactly on
generated images, including the hostile corners (bands reaching the middle, one-pixel images, flat colours).
"""

from __future__ import annotations

import numpy as np
from PIL import Image
from samples import encoded, scene

from assets.decode import (
    BORDER_ROW_SHARE,
    BORDER_TOL,
    FLAT_BLOCK,
    FLAT_STD,
    _median_colour,
    border_share,
    decode_views,
    flat_share,
    grey_of,
    rgb_entropy,
)
from assets.hashes import DARK_V, GREY_S, SOFT, colorhash64


# ------------------------------------------------------------------------------- plain definitions
def band_depth_plain(lines: np.ndarray) -> int:
    """Every line of the first half tested; the depth is the first one that is not a band line."""
    half = lines[: len(lines) // 2 + 1].astype(np.float32)
    edge = np.median(half[0], axis=0)
    dev = np.abs(half - edge)
    flat = (dev.max(axis=2) <= BORDER_TOL).mean(axis=1) >= BORDER_ROW_SHARE
    depth = int(np.argmin(flat)) if not flat.all() else len(flat)
    return min(depth, len(lines) // 2)


def border_share_plain(rgb: np.ndarray) -> float:
    h, w = rgb.shape[:2]
    t = rgb.transpose(1, 0, 2)
    top, bottom, left, right = (
        band_depth_plain(rgb),
        band_depth_plain(rgb[::-1]),
        band_depth_plain(t),
        band_depth_plain(t[::-1]),
    )
    return 1.0 - max(h - top - bottom, 0) * max(w - left - right, 0) / (h * w)


def entropy_plain(rgb: np.ndarray) -> float:
    flat = rgb.reshape(-1, 3).astype(np.int64) + np.array([0, 256, 512])
    counts = np.bincount(flat.ravel(), minlength=768).reshape(3, 256).astype(np.float64)
    p = counts / counts.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        return float((-np.where(p > 0, p * np.log2(p), 0.0).sum(axis=1)).mean())


def flat_share_plain(grey: np.ndarray) -> float:
    """Each whole block's standard deviation, compared with the threshold."""
    h, w = (s - s % FLAT_BLOCK for s in grey.shape)
    blocks = grey[:h, :w].reshape(h // FLAT_BLOCK, FLAT_BLOCK, w // FLAT_BLOCK, FLAT_BLOCK)
    return float((blocks.std(axis=(1, 3)) < FLAT_STD).mean())


def colorhash_plain(hsv: np.ndarray) -> bytes:
    """The colour hash computed pixel by pixel in float32, no lookup tables."""
    h = hsv[..., 0].ravel().astype(np.float32) * (6.0 / 255.0)
    s = hsv[..., 1].ravel().astype(np.float32) / 255.0
    v = hsv[..., 2].ravel().astype(np.float32) / 255.0
    dark = np.clip((DARK_V - v) / SOFT + 0.5, 0.0, 1.0)
    grey = (1.0 - dark) * np.clip((GREY_S - s) / SOFT + 0.5, 0.0, 1.0)
    colourful = 1.0 - dark - grey
    lo = np.floor(h - 0.5)
    frac = (h - 0.5) - lo
    lo_bin = lo.astype(np.int64) % 6
    hue = np.bincount(lo_bin, weights=colourful * (1.0 - frac), minlength=6) + np.bincount(
        (lo_bin + 1) % 6, weights=colourful * frac, minlength=6
    )
    shares = np.concatenate([[dark.sum(), grey.sum()], hue]) / max(h.size, 1)
    levels = np.clip(np.rint(np.cbrt(shares) * 8), 0, 8).astype(np.int64)
    return np.packbits((np.arange(8)[None, :] < levels[:, None]).ravel()).tobytes()


# -------------------------------------------------------------------------------------- generators
def banded(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Noise or a gradient with flat bands of random depth and colour on random sides (some reaching the middle)."""
    a = (
        rng.integers(0, 256, (h, w, 3)).astype(np.uint8)
        if rng.random() < 0.5
        else np.broadcast_to(np.linspace(0, 255, w, dtype=np.float32)[None, :, None], (h, w, 3)).astype(np.uint8).copy()
    )
    colour = rng.integers(0, 256, 3)
    for side in range(4):
        if rng.random() < 0.6:
            depth = int(rng.integers(0, (h if side < 2 else w) + 1))
            jitter = rng.integers(-BORDER_TOL - 2, BORDER_TOL + 3, (depth, w if side < 2 else h, 3))
            band = np.clip(colour + jitter * (rng.random() < 0.5), 0, 255).astype(np.uint8)
            if side == 0:
                a[:depth] = band
            elif side == 1:
                a[h - depth :] = band
            elif side == 2:
                a[:, :depth] = band.transpose(1, 0, 2)
            else:
                a[:, w - depth :] = band.transpose(1, 0, 2)
    return a


# ------------------------------------------------------------------------------------------- tests
def test_the_band_scan_stops_early_but_measures_what_scanning_every_line_measures():
    rng = np.random.default_rng(0)
    shapes = (
        [(128, 128)] * 300
        + [(int(rng.integers(1, 40)), int(rng.integers(1, 40))) for _ in range(200)]
        + [(1, 1), (2, 2), (3, 3)]
    )
    for h, w in shapes:
        a = banded(rng, h, w)
        assert border_share(a) == border_share_plain(a), (h, w)


def test_the_median_edge_colour_is_numpys_median():
    rng = np.random.default_rng(1)
    for n in (1, 2, 3, 127, 128):
        line = rng.integers(0, 256, (n, 3)).astype(np.uint8)
        assert np.array_equal(_median_colour(line), np.median(line.astype(np.float32), axis=0))


def test_the_c_histogram_entropy_is_the_bincount_entropy():
    rng = np.random.default_rng(2)
    images = [
        rng.integers(0, 256, (64, 64, 3)).astype(np.uint8),
        np.full((16, 16, 3), 7, np.uint8),
        rng.integers(0, 4, (33, 17, 3)).astype(np.uint8),
        banded(rng, 128, 128),
    ]
    for a in images:
        assert rgb_entropy(a) == entropy_plain(a)
    strided = rng.integers(0, 256, (40, 40, 3)).astype(np.uint8)[::2, ::3]
    assert rgb_entropy(strided) == entropy_plain(strided)


def test_the_block_sum_flat_share_is_the_per_block_standard_deviation_share():
    rng = np.random.default_rng(4)
    for i in range(600):
        h, w = (
            (128, 128) if i % 2 else (int(rng.integers(8, 140)), int(rng.integers(8, 140)))
        )  # odd sizes drop partial blocks
        sigma = rng.uniform(1.5, 3.5)  # block standard deviations on both sides of FLAT_STD, many close to it
        rgb = np.clip(rng.integers(0, 256, 3) + rng.normal(0, sigma, (h, w, 3)), 0, 255).astype(np.uint8)
        if i % 7 == 0:
            rgb[: h // 2] = rgb[0, 0]  # a flat half
        grey = grey_of(rgb)
        assert flat_share(grey) == flat_share_plain(grey), (i, h, w)


def test_the_lookup_table_colour_hash_is_the_per_pixel_colour_hash():
    rng = np.random.default_rng(3)
    for i in range(400):
        hsv = rng.integers(0, 256, (48, 48, 3)).astype(np.uint8)
        if i % 3 == 0:  # dark and unsaturated pixels, where the soft ramps split shares
            hsv[..., 1] = rng.integers(0, 80, (48, 48))
            hsv[..., 2] = rng.integers(0, 90, (48, 48))
        if i % 5 == 0:
            hsv[:] = hsv[0, 0]
        assert colorhash64(hsv) == colorhash_plain(hsv)
    assert colorhash64(np.zeros((1, 1, 3), np.uint8)) == colorhash_plain(np.zeros((1, 1, 3), np.uint8))


def test_the_hash_views_are_pils_conversions_of_the_upright_small_image():
    for orientation in (0, 6, 3):
        views = decode_views(
            encoded(scene(5, size=300), "JPEG", quality=90), orientation, decode_size=256, stats_size=128
        )
        small = Image.fromarray(views.hash, "RGB")
        assert np.array_equal(views.hash_grey, np.asarray(small.convert("L")))
        assert np.array_equal(views.hash_hsv, np.asarray(small.convert("HSV")))
