"""Training pictures: the loss curve and the labelled sample grid (drawing is kiln.viz's job)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from kiln.viz import image_grid, line_plot


def ema(values: Sequence[float], beta: float = 0.9) -> list[float]:
    """Bias-corrected exponential moving average: flow-matching losses are noisy per step."""
    out, m = [], 0.0
    for i, v in enumerate(values, 1):
        m = beta * m + (1 - beta) * v
        out.append(m / (1 - beta**i))
    return out


def plot_loss(records: list[dict], path: Path) -> Image.Image:
    steps = [r["step"] for r in records]
    losses = [r["loss"] for r in records]
    return line_plot(
        {"loss": losses, "loss (ema)": ema(losses)},
        x=steps,
        title="training loss (v-prediction MSE)",
        path=path,
        logy=True,
    )


def sample_grid(images: np.ndarray, prompts: Sequence[str], cell: int = 96, label_width: int = 180) -> Image.Image:
    """One row per prompt, the prompt written at the left; `images` is uint8 [P, N, H, W, 3].
    Cells are upscaled nearest-neighbour so 32 px samples stay readable."""
    p, n = images.shape[:2]
    if p != len(prompts):
        raise ValueError(f"{p} rows of images for {len(prompts)} prompts")
    flat = [images[i, j] for i in range(p) for j in range(n)]
    return image_grid(flat, cols=n, cell=cell, row_labels=list(prompts), label_width=label_width)
