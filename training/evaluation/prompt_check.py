"""A verifiable prompt-following check for the demo prompts: colour, shape, count, position, background.

Deterministic pixel rules against the demo palette (components.demo_scenes.COLORS), no learned judge:
  * background: the palette colour nearest the median of the image's outer ring of pixels;
  * colour:     in the window where the shape should be, the palette colour most non-background
                pixels are nearest to; wrong if too few pixels there differ from the background;
  * position:   where the centroid of the foreground (pixels far from the background) lies: `center`
                within a margin of the middle on both axes, else the side along the larger offset.
  * count:      peaks of the drawn pixels' ink profile (distance from the background, summed across
                the axis the renderer lines counted shapes up on: vertical for left/right, else
                horizontal), smoothed and prominent by a share of its maximum; touching shapes still
                leave a dip there;
  * shape:      of the largest foreground blob, the share of its bounding box it fills (square ~0.9-1,
                circle ~0.75, triangle and diamond ~0.6) and how low its centroid sits in the box
                (a triangle's mass is in its lower half, a diamond's is centred).
An image whose foreground covers more than MAX_FOREGROUND of it (noise, a smeared wash) has no readable
layout: position, count and shape fail there (the renderer's shapes cover at most ~23%; pure noise ~97%,
which would otherwise put its centroid in the middle and its ink profile in one broad "peak").
`graded_check` turns each pass/fail into a score a reward can climb: above 0.5 exactly where the rule
passes, below where it fails, and within each side by how close the image is to the request (colour
distances, the centroid's distance to the asked-for position, the count's error), like a judge's P(yes).
Count is checked on every prompt. Shape only on large single shapes, where the rule is right about the
renderer's own 32 px images (measured in the tests; on small or counted shapes, 8 px across with
corners of a pixel or two, it was wrong on 15-40% of correct images). Where shape is not checked it is
absent from the image's result and from the accuracy's denominator.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from components.demo_scenes import COLORS, POSITION_XY

ATTRIBUTES = ("color", "position", "background")  # checked on every image
CONDITIONAL_ATTRIBUTES = ("shape", "count")  # checked where `checkable` says the rule is reliable
PALETTE_NAMES = tuple(COLORS)
PALETTE = np.array([COLORS[n] for n in PALETTE_NAMES], dtype=np.float32)  # [K, 3]

FOREGROUND_DISTANCE = (
    60.0  # RGB distance from the background that counts as "something drawn" (palette pairs are >= 120 apart)
)
WINDOW = 0.12  # half-side of the expected-shape window, as a share of the image side
CENTER_MARGIN = 0.125  # centroid within this (share of the side) of the middle on both axes: center (sides sit at 0.25)
MIN_FOREGROUND = 0.01  # below this share of foreground pixels, nothing was drawn
MAX_FOREGROUND = 0.5  # above this share there is no figure on a ground to read a layout from
MIN_WINDOW_SHARE = 0.15  # share of the window that must be non-background for a colour to count as drawn there
COUNT_SMOOTHING = 1.0  # px, Gaussian sigma on the count profile
COUNT_PROMINENCE = 0.25  # a shape is a profile peak this share of the profile's maximum above the dips around it
TRIANGLE_MIN_CENTROID = 0.555  # centroid depth (share of the bbox height) above which a blob is a triangle
SQUARE_MIN_FILL = 0.86  # bbox fill above which a (non-triangle) blob is a square
CIRCLE_MIN_FILL = 0.68  # ... above which a circle, below which a diamond


@dataclass(frozen=True)
class Expected:
    """The checkable attributes of one prompt (a subset of components.demo_scenes.PromptSpec)."""

    color: str
    position: str
    background: str
    shape: str | None = None  # None: not asked for
    count: int | None = None
    size: str | None = None

    def checkable(self) -> dict[str, bool]:
        """Whether shape and count can be checked reliably for this prompt (see the module docstring)."""
        return {
            "shape": self.shape is not None and self.size == "large" and self.count == 1,
            "count": self.count is not None,
        }


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
    """Where the foreground's centroid lies: one of components.demo_scenes.POSITIONS, or None."""
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


def ink(image: np.ndarray, background_rgb: np.ndarray) -> np.ndarray:
    """How far each pixel is from the background, in [0, 1] of the image's own range: blurred gaps
    between touching shapes keep their in-between value instead of being rounded to a side."""
    d = np.linalg.norm(image.astype(np.float32) - background_rgb, axis=-1)
    return np.clip(d / max(float(np.percentile(d, 99)), 1e-6), 0, 1)


def count_of(mask: np.ndarray, position: str) -> int:
    """Shapes along the axis the renderer lines counted shapes up on: peaks of the mask's profile that
    stand out by COUNT_PROMINENCE of its maximum (neighbouring shapes touch at 32 px: the profile dips
    between them instead of reaching zero)."""
    from scipy.ndimage import gaussian_filter1d
    from scipy.signal import find_peaks

    h, w = mask.shape
    if mask.mean() < MIN_FOREGROUND:
        return 0
    vertical = position in ("left", "right") or (position == "center" and h > w)
    profile = gaussian_filter1d(
        np.pad(mask.sum(axis=1 if vertical else 0).astype(np.float32), 2), COUNT_SMOOTHING
    )  # flat tops are noisy
    peaks, _ = find_peaks(profile, prominence=COUNT_PROMINENCE * profile.max())
    return len(peaks)


def shape_of(mask: np.ndarray) -> str | None:
    """circle / square / triangle / diamond of the largest foreground blob, or None where nothing is drawn."""
    from scipy import ndimage

    if mask.mean() < MIN_FOREGROUND:
        return None
    labels, n = ndimage.label(mask)
    sizes = np.bincount(labels.ravel(), minlength=n + 1)[1:]
    blob = labels == int(sizes.argmax()) + 1
    ys, xs = np.nonzero(blob)
    height, width = ys.max() - ys.min() + 1, xs.max() - xs.min() + 1
    fill = blob.sum() / (height * width)
    depth = (ys.mean() - ys.min() + 0.5) / height
    if depth > TRIANGLE_MIN_CENTROID:
        return "triangle"
    if fill >= SQUARE_MIN_FILL:
        return "square"
    return "circle" if fill >= CIRCLE_MIN_FILL else "diamond"


class Reading:
    """What the verdicts and the closeness both read off one image (background, foreground, drawn pixels,
    counts), each computed once."""

    def __init__(self, image: np.ndarray):
        self.image = image
        self.bg_name, self.bg_rgb = background_color(image)
        self.fg = foreground_mask(image, self.bg_rgb)
        self._counts: dict[str, int] = {}

    @cached_property
    def drawn(self) -> np.ndarray:
        return nearest_color(self.image) != PALETTE_NAMES.index(
            self.bg_name
        )  # split halfway between palette colours: blurred neighbours stay apart

    def count(self, position: str) -> int:
        if position not in self._counts:
            self._counts[position] = count_of(ink(self.image, self.bg_rgb) * self.drawn, position)
        return self._counts[position]


def check_image(image: np.ndarray, expected: Expected, reading: Reading | None = None) -> dict[str, bool]:
    """Per-attribute pass/fail of one uint8 [H, W, 3] image (shape / count only where checkable)."""
    r = reading or Reading(image)
    out = {
        "color": dominant_color(window(image, expected.position), r.bg_name) == expected.color,
        "position": side_of(r.fg) == expected.position,
        "background": r.bg_name == expected.background,
    }
    legible = bool(r.fg.mean() <= MAX_FOREGROUND)
    out["position"] = out["position"] and legible
    checkable = expected.checkable()
    if checkable["shape"]:
        out["shape"] = legible and shape_of(r.drawn) == expected.shape
    if checkable["count"]:
        out["count"] = legible and r.count(expected.position) == expected.count
    return out


COLOR_SCALE = 60.0  # RGB distance at which a colour's closeness has fallen to 1/e
POSITION_SCALE = 0.15  # centroid distance (share of the side) at which the position's closeness has fallen to 1/e
PASS_FLOOR, GRADED_SPAN = 0.51, 0.49  # pass: 0.51 + 0.49 * closeness; fail: 0.49 * closeness


def closeness(image: np.ndarray, expected: Expected, reading: Reading | None = None) -> dict[str, float]:
    """Per attribute, how near the image is to the request, in [0, 1] (1: exactly it)."""
    r = reading or Reading(image)
    target_bg = np.array(COLORS[expected.background], np.float32)
    out = {"background": float(np.exp(-np.linalg.norm(r.bg_rgb - target_bg) / COLOR_SCALE))}
    win = window(image, expected.position).reshape(-1, 3).astype(np.float32)
    out["color"] = float(
        np.exp(-np.linalg.norm(win - np.array(COLORS[expected.color], np.float32), axis=-1) / COLOR_SCALE).mean()
    )
    share = float(r.fg.mean())
    if share < MIN_FOREGROUND:
        out["position"] = 0.0
    else:
        h, w = r.fg.shape
        ys, xs = np.nonzero(r.fg)
        fx, fy = POSITION_XY[expected.position]
        dist = float(np.hypot((xs.mean() + 0.5) / w - fx, (ys.mean() + 0.5) / h - fy))
        out["position"] = float(np.exp(-dist / POSITION_SCALE)) * (
            1.0 if share <= MAX_FOREGROUND else MAX_FOREGROUND / share
        )
    if expected.checkable()["count"]:
        out["count"] = 1.0 / (1.0 + abs(r.count(expected.position) - expected.count))
    return out


def graded_check(image: np.ndarray, expected: Expected) -> dict[str, float]:
    """check_image's verdicts as scores in [0, 1]: > 0.5 exactly where the rule passes, graded by closeness
    on each side (shape, a categorical rule, stays 0 or 1)."""
    reading = Reading(image)
    verdict = check_image(image, expected, reading)
    near = closeness(image, expected, reading)
    return {a: (PASS_FLOOR if ok else 0.0) + GRADED_SPAN * near.get(a, float(ok)) for a, ok in verdict.items()}


def accuracy(images: np.ndarray, expected: list[Expected]) -> dict[str, float]:
    """Per-attribute accuracy over uint8 [P, N, H, W, 3] images (N per prompt), plus `all` (every checked
    attribute right). Shape and count average over the images where they are checkable, and are
    absent when no prompt makes them checkable."""
    results = [check_image(images[i, j], e) for i, e in enumerate(expected) for j in range(images.shape[1])]
    out = {a: float(np.mean([r[a] for r in results])) for a in ATTRIBUTES}
    for a in CONDITIONAL_ATTRIBUTES:
        checked = [r[a] for r in results if a in r]
        if checked:
            out[a] = float(np.mean(checked))
    out["all"] = float(np.mean([all(r.values()) for r in results]))
    return {k: round(v, 4) for k, v in out.items()}


def expected_from_specs(specs) -> list[Expected]:
    return [Expected(s.color, s.position, s.background, s.shape, s.count, s.size) for s in specs]
