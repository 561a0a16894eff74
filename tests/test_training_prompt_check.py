"""The verifiable prompt-following checker: right images score 1.0, wrong ones 0.0, per attribute."""

from dataclasses import replace

import numpy as np
import pytest

from components.demo_scenes import COLORS, demo_prompts, render
from training.evaluation.prompt_check import (
    ATTRIBUTES,
    CONDITIONAL_ATTRIBUTES,
    Expected,
    accuracy,
    check_image,
    expected_from_specs,
)

SPECS = demo_prompts()
OPPOSITE = {"left": "right", "right": "left", "top": "bottom", "bottom": "top", "center": "left"}


def drawn(spec, layout_seed=0, size=(32, 32)):
    return np.asarray(render(replace(spec.scene, layout_seed=layout_seed), *size))


def disc(bg, fg, cx, cy, r=7, size=32):
    """A hand-drawn image: one flat disc on a flat background."""
    yy, xx = np.mgrid[0:size, 0:size]
    img = np.empty((size, size, 3), np.uint8)
    img[:] = COLORS[bg]
    img[(xx - cx) ** 2 + (yy - cy) ** 2 <= r * r] = COLORS[fg]
    return img


@pytest.mark.parametrize("layout_seed", [0, 1, 2])
def test_the_renderers_own_images_of_every_demo_prompt_score_one(layout_seed):
    images = np.stack([drawn(s, layout_seed) for s in SPECS])[:, None]
    assert accuracy(images, expected_from_specs(SPECS)) == {
        a: 1.0 for a in (*ATTRIBUTES, *CONDITIONAL_ATTRIBUTES, "all")
    }


def test_hand_drawn_discs_are_read_correctly():
    assert all(check_image(disc("blue", "red", 8, 16), Expected("red", "left", "blue")).values())
    assert all(check_image(disc("black", "yellow", 16, 25), Expected("yellow", "bottom", "black")).values())
    assert all(check_image(disc("white", "green", 16, 16), Expected("green", "center", "white")).values())


def test_wrong_colour_position_and_background_score_zero():
    wrong = []
    for s in SPECS:
        other_colour = next(c for c in ("green", "purple", "orange") if c not in (s.color, s.background))
        other_bg = next(c for c in ("grey", "pink", "orange") if c not in (s.color, s.background, other_colour))
        wrong.append(Expected(other_colour, OPPOSITE[s.position], other_bg))
    images = np.stack([drawn(s) for s in SPECS])[:, None]
    assert accuracy(images, wrong) == {a: 0.0 for a in (*ATTRIBUTES, "all")}


def test_a_blank_background_has_no_shape_colour_and_no_position():
    blank = np.full((32, 32, 3), COLORS["blue"], np.uint8)
    assert check_image(blank, Expected("red", "left", "blue")) == {
        "color": False,
        "position": False,
        "background": True,
    }


def test_a_shape_on_the_wrong_side_fails_colour_and_position_only():
    r = check_image(disc("blue", "red", 24, 16), Expected("red", "left", "blue"))
    assert r == {"color": False, "position": False, "background": True}


def test_noise_has_no_layout_so_position_count_and_shape_fail():
    """An untrained model samples noise: its centroid is in the middle and its ink profile one broad hump,
    which would pass 'center' and 'one shape' prompts if the checker did not first ask for a figure on a ground."""
    noise = (np.random.default_rng(0).standard_normal((32, 32, 3)) * 127.5 + 127.5).clip(0, 255).astype(np.uint8)
    result = check_image(noise, Expected("red", "center", "grey", "circle", 1, "large"))
    assert result["position"] is False and result["count"] is False and result["shape"] is False
