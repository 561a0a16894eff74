"""Decode once, measure everything: the single decode behind the filter stage.

An image is decoded exactly once, reduced as early as the format allows (JPEG's DCT scaling via
`Image.draft` gives 1/2, 1/4, 1/8 decodes almost for free), converted to 8-bit RGB, resized to a fixed
`stats_size` square (and a 48-px square for the hashes) and turned upright. Every statistic and both hashes come from that one small
array, so their cost does not grow with the image and thresholds mean the same at every resolution.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

import numpy as np
from PIL import Image

from assets.hashes import PHASH_INPUT, colorhash64, phash12
from kiln.imageio import open_header, to_rgb, upright
from kiln.reasons import detail_of

WHITE_LEVEL = 240  # a pixel is white when all three channels reach this
BLACK_LEVEL = 16  # a pixel is black when no channel reaches this
BORDER_TOL = 10  # a pixel belongs to an edge band when no channel is further than this from the band colour
BORDER_ROW_SHARE = 0.98  # share of a row's pixels that must match for the row to be part of a band
FLAT_BLOCK = 8  # flat-background share is measured on blocks of this side (in stats pixels)
FLAT_STD = 2.5  # grey standard deviation below which a block is flat


class DecodeFailure(Exception):
    """The payload could not be decoded (truncated, corrupt)."""


class UnsupportedFormat(Exception):
    """PIL identified the file but has no decoder for it here."""


@dataclass(frozen=True)
class Measures:
    """The StatsRow of one image (kiln/schemas.py)."""

    aspect: float
    laplacian_var: float
    entropy: float
    white_ratio: float
    black_ratio: float
    border_share: float
    flat_share: float
    phash: bytes
    colorhash: bytes

    def as_row(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------------------ decode
@dataclass(frozen=True)
class Views:
    """Two resizes of the one decode, both upright: `stats` for the statistics, `hash` for the hashes.

    Statistics upscale small images with NEAREST (interpolation would smooth noise away and hide it
    from the Laplacian); the hashes come from an area / bilinear resize to stats_size and then to 48 px,
    whose extra smoothing keeps them stable across resizes, recompression and slight crops.
    """

    stats: np.ndarray  # (stats_size, stats_size, 3) uint8
    hash: np.ndarray  # (PHASH_INPUT, PHASH_INPUT, 3) uint8
    hash_grey: np.ndarray  # (PHASH_INPUT, PHASH_INPUT) uint8: PIL's "L" of `hash`, the pHash input
    hash_hsv: np.ndarray  # (PHASH_INPUT, PHASH_INPUT, 3) uint8: PIL's "HSV" of `hash`, the colour hash input


def _square(im: Image.Image, side: int, upscale: Image.Resampling) -> Image.Image:
    shrink = im.width >= side and im.height >= side
    return im.resize((side, side), Image.Resampling.BOX if shrink else upscale)


def decode_views(data: bytes, orientation: int, decode_size: int, stats_size: int) -> Views:
    """The one decode: bytes -> upright small RGB arrays. First frame of animations."""
    try:
        im = open_header(data)
        if im.format in ("JPEG", "MPO"):
            im.draft(None, (decode_size, decode_size))  # DCT-domain downscale, never below decode_size
        im.load()
        rgb = to_rgb(im)
    except OSError as e:
        if "decoder" in str(e) and "not available" in str(e):
            raise UnsupportedFormat(str(e)) from e
        raise DecodeFailure(detail_of(e)) from e
    except Exception as e:  # PIL signals corrupt data with SyntaxError, ValueError, EOFError, struct.error...
        raise DecodeFailure(detail_of(e)) from e
    smooth = _square(rgb, stats_size, Image.Resampling.BILINEAR)
    stats = (
        smooth
        if rgb.width >= stats_size and rgb.height >= stats_size
        else _square(rgb, stats_size, Image.Resampling.NEAREST)
    )
    hashed = upright(smooth.resize((PHASH_INPUT, PHASH_INPUT), Image.Resampling.BOX), orientation)
    return Views(
        np.asarray(upright(stats, orientation)),
        np.asarray(hashed),
        np.asarray(hashed.convert("L")),
        np.asarray(hashed.convert("HSV")),
    )


# -------------------------------------------------------------------------------------- statistics
def grey_of(rgb: np.ndarray) -> np.ndarray:
    """ITU-R 601 luma, float32 in [0, 255]."""
    return rgb[..., 0] * np.float32(0.299) + rgb[..., 1] * np.float32(0.587) + rgb[..., 2] * np.float32(0.114)


def laplacian_var(grey: np.ndarray) -> float:
    """Variance of the 4-neighbour Laplacian: low for flat or blurred images, huge for noise."""
    lap = grey[1:-1, :-2] + grey[1:-1, 2:] + grey[:-2, 1:-1] + grey[2:, 1:-1] - 4 * grey[1:-1, 1:-1]
    return float(lap.var())


def rgb_entropy(rgb: np.ndarray) -> float:
    """Mean Shannon entropy (bits, 0..8) of the three 256-bin channel histograms."""
    counts = np.asarray(Image.fromarray(np.ascontiguousarray(rgb), "RGB").histogram(), np.float64).reshape(
        3, 256
    )  # PIL's C histogram
    p = counts / counts.sum(axis=1, keepdims=True)
    bits = -(p * np.log2(p, out=np.zeros_like(p), where=p > 0)).sum(axis=1)  # 0 log 0 = 0
    return float(bits.mean())


def _median_colour(line: np.ndarray) -> np.ndarray:
    """Per-channel median of a line of uint8 pixels (..., length, 3) as float32: `np.median`'s value (the middle
    one, or the mean of the two middle ones), from a sort of the small uint8 line instead of a float partition."""
    ranked = np.sort(line, axis=-2)
    mid = ranked.shape[-2] // 2
    if ranked.shape[-2] % 2:
        return ranked[..., mid, :].astype(np.float32)
    return (ranked[..., mid - 1, :].astype(np.float32) + ranked[..., mid, :]) / np.float32(2)


def _band_depth(lines: np.ndarray) -> int:
    """How many lines, from the first one inward, are flat and of the first line's colour (at most half).

    Lines are tested in chunks that double in size and the scan stops at the first line that is not part
    of the band: a photograph costs a line or two, not half the image (same result as testing them all)."""
    n, cap = len(lines) // 2 + 1, len(lines) // 2
    edge = _median_colour(lines[0])
    depth, step = 0, 2
    while depth < n:
        chunk = lines[depth : min(n, depth + step)].astype(np.float32)
        dev = np.abs(chunk - edge)
        close = np.maximum(np.maximum(dev[..., 0], dev[..., 1]), dev[..., 2]) <= BORDER_TOL  # (n_lines, line_length)
        flat = close.mean(axis=1) >= BORDER_ROW_SHARE
        if not flat.all():
            return min(depth + int(np.argmin(flat)), cap)
        depth, step = depth + len(chunk), step * 2
    return min(depth, cap)


def border_share(rgb: np.ndarray) -> float:
    """Share of the image covered by flat bands along its four edges (letterbox, pillarbox, frames)."""
    h, w = rgb.shape[:2]
    t = rgb.transpose(1, 0, 2)  # columns as lines (a view: only the lines a band scan reaches are copied)
    sides = (rgb, rgb[::-1], t, t[::-1])
    if h == w and h >= 2:  # the stats view is square: the four edge lines stack, and a photograph's are not flat
        edges = np.stack([side[0] for side in sides])  # (4, side, 3)
        dev = np.abs(edges.astype(np.float32) - _median_colour(edges)[:, None])
        flat = (np.maximum(np.maximum(dev[..., 0], dev[..., 1]), dev[..., 2]) <= BORDER_TOL).mean(
            axis=1
        ) >= BORDER_ROW_SHARE
        top, bottom, left, right = (_band_depth(side) if f else 0 for side, f in zip(sides, flat.tolist()))
    else:
        top, bottom, left, right = (_band_depth(side) for side in sides)
    inner = max(h - top - bottom, 0) * max(w - left - right, 0)
    return 1.0 - inner / (h * w)


@lru_cache(maxsize=8)
def _block_sums(n: int) -> np.ndarray:
    """[n // FLAT_BLOCK, n] float64 0/1 matrix: row i sums block i of a length-n axis."""
    return np.kron(np.eye(n // FLAT_BLOCK), np.ones(FLAT_BLOCK))


def flat_share(grey: np.ndarray) -> float:
    """Share of FLAT_BLOCK-sided blocks that are flat: high for product shots on plain backgrounds.

    A block's variance is E[x^2] - E[x]^2 from two block-sum matmuls in float64 (exact to ~1e-10 for
    8-bit greys), 6x faster than a std over a strided 4-D view; compared with FLAT_STD^2, so the share
    differs from the std's only for a block within float32 rounding of the threshold."""
    h, w = (s - s % FLAT_BLOCK for s in grey.shape)
    if h == 0 or w == 0:
        return float("nan")  # no whole block: what the mean of an empty std gave
    rows, cols = _block_sums(h), _block_sums(w).T
    g = grey[:h, :w].astype(np.float64)
    n = FLAT_BLOCK * FLAT_BLOCK
    mean = rows @ g @ cols / n
    var = rows @ (g * g) @ cols / n - mean * mean
    return float((var < FLAT_STD * FLAT_STD).mean())


def measure_pixels(views: Views, aspect: float) -> Measures:
    """Every statistic and both hashes of one image's small upright views (pure)."""
    rgb = views.stats
    grey = grey_of(rgb)
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    lo, hi = (
        np.minimum(np.minimum(r, g), b),
        np.maximum(np.maximum(r, g), b),
    )  # (a reduction over the 3-long axis is 10x slower)
    return Measures(
        aspect=float(aspect),
        laplacian_var=laplacian_var(grey),
        entropy=rgb_entropy(rgb),
        white_ratio=float((lo >= WHITE_LEVEL).mean()),
        black_ratio=float((hi < BLACK_LEVEL).mean()),
        border_share=border_share(rgb),
        flat_share=flat_share(grey),
        phash=phash12(views.hash_grey),
        colorhash=colorhash64(views.hash_hsv),
    )


def aspect_of(width: int, height: int) -> float:
    """max / min side; EXIF rotation swaps the sides, which leaves this ratio unchanged."""
    return max(width, height) / max(min(width, height), 1)


def measure(data: bytes, width: int, height: int, orientation: int, decode_size: int, stats_size: int) -> Measures:
    """Decode once and measure. Raises DecodeFailure / UnsupportedFormat."""
    return measure_pixels(decode_views(data, orientation, decode_size, stats_size), aspect_of(width, height))
