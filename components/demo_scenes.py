"""Procedural scenes whose captions are known by construction: the demo corpus's vocabulary and renderer.

A `Scene` is a small, JSON-able description (background, shapes, an optional sign with a word);
`caption_for` turns it into the one caption style the demo model is trained on, and `render` draws
it. The same vocabulary gives `demo_prompts`, so the prompt-following checker asks for exactly the
attributes (colour, shape, count, position, background) the training captions teach.

Drawing choices that the filter and dedup stages rely on:
- backgrounds carry a gentle gradient and fine noise, so no scene has flat bands at its edges or a
  near-empty colour histogram (only the deliberately bad images do);
- shapes are big enough (small: about a quarter of the short side, large: about half) that colour and
  position survive a resize to 32x32;
- everything random about a scene (jitter, noise) comes from its own `layout_seed`, so a colour
  variant (same layout seed, other colours) has exactly the same layout.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Literal

import numpy as np
from PIL import Image, ImageDraw, ImageFont
from scipy.ndimage import gaussian_filter

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "orange": (245, 140, 30),
    "yellow": (240, 215, 40),
    "green": (40, 165, 60),
    "blue": (40, 80, 220),
    "purple": (140, 60, 190),
    "pink": (240, 130, 190),
    "white": (232, 232, 228),  # kept below pure white so a white background is not "too white"
    "grey": (128, 128, 128),
    "black": (28, 28, 32),
}
SHAPE_COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "white", "black")
BACKGROUND_COLORS = ("blue", "green", "yellow", "red", "purple", "white", "black", "grey")
GREY_COLORS = ("white", "grey", "black")
SHAPES = ("circle", "square", "triangle", "diamond")
POSITIONS = ("left", "right", "top", "bottom", "center")
SIZES = ("small", "large")
WORDS = ("SALE", "STOP", "OPEN", "KILN", "CAFE", "EXIT", "HELLO", "PIZZA", "BOOKS", "HOTEL")
FAMILIES = ("single_shape", "counted_shapes", "two_shapes", "text_sign", "pattern_background")

POSITION_PHRASE = {
    "left": "on the left",
    "right": "on the right",
    "top": "at the top",
    "bottom": "at the bottom",
    "center": "in the center",
}
COUNT_WORDS = {1: "a", 2: "two", 3: "three"}
OPPOSITE_PAIRS = (("left", "right"), ("top", "bottom"))

# centre of each position, as fractions of (width, height)
POSITION_XY = {
    "left": (0.25, 0.5),
    "right": (0.75, 0.5),
    "top": (0.5, 0.25),
    "bottom": (0.5, 0.75),
    "center": (0.5, 0.5),
}
# shape radius as a fraction of the short side, per family layout
RADIUS = {
    "single": {"small": 0.13, "large": 0.24},
    "counted": {"small": 0.09, "large": 0.14},
    "pair": {"small": 0.12, "large": 0.19},
}
MIN_CONTRAST = 120.0  # RGB distance between a shape and what it is drawn on
NOISE_SIGMA = 5.0
EDGE_SOFTNESS = 0.8  # Gaussian sigma, px: keeps sharp stripes and text below the noise filter's threshold
SUPERSAMPLE = 4


@dataclass(frozen=True)
class Shape:
    color: str
    shape: str
    size: Literal["small", "large"]
    position: str
    count: int = 1


@dataclass(frozen=True)
class Background:
    color: str
    pattern: Literal["plain", "stripes", "gradient"] = "plain"
    color2: str | None = None


@dataclass(frozen=True)
class Scene:
    family: str
    background: Background
    shapes: tuple[Shape, ...] = ()
    text: str | None = None  # the word on the sign (text_sign family)
    sign_color: str | None = None
    layout_seed: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, s: str) -> "Scene":
        d = json.loads(s)
        return cls(
            family=d["family"],
            background=Background(**d["background"]),
            shapes=tuple(Shape(**x) for x in d["shapes"]),
            text=d["text"],
            sign_color=d["sign_color"],
            layout_seed=d["layout_seed"],
        )

    def signature(self) -> tuple:
        """What must differ between two scenes for them not to be near-duplicates of each other."""
        return (self.family, self.background, self.shapes, self.text, self.sign_color)

    def colors(self) -> set[str]:
        out = {self.background.color} | {s.color for s in self.shapes}
        out |= {c for c in (self.background.color2, self.sign_color) if c}
        return out


# ------------------------------------------------------------------------------------------- captions
def _shape_phrase(s: Shape) -> str:
    where = POSITION_PHRASE[s.position]
    if s.count == 1:
        return f"a {s.size} {s.color} {s.shape} {where}"
    return f"{COUNT_WORDS[s.count]} {s.size} {s.color} {s.shape}s {where}"


def _background_phrase(b: Background) -> str:
    if b.pattern == "stripes":
        return f"on a {b.color} and {b.color2} striped background"
    if b.pattern == "gradient":
        return f"on a {b.color} to {b.color2} gradient background"
    return f"on a {b.color} background"


def caption_for(scene: Scene) -> str:
    """The training caption: 'a large red circle on the left, on a blue background'."""
    if scene.text is not None:
        return f'a {scene.sign_color} sign with the word "{scene.text}", {_background_phrase(scene.background)}'
    return " and ".join(_shape_phrase(s) for s in scene.shapes) + ", " + _background_phrase(scene.background)


# ------------------------------------------------------------------------------------------- sampling
@lru_cache(maxsize=None)
def _contrast(a: str, b: str) -> float:
    return float(np.linalg.norm(np.subtract(COLORS[a], COLORS[b], dtype=np.float64)))


def _pick(rng: np.random.Generator, options: tuple[str, ...] | list[str]) -> str:
    return str(options[int(rng.integers(len(options)))])


def _shape_color(rng: np.random.Generator, against: list[str], palette: tuple[str, ...] = SHAPE_COLORS) -> str:
    ok = [c for c in palette if all(_contrast(c, a) >= MIN_CONTRAST for a in against)]
    return _pick(rng, ok)


def sample_scene(rng: np.random.Generator, family: str, palette: str = "color") -> Scene:
    """A random scene of one family; `palette="grey"` keeps every colour achromatic."""
    shape_palette = GREY_COLORS if palette == "grey" else SHAPE_COLORS
    bg_palette = GREY_COLORS if palette == "grey" else BACKGROUND_COLORS
    layout_seed = int(rng.integers(2**31))
    size = lambda: _pick(rng, SIZES)  # noqa: E731
    if family == "pattern_background":
        c1 = _pick(rng, bg_palette)
        c2 = _shape_color(rng, [c1], bg_palette)
        bg = Background(c1, _pick(rng, ("stripes", "gradient")), c2)
        shape = Shape(_shape_color(rng, [c1, c2], shape_palette), _pick(rng, SHAPES), size(), "center")
        return Scene(family, bg, (shape,), layout_seed=layout_seed)
    bg = Background(_pick(rng, bg_palette))
    if family == "single_shape":
        color = _shape_color(rng, [bg.color], shape_palette)
        shapes: tuple[Shape, ...] = (Shape(color, _pick(rng, SHAPES), size(), _pick(rng, POSITIONS)),)
    elif family == "counted_shapes":
        color = _shape_color(rng, [bg.color], shape_palette)
        shapes = (Shape(color, _pick(rng, SHAPES), size(), _pick(rng, POSITIONS), int(rng.integers(2, 4))),)
    elif family == "two_shapes":
        pair = OPPOSITE_PAIRS[int(rng.integers(len(OPPOSITE_PAIRS)))]
        c1 = _shape_color(rng, [bg.color], shape_palette)
        c2 = _shape_color(rng, [bg.color, c1], shape_palette)
        shapes = tuple(Shape(c, _pick(rng, SHAPES), size(), p) for c, p in zip((c1, c2), pair))
    elif family == "text_sign":
        sign = _shape_color(rng, [bg.color], shape_palette)
        return Scene(family, bg, (), text=_pick(rng, WORDS), sign_color=sign, layout_seed=layout_seed)
    else:
        raise ValueError(f"unknown scene family {family!r}; families: {FAMILIES}")
    return Scene(family, bg, shapes, layout_seed=layout_seed)


def _luminance(c: str) -> float:
    return float(np.dot(COLORS[c], (0.299, 0.587, 0.114)))


def _hue_class(c: str) -> str:
    return "achromatic" if c in GREY_COLORS else c


def recolor(scene: Scene, rng: np.random.Generator, tries: int = 60) -> Scene:
    """Same layout (layout seed, shapes, positions, sizes), every colour changed, the background's hue too.

    Of the readable re-colourings tried, the one whose grey picture changes least wins: the variant then
    looks like the original to a grey perceptual hash, and only colour tells them apart.
    """
    old = sorted(scene.colors())
    palette = [c for c in COLORS if c not in old]
    best: tuple[float, Scene] | None = None
    for _ in range(tries if len(palette) >= len(old) else 0):
        new = dict(zip(old, (palette[i] for i in rng.permutation(len(palette))[: len(old)])))
        cand = _map_colors(scene, new)
        if _hue_class(new[scene.background.color]) == _hue_class(scene.background.color) or not _readable(cand):
            continue
        cost = sum(abs(_luminance(o) - _luminance(n)) for o, n in new.items())
        if best is None or cost < best[0]:
            best = (cost, cand)
    if best is None:
        raise ValueError(f"no colour variant found for {scene.to_json()}")
    return best[1]


def _map_colors(scene: Scene, m: dict[str, str]) -> Scene:
    bg = scene.background
    return replace(
        scene,
        background=Background(m[bg.color], bg.pattern, m[bg.color2] if bg.color2 else None),
        shapes=tuple(replace(s, color=m[s.color]) for s in scene.shapes),
        sign_color=m[scene.sign_color] if scene.sign_color else None,
    )


def _readable(scene: Scene) -> bool:
    """Every shape (or the sign) stands out from the background colours."""
    under = [scene.background.color] + ([scene.background.color2] if scene.background.color2 else [])
    tops = [s.color for s in scene.shapes] + ([scene.sign_color] if scene.sign_color else [])
    if len(scene.shapes) == 2 and scene.shapes[0].color == scene.shapes[1].color:
        return False
    return all(_contrast(t, u) >= MIN_CONTRAST for t in tops for u in under)


# ------------------------------------------------------------------------------------------ rendering
def _background(bg: Background, w: int, h: int, rng: np.random.Generator) -> np.ndarray:
    c1 = np.array(COLORS[bg.color], dtype=np.float32)
    yy, xx = (a.astype(np.float32) for a in np.mgrid[0:h, 0:w])
    if bg.pattern == "gradient":
        t = (xx / max(w - 1, 1))[..., None]
        img = c1 * (1 - t) + np.array(COLORS[bg.color2], dtype=np.float32) * t
    elif bg.pattern == "stripes":
        period = max(min(w, h) / 3.0, 8.0)
        coord = xx if rng.random() < 0.5 else yy
        on = ((coord // (period / 2)) % 2 == 0)[..., None]
        img = np.where(on, c1, np.array(COLORS[bg.color2], dtype=np.float32))
    else:
        img = np.broadcast_to(c1, (h, w, 3)).copy()
    # gentle diagonal light falloff, so no edge row or column is flat
    angle = rng.uniform(0, 2 * np.pi)
    ramp = (np.cos(angle) * (xx / w - 0.5) + np.sin(angle) * (yy / h - 0.5)) * 36.0
    return (img + ramp[..., None]).astype(np.float32)


def _polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]] | None:
    if shape == "triangle":
        return [(cx, cy - r), (cx + 0.92 * r, cy + 0.75 * r), (cx - 0.92 * r, cy + 0.75 * r)]
    if shape == "diamond":
        return [(cx, cy - r), (cx + 0.8 * r, cy), (cx, cy + r), (cx - 0.8 * r, cy)]
    return None


def _shape_mask(shape: str, centres: list[tuple[float, float]], r: float, w: int, h: int) -> np.ndarray:
    """Anti-aliased coverage in [0, 1]: drawn at SUPERSAMPLE x and box-filtered down."""
    k = SUPERSAMPLE
    m = Image.new("L", (w * k, h * k), 0)
    d = ImageDraw.Draw(m)
    for cx, cy in centres:
        cx, cy, rr = cx * k, cy * k, r * k
        if shape == "circle":
            d.ellipse([cx - rr, cy - rr, cx + rr, cy + rr], fill=255)
        elif shape == "square":
            s = 0.85 * rr
            d.rectangle([cx - s, cy - s, cx + s, cy + s], fill=255)
        else:
            d.polygon(_polygon(shape, cx, cy, rr), fill=255)
    return np.asarray(m.resize((w, h), Image.Resampling.BOX), dtype=np.float32) / 255.0


def _centres(
    s: Shape, layout: str, w: int, h: int, rng: np.random.Generator
) -> tuple[list[tuple[float, float]], float]:
    short = min(w, h)
    r = RADIUS[layout][s.size] * short
    fx, fy = POSITION_XY[s.position]
    cx = fx * w + rng.uniform(-0.04, 0.04) * short
    cy = fy * h + rng.uniform(-0.04, 0.04) * short
    if s.count == 1:
        return [(cx, cy)], r
    step = 2.3 * r
    offsets = [(i - (s.count - 1) / 2) * step for i in range(s.count)]
    vertical = s.position in ("left", "right") or (s.position == "center" and h > w)
    pts = [(cx, cy + o) if vertical else (cx + o, cy) for o in offsets]
    return pts, r


def _sign(img: np.ndarray, scene: Scene, w: int, h: int) -> np.ndarray:
    sw, sh = int(round(0.84 * w)), int(round(0.44 * h))
    x0, y0 = (w - sw) // 2, (h - sh) // 2
    color = np.array(COLORS[scene.sign_color], dtype=np.float32)
    img[y0 : y0 + sh, x0 : x0 + sw] = color
    dark_sign = float(np.dot(color, (0.299, 0.587, 0.114))) < 128
    ink = "white" if dark_sign else "black"
    layer = Image.new("L", (w, h), 0)
    d = ImageDraw.Draw(layer)
    size = max(int(sh * 0.7), 8)
    length = d.textlength(scene.text, font=ImageFont.load_default(size=size))
    if length > 0.9 * sw:  # text length scales with font size: one step to the size that fits
        size = max(int(size * 0.9 * sw / length), 8)
    font = ImageFont.load_default(size=size)
    d.text((w / 2, h / 2), scene.text, fill=255, font=font, anchor="mm")
    a = (np.asarray(layer, dtype=np.float32) / 255.0)[..., None]
    return img * (1 - a) + np.array(COLORS[ink], dtype=np.float32) * a


def render(scene: Scene, width: int, height: int) -> Image.Image:
    """Draw a scene at any size; the same scene and size always give the same pixels."""
    rng = np.random.default_rng(scene.layout_seed)
    img = _background(scene.background, width, height, rng)
    if len(scene.shapes) == 2:
        layout = "pair"
    else:
        layout = "single" if all(s.count == 1 for s in scene.shapes) else "counted"
    for s in scene.shapes:
        centres, r = _centres(s, layout, width, height, rng)
        a = _shape_mask(s.shape, centres, r, width, height)[..., None]
        img = img * (1 - a) + np.array(COLORS[s.color], dtype=np.float32) * a
    if scene.text is not None:
        img = _sign(img, scene, width, height)
    img = gaussian_filter(img, sigma=(EDGE_SOFTNESS, EDGE_SOFTNESS, 0))  # a lens, not a vector drawing
    img = img + NOISE_SIGMA * rng.standard_normal(img.shape, dtype=np.float32)
    return Image.fromarray(np.clip(np.rint(img), 0, 255).astype(np.uint8), "RGB")


# -------------------------------------------------------------------------------------------- prompts
@dataclass(frozen=True)
class PromptSpec:
    """An evaluation prompt with the attributes a checker can verify in the generated image."""

    prompt: str
    color: str
    shape: str
    count: int
    position: str
    size: str
    background: str
    scene: Scene = field(repr=False, compare=False, default=None)  # type: ignore[assignment]


_PROMPT_SHAPES = (
    # (colour, shape, size, position, count, background)
    ("red", "circle", "large", "left", 1, "blue"),
    ("yellow", "square", "large", "right", 1, "purple"),
    ("white", "triangle", "large", "top", 1, "green"),
    ("blue", "circle", "large", "bottom", 1, "yellow"),
    ("green", "diamond", "large", "center", 1, "white"),
    ("orange", "square", "small", "left", 1, "black"),
    ("pink", "circle", "small", "right", 1, "grey"),
    ("black", "square", "large", "center", 1, "red"),
    ("purple", "triangle", "large", "left", 1, "yellow"),
    ("red", "circle", "small", "center", 2, "white"),
    ("white", "square", "small", "top", 3, "blue"),
    ("yellow", "circle", "large", "bottom", 2, "black"),
)


def demo_prompts() -> list[PromptSpec]:
    """Twelve fixed prompts, written by `caption_for`, so they are in exactly the training caption style."""
    out = []
    for color, shape, size, position, count, bg in _PROMPT_SHAPES:
        family = "single_shape" if count == 1 else "counted_shapes"
        scene = Scene(family, Background(bg), (Shape(color, shape, size, position, count),))
        out.append(PromptSpec(caption_for(scene), color, shape, count, position, size, bg, scene))
    return out
