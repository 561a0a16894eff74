"""Opening images the same way everywhere: EXIF-upright, RGB, with the pixel limit enforced.

Kiln enforces its own pixel limit (`max_pixels`, checked on the header before any decode), so PIL's
global decompression-bomb guard is switched off only while a header is read: the filter stage must
see a bomb's size to reject it with a reason, not crash on it.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO

import numpy as np
from PIL import Image

EXIF_ORIENTATION_TAG = 0x0112

# EXIF orientation -> the transpose that makes the image upright (the table of ImageOps.exif_transpose).
UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


class PixelLimitError(ValueError):
    pass


@contextmanager
def _own_pixel_limit() -> Iterator[None]:
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def open_header(data: bytes | BinaryIO) -> Image.Image:
    """Parse the header only (lazy PIL open) of bytes or a seekable file: format, size, mode; nothing is decoded yet."""
    with _own_pixel_limit():
        return Image.open(io.BytesIO(data) if isinstance(data, bytes | bytearray | memoryview) else data)


def exif_orientation(im: Image.Image) -> int:
    """The EXIF orientation (1..8) read from the header; 0 when absent or invalid.

    PNG keeps EXIF after the pixel data unless an eXIf chunk comes first; PIL would decode the whole
    image to find it, so a PNG without header EXIF counts as having none.
    """
    if im.format == "PNG" and "exif" not in im.info:
        return 0
    try:
        value = int(im.getexif().get(EXIF_ORIENTATION_TAG, 0))
    except Exception:  # noqa: BLE001 - a corrupt EXIF block is not a corrupt image
        return 0
    return value if 1 <= value <= 8 else 0


def upright(im: Image.Image, orientation: int) -> Image.Image:
    return im.transpose(UPRIGHT[orientation]) if orientation in UPRIGHT else im


def to_rgb(im: Image.Image) -> Image.Image:
    """Any PIL mode to 8-bit RGB: alpha composited on white, 16-bit scaled by 1/257, float in [0, 1] by 255."""
    if im.mode == "RGB":
        return im
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (im.mode == "P" and "transparency" in im.info):
        im = im.convert("RGBA")
        bg = Image.new("RGBA", im.size, (255, 255, 255, 255))
        return Image.alpha_composite(bg, im).convert("RGB")
    if im.mode.startswith("I") or im.mode == "F":
        a = np.asarray(im, dtype=np.float64)
        peak = float(a.max()) if a.size else 0.0
        if im.mode == "F" and peak <= 1.0:
            a = a * 255.0
        elif im.mode != "F" and (im.mode.startswith("I;16") or peak > 255):
            a = a / 257.0
        return Image.fromarray(np.clip(np.rint(a), 0, 255).astype(np.uint8), "L").convert("RGB")
    return im.convert("RGB")  # L, 1, P, CMYK, YCbCr, LAB, HSV


def open_rgb(data: bytes, max_pixels: int = 64_000_000) -> Image.Image:
    """Decode to an upright RGB image; alpha is composited on white, palette / CMYK / 16-bit converted."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        im = open_header(data)
        if im.width * im.height > max_pixels:
            raise PixelLimitError(f"{im.width}x{im.height} is over {max_pixels} pixels")
        orientation = exif_orientation(im)
        im.load()
        return upright(to_rgb(im), orientation)
