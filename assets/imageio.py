"""Opening images the same way everywhere: EXIF-upright, RGB, with the pixel limit enforced."""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image, ImageOps


class PixelLimitError(ValueError):
    pass


def open_rgb(data: bytes, max_pixels: int = 64_000_000) -> Image.Image:
    """Decode to an upright RGB image; alpha is composited on white, palette / CMYK / 16-bit converted."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        im = Image.open(io.BytesIO(data))
        if im.width * im.height > max_pixels:
            raise PixelLimitError(f"{im.width}x{im.height} is over {max_pixels} pixels")
        im = ImageOps.exif_transpose(im)
        if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
            im = im.convert("RGBA")
            bg = Image.new("RGBA", im.size, (255, 255, 255, 255))
            im = Image.alpha_composite(bg, im)
        if im.mode in ("I;16", "I;16B", "I;16L", "I"):
            a = np.asarray(im, dtype=np.float64)
            im = Image.fromarray(np.clip(a / max(a.max(), 1) * 255, 0, 255).astype(np.uint8))
        return im.convert("RGB")
