"""Pictures people would rather look at than read: image grids and line plots, as PNG bytes or files."""

from __future__ import annotations

import base64
import io
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw


def _as_image(x: Image.Image | np.ndarray) -> Image.Image:
    return (
        x.convert("RGB")
        if isinstance(x, Image.Image)
        else Image.fromarray(np.asarray(x, dtype=np.uint8)).convert("RGB")
    )


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
    chars = max(1, cell // 6)  # the default font is 6 px wide: a label wraps rather than being cut
    wrapped = [textwrap.wrap(str(t), chars, break_on_hyphens=False) or [""] for t in labels] if labels else []
    cap_h = 11 * max(len(w) for w in wrapped) + 2 if wrapped else 0
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
        for k, line in enumerate(wrapped[i] if labels else []):
            draw.text((lw + c * cell + 2, r * (cell + cap_h) + cell + 11 * k), line, fill=(0, 0, 0))
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


def line_plot(
    series: dict[str, Sequence[float]],
    x: Sequence[float] | None = None,
    title: str = "",
    xlabel: str = "step",
    path: Path | None = None,
    logy: bool = False,
) -> Image.Image:
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


def panel_plot(
    panels: dict[str, dict[str, Sequence[float | None]]],
    x: Sequence[float],
    title: str = "",
    xlabel: str = "step",
    path: Path | None = None,
) -> Image.Image:
    """Side-by-side line plots sharing x, one per quantity with its own y scale (a loss of 0.13 beside an
    accuracy of 0.8 stays readable); every point is marked, so a history of one checkpoint is a visible dot.
    `panels`: {panel title: {series: ys}}, None for a missing value. Matplotlib (Agg): no display, no network."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2), dpi=100, squeeze=False)
    for ax, (name, series) in zip(axes[0], panels.items(), strict=True):
        for label, ys in series.items():
            ax.plot(
                list(x),
                [float("nan") if y is None else float(y) for y in ys],
                marker="o",
                markersize=4,
                linewidth=1.2,
                label=label,
            )
        ax.set_title(name, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(buf.getvalue())
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def placeholder_tile(size: int = 64, text: str = "undecodable") -> Image.Image:
    """A grey tile crossed out, standing in for a file that could not be decoded (a decode_error reject)."""
    im = Image.new("RGB", (size, size), (222, 222, 222))
    draw = ImageDraw.Draw(im)
    draw.line((0, 0, size - 1, size - 1), fill=(170, 60, 60), width=2)
    draw.line((0, size - 1, size - 1, 0), fill=(170, 60, 60), width=2)
    draw.text((2, size // 2 - 5), text[: max(1, size // 6)], fill=(0, 0, 0))
    return im


def bar_chart(
    groups: dict[str, dict[str, float]], title: str = "", ylabel: str = "", ylim: tuple[float, float] | None = None
) -> Image.Image:
    """Grouped bars (matplotlib, Agg: no display, no network): one group per outer key, one bar per series.
    `groups`: {series: {category: value}}, e.g. {"trained": {"color": 0.4}, "untrained": {"color": 0.1}}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    categories = list(dict.fromkeys(c for vals in groups.values() for c in vals))
    width = 0.8 / max(1, len(groups))
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    for k, (series, vals) in enumerate(groups.items()):
        xs = [i + (k - (len(groups) - 1) / 2) * width for i in range(len(categories))]
        bars = ax.bar(xs, [vals.get(c, 0.0) or 0.0 for c in categories], width, label=series)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(categories)), categories)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    if ylim:
        ax.set_ylim(*ylim)
    ax.grid(axis="y", alpha=0.3)
    if len(groups) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def svg_sparkline(values: Sequence[float], width: int = 240, height: int = 48, points: int = 48) -> str:
    """A line as a small inline SVG data URI (a few hundred characters): small enough for Dagster to show a
    markdown value without a click (it inlines markdown under 1,000 characters)."""
    vals = [float(v) for v in values if v == v]
    if len(vals) > points:  # keep the shape: the mean of each of `points` equal slices
        edges = [round(i * len(vals) / points) for i in range(points + 1)]
        vals = [sum(vals[a:b]) / (b - a) for a, b in zip(edges, edges[1:]) if b > a]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = (hi - lo) or 1.0
    step = (width - 2) / max(1, len(vals) - 1)
    pts = " ".join(f"{1 + i * step:.0f},{1 + (height - 2) * (hi - v) / span:.0f}" for i, v in enumerate(vals))
    svg = f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}'><polyline fill='none' stroke='#4f43dd' stroke-width='1.5' points='{pts}'/></svg>"
    return "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode()
