"""Perceptual hashes and Hamming distances over packed bits.

- `phash12`: the 12x12 DCT perceptual hash (144 bits, 18 bytes) of a 48x48 grey image: low
  frequencies of the DCT compared against their median. It ignores colour on purpose.
- `colorhash64`: 8 histogram cells (dark, unsaturated, 6 soft hue sectors) each written as an
  8-bit thermometer code of the cube root of its share (the root spreads small shares, so a small
  object of another colour still moves the hash). The Hamming distance between two colour hashes is then the
  L1 distance between their quantised histograms, so a hue-shifted variant of a picture lands far
  from the original while a recompressed copy lands next to it.
- `mirror_phash`: the pHash of the left-right mirrored image, from the pHash alone (no second decode).
- Hashes are compared as rows of uint64 words: XOR then popcount (`np.bitwise_count`).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

PHASH_SIDE = 12
PHASH_INPUT = PHASH_SIDE * 4  # 48 px: the DCT keeps the lowest 12 of 48 frequencies per axis
PHASH_BYTES = PHASH_SIDE * PHASH_SIDE // 8  # 18
COLOR_CELLS = 8
COLOR_LEVELS = 8
COLOR_BYTES = COLOR_CELLS * COLOR_LEVELS // 8  # 8

DARK_V = 0.2  # value below which a pixel counts as dark, whatever its hue
GREY_S = 0.2  # saturation below which a (not dark) pixel counts as unsaturated
SOFT = 0.2  # width of the ramp around both thresholds


@lru_cache(maxsize=4)
def dct_matrix(n_out: int, n_in: int) -> np.ndarray:
    """Rows of the orthonormal DCT-II basis: `D @ x` gives the first n_out coefficients of x."""
    k = np.arange(n_out)[:, None]
    i = np.arange(n_in)[None, :]
    d = np.cos(np.pi * (2 * i + 1) * k / (2 * n_in)) * np.sqrt(2.0 / n_in)
    d[0] /= np.sqrt(2.0)
    return d.astype(np.float32)


def phash12(grey48: np.ndarray) -> bytes:
    """144-bit pHash of a 48x48 grey image (any numeric dtype)."""
    if grey48.shape != (PHASH_INPUT, PHASH_INPUT):
        raise ValueError(f"phash12 needs a {PHASH_INPUT}x{PHASH_INPUT} grey image, got {grey48.shape}")
    d = dct_matrix(PHASH_SIDE, PHASH_INPUT)
    low = d @ grey48.astype(np.float32) @ d.T
    bits = low.ravel() > np.median(low)
    return np.packbits(bits).tobytes()


# Mirroring a row maps DCT-II coefficient v to (-1)^v times itself: the odd horizontal frequencies change
# sign. Their bits (coefficient > median) then invert, up to the few coefficients that lie between the
# two images' medians (which sit near 0 for most pictures): on real photographs the mirrored copy lies
# within 10 bits of `mirror_phash` of the original (benchmarks/bench_real_defaults.py).
MIRROR_MASK = np.packbits(np.arange(PHASH_SIDE * PHASH_SIDE) % PHASH_SIDE % 2 == 1).tobytes()


def mirror_phash(phash: bytes | np.ndarray) -> bytes | np.ndarray:
    """pHash(s) of the left-right mirrored image(s): the odd horizontal-frequency bits inverted.

    bytes -> bytes; an (n, 18) uint8 array -> an (n, 18) uint8 array. The colour hash is mirror-invariant.
    """
    mask = np.frombuffer(MIRROR_MASK, np.uint8)
    if isinstance(phash, np.ndarray):
        return phash ^ mask
    return (np.frombuffer(phash, np.uint8) ^ mask).tobytes()


def _colour_tables() -> tuple[np.ndarray, ...]:
    """Every per-pixel quantity of `colorhash64` depends on one uint8 channel, so it is computed once for the
    256 values, with the same float32 operations a per-pixel computation would do (the same bits)."""
    u = np.arange(256).astype(np.float32)
    h = u * (6.0 / 255.0)  # PIL hue 0..255 = 0..360 deg, in sectors
    s = u / 255.0
    v = u / 255.0
    # soft memberships (ramps SOFT wide around each threshold), so pixels near a boundary move shares a little
    dark = np.clip((DARK_V - v) / SOFT + 0.5, 0.0, 1.0)
    unsaturated = np.clip((GREY_S - s) / SOFT + 0.5, 0.0, 1.0)
    # hue: split between the two nearest sector centres, so a hue near a boundary does not flip bins
    pos = h - 0.5  # sector centres at 30, 90, ... 330 degrees
    lo = np.floor(pos)
    frac = pos - lo
    lo_bin = lo.astype(np.int64) % 6
    return dark, unsaturated, frac, 1.0 - frac, lo_bin, (lo_bin + 1) % 6


DARK_OF_V, UNSATURATED_OF_S, FRAC_OF_H, ONE_MINUS_FRAC_OF_H, LO_BIN_OF_H, HI_BIN_OF_H = _colour_tables()


def colorhash64(hsv: np.ndarray) -> bytes:
    """64-bit colour hash of an HSV uint8 image (H, W, 3), as PIL's `convert("HSV")` gives it."""
    flat = hsv.reshape(-1, 3)
    h, s, v = flat[:, 0], flat[:, 1], flat[:, 2]
    n = max(len(flat), 1)
    dark = DARK_OF_V[v]
    grey = (1.0 - dark) * UNSATURATED_OF_S[s]
    colourful = 1.0 - dark - grey
    hue = np.bincount(LO_BIN_OF_H[h], weights=colourful * ONE_MINUS_FRAC_OF_H[h], minlength=6)
    hue += np.bincount(HI_BIN_OF_H[h], weights=colourful * FRAC_OF_H[h], minlength=6)
    shares = np.concatenate([[dark.sum(), grey.sum()], hue]) / n
    levels = np.clip(np.rint(np.cbrt(shares) * COLOR_LEVELS), 0, COLOR_LEVELS).astype(np.int64)
    thermometer = np.arange(COLOR_LEVELS)[None, :] < levels[:, None]
    return np.packbits(thermometer.ravel()).tobytes()


# ------------------------------------------------------------------------------------------ hamming
def to_words(hashes: list[bytes] | np.ndarray, n_bytes: int) -> np.ndarray:
    """Fixed-size hashes -> (n, ceil(n_bytes / 8)) uint64, zero-padded; the layout every distance uses."""
    if isinstance(hashes, np.ndarray) and hashes.dtype == np.uint8:
        raw = hashes.reshape(-1, n_bytes)
    else:
        raw = np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(-1, n_bytes)
    n_words = -(-n_bytes // 8)
    padded = np.zeros((raw.shape[0], n_words * 8), dtype=np.uint8)
    padded[:, :n_bytes] = raw
    return padded.view(">u8").astype(np.uint64)


def hamming_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise Hamming distances between two (n, words) uint64 arrays (or one row broadcast)."""
    return np.bitwise_count(np.bitwise_xor(a, b)).sum(axis=-1, dtype=np.int64)


def hamming(a: bytes, b: bytes) -> int:
    """Hamming distance between two equal-length byte strings."""
    if len(a) != len(b):
        raise ValueError(f"hashes of different lengths: {len(a)} and {len(b)}")
    return int(np.bitwise_count(np.frombuffer(a, np.uint8) ^ np.frombuffer(b, np.uint8)).sum())
