"""Pictures people would rather look at than read: image grids and line plots, as PNG bytes or files."""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw


def _as_image(x: Image.Image | np.ndarray) -> Image.Image:
    return x.convert("RGB") if isinstance(x, Image.Image) else Image.fromarray(np.asarray(x, dtype=np.uint8)).convert("RGB")


def image_grid(
    images: Sequence[Image.Image | np.ndarray],
    cols: int,
    cell: int = 96,
    labels: Sequence[str] | None = None,
    row_labels: Sequence[str] | None = None,
    label_width: int = 0,
) -> Image.Image:
    """Tile images into a grid, each fitted into a `cell`-px square (nearest-neighbour upscaling keeps
    small training images crisp). Optional per-image captions under each cell and labels per row."""
    n = len(images)
    rows = max(1, -(-n // cols))
    cap_h = 12 if labels else 0
    lw = label_width if row_labels else 0
    grid = Image.new("RGB", (lw + cols * cell, rows * (cell + cap_h)), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    for i, x in enumerate(images):
        im = _as_image(x)
        scale = cell / max(im.size)
        resample = Image.NEAREST if scale >= 1 else Image.LANCZOS
        im = im.resize((max(1, round(im.width * scale)), max(1, round(im.height * scale))), resample)
        r, c = divmod(i, cols)
        x0, y0 = lw + c * cell + (cell - im.width) // 2, r * (cell + cap_h) + (cell - im.height) // 2
        grid.paste(im, (x0, y0))
        if labels:
            draw.text((lw + c * cell + 2, r * (cell + cap_h) + cell), labels[i][: cell // 6], fill=(0, 0, 0))
    for r, text in enumerate(row_labels or []):
        y = r * (cell + cap_h) + 2
        for j in range(0, len(text), max(1, lw // 6)):  # wrap by characters; the default font is 6 px wide
            draw.text((2, y), text[j : j + max(1, lw // 6)], fill=(0, 0, 0))
            y += 11
    return grid


def png_bytes(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def markdown_image(im: Image.Image | bytes, alt: str = "image") -> str:
    """Inline PNG as markdown, for Dagster metadata (the UI renders data-URI images)."""
    data = im if isinstance(im, bytes) else png_bytes(im)
    return f"![{alt}](data:image/png;base64,{base64.b64encode(data).decode()})"


def line_plot(series: dict[str, Sequence[float]], x: Sequence[float] | None = None, title: str = "", xlabel: str = "step", path: Path | None = None, logy: bool = False) -> Image.Image:
    """A small matplotlib line plot (Agg backend), returned as a PIL image and optionally saved."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    for name, ys in series.items():
        ax.plot(list(x) if x is not None else range(len(ys)), list(ys), label=name, linewidth=1.2)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    im = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(buf.getvalue())
    return im
