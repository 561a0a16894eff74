"""Self-supervised style pairs and evaluation cases on the demo grammar (components/demo_scenes.py).

Style is the palette and background; content is the shape the prompt names. A training pair is a target
scene, its prompt without the background phrase (so only the reference can tell the model the background),
and a reference: another image of the same style family (same background and palette, another shape at
another place), or a crop of the target itself. An evaluation case pairs a prompt with a reference of
another shape, so the output's background measures transfer and its shape measures content leakage.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from components.demo_scenes import (
    COLORS,
    MIN_CONTRAST,
    POSITIONS,
    SHAPES,
    Scene,
    caption_for,
    render,
    sample_scene,
)


def content_prompt(scene: Scene) -> str:
    """The scene's caption without its background phrase: 'a large red circle on the left'."""
    return caption_for(scene).rsplit(", on ", 1)[0]


def _contrast(a: str, b: str) -> float:
    return float(np.linalg.norm(np.subtract(COLORS[a], COLORS[b], dtype=np.float64)))


def family_member(scene: Scene, rng: np.random.Generator) -> Scene:
    """Same background and palette, another shape at another position (a new layout seed)."""
    s = scene.shapes[0]
    shape = str(rng.choice([x for x in SHAPES if x != s.shape]))
    position = str(rng.choice([p for p in POSITIONS if p != s.position]))
    return replace(scene, shapes=(replace(s, shape=shape, position=position),), layout_seed=int(rng.integers(2**31)))


def random_crop(image: np.ndarray, rng: np.random.Generator, crop_min: float) -> np.ndarray:
    """A square crop whose side is a uniform share in [crop_min, 1] of the image's short side."""
    h, w = image.shape[:2]
    side = max(1, round(rng.uniform(crop_min, 1.0) * min(h, w)))
    y, x = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
    return image[y : y + side, x : x + side]


@dataclass(frozen=True)
class StylePair:
    target: np.ndarray  # uint8 [H, W, 3]
    prompt: str
    reference: np.ndarray  # uint8 [h, w, 3]


def style_pair(rng: np.random.Generator, height: int, width: int, mode: str, crop_min: float) -> StylePair:
    scene = sample_scene(rng, "single_shape")
    target = np.asarray(render(scene, width, height), np.uint8)
    if mode == "crop":
        reference = random_crop(target, rng, crop_min)
    elif mode == "family":
        reference = np.asarray(render(family_member(scene, rng), width, height), np.uint8)
    else:
        raise ValueError(f"unknown style reference mode {mode!r}: family or crop")
    return StylePair(target, content_prompt(scene), reference)


@dataclass(frozen=True)
class StyleCase:
    """One evaluation case: a prompt naming a large single shape (no background) and a reference image
    whose background is the style to transfer and whose shape is content that must not leak."""

    prompt: str
    color: str
    shape: str
    position: str
    reference: np.ndarray
    reference_background: str
    reference_shape: str


def style_cases(n: int, seed: int, height: int, width: int) -> list[StyleCase]:
    """`n` cases, a pure function of the seed: the prompt's shape always differs from the reference's and
    its colour stands out on the reference's background."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        ref = sample_scene(rng, "single_shape")
        if ref.background.pattern != "plain" or ref.shapes[0].size != "large":
            continue
        prompt = sample_scene(rng, "single_shape")
        s = prompt.shapes[0]
        if (
            s.size != "large"
            or s.count != 1
            or s.shape == ref.shapes[0].shape
            or _contrast(s.color, ref.background.color) < MIN_CONTRAST
        ):
            continue
        image = np.asarray(render(ref, width, height), np.uint8)
        out.append(
            StyleCase(
                content_prompt(prompt), s.color, s.shape, s.position, image, ref.background.color, ref.shapes[0].shape
            )
        )
    return out


def style_scores(images: np.ndarray, cases: list[StyleCase]) -> dict[str, float]:
    """Per image [N, H, W, 3] and its case: `transfer` (the background is the reference's, by
    training/evaluation/prompt_check.py's background rule), `leakage` (the drawn shape is the reference's shape, by its
    shape rule), `content` (the drawn shape is the prompt's) and `color` (the prompt's colour where the
    prompt puts the shape), each a mean over the cases."""
    from training.evaluation.prompt_check import (
        PALETTE_NAMES,
        background_color,
        dominant_color,
        nearest_color,
        shape_of,
        window,
    )

    rows = []
    for image, case in zip(images, cases, strict=True):
        bg, _ = background_color(image)
        drawn = shape_of(nearest_color(image) != PALETTE_NAMES.index(bg))
        rows.append(
            {
                "transfer": bg == case.reference_background,
                "leakage": drawn == case.reference_shape,
                "content": drawn == case.shape,
                "color": dominant_color(window(image, case.position), bg) == case.color,
            }
        )
    return {k: round(float(np.mean([r[k] for r in rows])), 4) for k in ("transfer", "leakage", "content", "color")}
