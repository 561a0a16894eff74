"""Pictures the tests share: structured scenes and the real-world file zoo (many containers, some broken)."""

import io
import struct
import zlib

import numpy as np
from PIL import Image

from kiln.config import load_config
from kiln.stage import run_stage


def scene(seed: int, size: int = 160, hue_shift: int = 0) -> Image.Image:
    """A picture with structure at several scales: a few coloured discs on a gradient."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size] / size
    img = np.stack([30 + 50 * xx, 110 + 60 * yy, 210 - 30 * xx], -1)
    for _ in range(5):
        cx, cy, r = rng.uniform(0.15, 0.85, 2).tolist() + [rng.uniform(0.08, 0.2)]
        img[(xx - cx) ** 2 + (yy - cy) ** 2 < r * r] = rng.integers(0, 256, 3)
    img += rng.normal(0, 4, img.shape)
    im = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    if hue_shift:
        h, s, v = im.convert("HSV").split()
        h = h.point(lambda x: (x + hue_shift) % 256)
        im = Image.merge("HSV", (h, s, v)).convert("RGB")
    return im


def encoded(im: Image.Image, fmt: str, **opts) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **opts)
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height and that holds no pixel data: a decompression bomb's header."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IEND", b"")
    )


def animated_gif(seed: int) -> bytes:
    frames = [scene(seed + k).convert("P", palette=Image.Palette.ADAPTIVE) for k in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=100)
    return buf.getvalue()


def sixteen_bit_png(seed: int) -> bytes:
    grey = np.asarray(scene(seed).convert("L"), np.uint16) * 257
    return encoded(Image.fromarray(grey), "PNG")


def rotated_jpeg(seed: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6
    return encoded(scene(seed).transpose(Image.Transpose.ROTATE_90), "JPEG", quality=92, exif=exif.tobytes())


# file name -> (bytes, expected filter outcome: None = kept, else the reason)
def mixed_files() -> dict[str, tuple[bytes, str | None]]:
    alpha = scene(4).convert("RGBA")
    alpha.putalpha(Image.new("L", alpha.size, 200))
    files = {
        "a/photo.jpg": (encoded(scene(1), "JPEG", quality=92), None),
        "a/alpha.png": (encoded(alpha, "PNG"), None),
        "a/anim.gif": (animated_gif(10), None),
        "b/scan.tif": (encoded(scene(5), "TIFF"), None),
        "b/old.bmp": (encoded(scene(6), "BMP"), None),
        "b/web.webp": (encoded(scene(7), "WEBP", quality=90), None),
        "b/pixmap.ppm": (encoded(scene(8), "PPM"), None),
        "b/greymap.pgm": (encoded(scene(9).convert("L"), "PPM"), None),
        "b/bitmap.pbm": (encoded(scene(11).convert("1"), "PPM"), "low_entropy"),  # 1 bit: two values
        "c/grey.png": (encoded(scene(12).convert("L"), "PNG"), None),
        "c/deep.png": (sixteen_bit_png(13), None),
        "c/print.jpg": (encoded(scene(14).convert("CMYK"), "JPEG", quality=92), None),
        "c/rotated.jpg": (rotated_jpeg(15), None),
        "c/really_a_jpeg.png": (encoded(scene(16), "JPEG", quality=92), None),
        "d/broken.jpg": (encoded(scene(17), "JPEG", quality=92)[:1500], "decode_error"),
        "d/bomb.png": (png_header_only(20000, 20000), "too_many_pixels"),
        "d/empty.jpg": (b"", "empty_file"),
        "d/page.jpg": (b"<html>404 Not Found</html>\n" * 3, "not_an_image"),
    }
    return files


def build_demo(root, n=160):
    """demo corpus -> ingest -> filter -> dedup -> embed under root; returns (config overrides, root)."""
    from assets.demo_corpus import write_demo_corpus

    write_demo_corpus(root / "raw", n=n, seed=0, size=96)
    overrides = [
        f"data.caption.truth={root / 'raw' / 'truth.parquet'}",
        f"data.clustering.review_db={root / 'review.duckdb'}",
    ]
    cfg = load_config(overrides)
    for stage, src, dst in (
        ("ingest", "raw", "manifest"),
        ("filter", "manifest", "filtered"),
        ("dedup", "filtered", "deduped"),
        ("embed", "deduped", "embedded"),
    ):
        run_stage(stage, root / src, root / dst, cfg)
    return overrides, root


def real_photos() -> dict[str, Image.Image]:
    """Real photographs that ship inside scikit-image (no download), as RGB."""
    import skimage.data as d

    names = ["astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field", "camera", "coins"]
    return {n: Image.fromarray(getattr(d, n)()).convert("RGB") for n in names}


def webdataset_tar(samples: dict[str, dict[str, bytes]]) -> bytes:
    """A WebDataset shard: for each key, its members (`key.jpg`, `key.txt`, `key.json`) in order."""
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for key, members in samples.items():
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size, info.mtime = len(data), 946_684_800
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()
