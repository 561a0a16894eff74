"""A verifiable prompt-following check for the demo prompts: colour, position and background.

Deterministic pixel rules against the demo palette (assets.demo_scenes.COLORS), no learned judge:
  * background: the palette colour nearest the median of the image's outer ring of pixels;
  * colour:     in the window where the shape should be, the palette colour most non-background
                pixels are nearest to; wrong if too few pixels there differ from the background;
  * position:   where the centroid of the foreground (pixels far from the background) lies: `center`
                within a margin of the middle on both axes, else the side along the larger offset.
Count and shape are not checked: at 32 px counted shapes touch and corners are a pixel or two, so a
rule would be wrong about correct images (it is measured on the renderer's own images in the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from assets.demo_scenes import COLORS, POSITION_XY

ATTRIBUTES = ("color", "position", "background")
PALETTE_NAMES = tuple(COLORS)
PALETTE = np.array([COLORS[n] for n in PALETTE_NAMES], dtype=np.float32)  # [K, 3]

FOREGROUND_DISTANCE = 60.0  # RGB distance from the background that counts as "something drawn" (palette pairs are >= 120 apart)
WINDOW = 0.12  # half-side of the expected-shape window, as a share of the image side
CENTER_MARGIN = 0.125  # centroid within this (share of the side) of the middle on both axes: center (sides sit at 0.25)
MIN_FOREGROUND = 0.01  # below this share of foreground pixels, nothing was drawn
MIN_WINDOW_SHARE = 0.15  # share of the window that must be non-background for a colour to count as drawn there


@dataclass(frozen=True)
class Expected:
    """The checkable attributes of one prompt (a subset of assets.demo_scenes.PromptSpec)."""

    color: str
    position: str
    background: str


def nearest_color(pixels: np.ndarray) -> np.ndarray:
    """Index into PALETTE of the nearest colour, for [..., 3] pixels."""
    d = ((pixels[..., None, :].astype(np.float32) - PALETTE) ** 2).sum(-1)
    return d.argmin(-1)


def background_color(image: np.ndarray) -> tuple[str, np.ndarray]:
    """(name, RGB) of the background: the outer ring's median, which shapes touching an edge barely move."""
    ring = np.concatenate([image[0], image[-1], image[1:-1, 0], image[1:-1, -1]]).astype(np.float32)
    rgb = np.median(ring, axis=0)
    return PALETTE_NAMES[int(nearest_color(rgb))], rgb


def foreground_mask(image: np.ndarray, background_rgb: np.ndarray) -> np.ndarray:
    return np.linalg.norm(image.astype(np.float32) - background_rgb, axis=-1) > FOREGROUND_DISTANCE


def window(image: np.ndarray, position: str) -> np.ndarray:
    h, w = image.shape[:2]
    fx, fy = POSITION_XY[position]
    r = max(1, round(WINDOW * min(h, w)))
    cx, cy = round(fx * w), round(fy * h)
    return image[max(0, cy - r) : cy + r, max(0, cx - r) : cx + r]


def dominant_color(pixels: np.ndarray, background: str) -> str | None:
    """The palette colour most non-background pixels are nearest to, or None where (almost) only background is."""
    idx = nearest_color(pixels.reshape(-1, 3))
    idx = idx[idx != PALETTE_NAMES.index(background)]
    if idx.size < MIN_WINDOW_SHARE * pixels.shape[0] * pixels.shape[1]:
        return None
    return PALETTE_NAMES[int(np.bincount(idx, minlength=len(PALETTE_NAMES)).argmax())]


def side_of(mask: np.ndarray) -> str | None:
    """Where the foreground's centroid lies: one of assets.demo_scenes.POSITIONS, or None."""
    h, w = mask.shape
    if mask.mean() < MIN_FOREGROUND:
        return None
    ys, xs = np.nonzero(mask)
    dx, dy = (xs.mean() + 0.5) / w - 0.5, (ys.mean() + 0.5) / h - 0.5
    if max(abs(dx), abs(dy)) < CENTER_MARGIN:
        return "center"
    if abs(dx) >= abs(dy):
        return "left" if dx < 0 else "right"
    return "top" if dy < 0 else "bottom"


def check_image(image: np.ndarray, expected: Expected) -> dict[str, bool]:
    """Per-attribute pass/fail of one uint8 [H, W, 3] image."""
    bg_name, bg_rgb = background_color(image)
    fg = foreground_mask(image, bg_rgb)
    return {
        "color": dominant_color(window(image, expected.position), bg_name) == expected.color,
        "position": side_of(fg) == expected.position,
        "background": bg_name == expected.background,
    }


def accuracy(images: np.ndarray, expected: list[Expected]) -> dict[str, float]:
    """Per-attribute accuracy over uint8 [P, N, H, W, 3] images (N per prompt), plus `all` (every attribute right)."""
    results = [check_image(images[i, j], e) for i, e in enumerate(expected) for j in range(images.shape[1])]
    out = {a: float(np.mean([r[a] for r in results])) for a in ATTRIBUTES}
    out["all"] = float(np.mean([all(r.values()) for r in results]))
    return {k: round(v, 4) for k, v in out.items()}


def expected_from_specs(specs) -> list[Expected]:
    return [Expected(s.color, s.position, s.background) for s in specs]
