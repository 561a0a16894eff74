"""The demo corpus: raw image files with ground truth, so every data stage can be checked against it.

`write_demo_corpus(out, n, seed)` writes `out/images/<shard>/<index>.<ext>` and `out/truth.parquet`.
Most files are procedural scenes (`components.demo_scenes`) with captions known by construction, a few
are real photographs shipped inside scikit-image, and about a fifth are bad or tricky inputs, each
with the reason code (`kiln.reasons.Reason`) the pipeline is expected to give it.

Each bad image is built to fail one filter rule clearly (a smooth wash for low_laplacian, flat blocks
of two or three colours for low_entropy, ...), so its expected reason does not hang on the order the
filter checks its rules in. Derived files always get a larger index than their original. Near
duplicates are smaller or more compressed than their original, so a dedup that keeps the most pixels,
then the largest file, keeps the original. Exact duplicates are byte copies: which of the two survives
is an arbitrary tie-break (the truth marks the copy as the reject; a checker should accept either,
as long as exactly one file of each md5 stays).

Byte-identical for the same (n, seed, size): fixed encoder options, no timestamps or metadata, every
random draw from a seeded generator.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
from PIL import Image
from pydantic import BaseModel

from components.demo_scenes import Scene, caption_for, recolor, render, sample_scene
from kiln.reasons import Reason
from kiln.schemas import arrow_schema
from kiln.stage import write_table


class TruthRow(BaseModel):
    """Ground truth of one demo file."""

    file: str  # relative to out/images
    md5: str
    bytes: int
    format: str | None  # what the bytes really are (not the extension); None for non-images
    width: int | None  # as stored, before any EXIF rotation
    height: int | None
    category: str
    family: str | None  # scene family, "photo", or None for garbage
    expected: str  # keep | reject
    expected_reason: str | None  # a kiln.reasons.Reason code when rejected
    dup_of: str | None  # file of the original (exact and near duplicates); for a byte copy, either may be kept
    variant_of: str | None  # file of the scene a colour variant re-colours
    caption: str | None  # known by construction; None where there is nothing to describe
    scene: str | None  # Scene JSON (demo_scenes.Scene.to_json), or {"family": "photo", ...}


TRUTH = arrow_schema(TruthRow)

# files per category at n = 480; other n scale these (at least one of each)
CATEGORY_COUNTS = {
    # tricky but good: kept
    "photo": 8,
    "color_variant": 12,
    "exif_rotated": 4,
    "wrong_extension": 4,
    "greyscale": 4,
    "png_alpha": 4,
    # bad: rejected
    "truncated": 10,
    "zero_bytes": 6,
    "not_image": 6,
    "tiny": 10,
    "extreme_aspect": 10,
    "flat": 6,
    "few_colors": 6,
    "noise": 8,
    "border": 10,
    "exact_dup": 12,
    "near_dup_resized": 8,
    "near_dup_recompressed": 8,
    "near_dup_cropped": 8,
}
EXPECTED_REASON = {
    "truncated": Reason.DECODE_ERROR,
    "zero_bytes": Reason.EMPTY_FILE,
    "not_image": Reason.NOT_AN_IMAGE,
    "tiny": Reason.TOO_SMALL,
    "extreme_aspect": Reason.BAD_ASPECT,
    "flat": Reason.LOW_LAPLACIAN,  # a smooth colour wash: no detail, yet a full histogram
    "few_colors": Reason.LOW_ENTROPY,  # two or three flat colours in blocks: detail, but no histogram
    "noise": Reason.HIGH_LAPLACIAN,
    "border": Reason.BORDER,
    "exact_dup": Reason.EXACT_DUPLICATE,
    "near_dup_resized": Reason.NEAR_DUPLICATE,
    "near_dup_recompressed": Reason.NEAR_DUPLICATE,
    "near_dup_cropped": Reason.NEAR_DUPLICATE,
}
DERIVED = ("exact_dup", "near_dup_resized", "near_dup_recompressed", "near_dup_cropped", "color_variant")
FAMILY_WEIGHTS = {
    "single_shape": 0.4,
    "counted_shapes": 0.2,
    "two_shapes": 0.15,
    "text_sign": 0.1,
    "pattern_background": 0.15,
}
# a few scenes in less common containers (category stays "scene")
RARE_FORMATS = {"WEBP": 6, "BMP": 4, "GIF": 4, "TIFF": 4}
EXT = {"PNG": "png", "JPEG": "jpg", "WEBP": "webp", "BMP": "bmp", "GIF": "gif", "TIFF": "tif"}
SHARD_FILES = 200  # files per subfolder of images/

# photographs that ship inside scikit-image's data dir (no download), captioned honestly
PHOTOS = (
    ("astronaut.png", "a photograph of an astronaut"),
    ("coffee.png", "a photograph of a cup of coffee"),
    ("chelsea.png", "a photograph of a cat"),
    ("rocket.jpg", "a photograph of a rocket on a launch pad"),
    ("motorcycle_left.png", "a photograph of a motorcycle"),
    ("camera.png", "a black and white photograph of a man with a camera"),
    ("coins.png", "a black and white photograph of old coins"),
    ("retina.jpg", "a photograph of a human retina"),
)
PHOTO_LONG_SIDE = 288


@dataclass
class Entry:
    """One file to write, before it has its final index."""

    category: str
    data: bytes
    ext: str
    format: str | None
    size: tuple[int, int] | None
    family: str | None = None
    caption: str | None = None
    scene: str | None = None
    source: int | None = None  # entry number of the original (derived files)
    file: str = ""
    source_file: str | None = None  # the original's file name, once files are named


# ------------------------------------------------------------------------------------------ encoding
def encode(im: Image.Image, fmt: str, **opts) -> bytes:
    """Fixed encoder options, no metadata: the same pixels always give the same bytes."""
    buf = io.BytesIO()
    if fmt == "JPEG":
        extra = {k: v for k, v in opts.items() if k != "quality"}  # e.g. exif
        im.save(buf, "JPEG", quality=opts.get("quality", 90), optimize=False, progressive=False, **extra)
    elif fmt == "PNG":
        im.save(buf, "PNG", optimize=False, compress_level=6)
    elif fmt == "WEBP":
        im.save(buf, "WEBP", quality=90, method=4)
    elif fmt == "GIF":
        im.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(buf, "GIF")
    elif fmt == "TIFF":
        im.save(buf, "TIFF", compression="tiff_deflate")
    elif fmt == "BMP":
        im.save(buf, "BMP")
    else:
        raise ValueError(f"no encoder for {fmt}")
    return buf.getvalue()


def decode(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


# -------------------------------------------------------------------------------------------- sizing
def scene_size(rng: np.random.Generator, size: int) -> tuple[int, int]:
    """Mostly about size x size; a quarter landscape or portrait between 1.4:1 and 2:1."""
    if rng.random() < 0.25:
        a = rng.uniform(1.4, 2.0)
        long, short = int(round(size * a**0.5)), int(round(size / a**0.5))
        return (long, short) if rng.random() < 0.5 else (short, long)
    return int(round(size * rng.uniform(0.85, 1.2))), int(round(size * rng.uniform(0.85, 1.2)))


def plan_counts(n: int) -> dict[str, int]:
    """Files per category for n files: CATEGORY_COUNTS scaled, at least one each, the rest scenes."""
    scale = n / 480
    counts = {c: max(1, int(round(k * scale))) for c, k in CATEGORY_COUNTS.items()}
    counts["photo"] = min(counts["photo"], len(PHOTOS))
    counts["scene"] = n - sum(counts.values())
    if counts["scene"] < sum(counts[c] for c in DERIVED):
        raise ValueError(f"n={n} is too small for a corpus with every category")
    return counts


# ---------------------------------------------------------------------------------------- the builder
class _Builder:
    def __init__(self, seed: int, size: int):
        self.rng = np.random.default_rng(seed)
        self.size = size
        self.entries: list[Entry] = []
        self.signatures: set[tuple] = set()

    def add(self, e: Entry) -> int:
        self.entries.append(e)
        return len(self.entries) - 1

    def new_scene(self, family: str | None = None, palette: str = "color") -> Scene:
        """A scene no other file shows: two kept scenes must not be near-duplicates by accident."""
        for _ in range(1000):
            fam = family or str(self.rng.choice(list(FAMILY_WEIGHTS), p=list(FAMILY_WEIGHTS.values())))
            s = sample_scene(self.rng, fam, palette)
            if s.signature() not in self.signatures:
                self.signatures.add(s.signature())
                return s
        raise RuntimeError("could not draw a new unique scene")

    def scene_entry(
        self, category: str, scene: Scene, im: Image.Image, fmt: str, ext: str | None = None, **opts
    ) -> Entry:
        data = encode(im, fmt, **opts)
        return Entry(category, data, ext or EXT[fmt], fmt, im.size, scene.family, caption_for(scene), scene.to_json())

    # --- kept
    def scenes(self, k: int) -> list[int]:
        formats = [f for f, c in RARE_FORMATS.items() for _ in range(max(1, round(c * k / 330)))]
        formats += ["PNG" if self.rng.random() < 0.55 else "JPEG" for _ in range(k - len(formats))]
        out = []
        for fmt in formats:
            s = self.new_scene()
            out.append(self.add(self.scene_entry("scene", s, render(s, *scene_size(self.rng, self.size)), fmt)))
        return out

    def photos(self, k: int) -> None:
        import skimage

        data_dir = Path(skimage.data.__file__).parent
        for name, caption in PHOTOS[:k]:
            im = Image.open(data_dir / name)
            im = im.convert("L" if im.mode in ("L", "I;16") else "RGB")
            scale = PHOTO_LONG_SIDE / max(im.size)
            im = im.resize((round(im.width * scale), round(im.height * scale)), Image.Resampling.LANCZOS)
            scene = f'{{"family":"photo","source":"skimage:{name}"}}'
            self.add(Entry("photo", encode(im, "JPEG"), "jpg", "JPEG", im.size, "photo", caption, scene))

    def tricky(self, category: str, k: int) -> None:
        for _ in range(k):
            if category == "greyscale":
                s = self.new_scene("single_shape", palette="grey")
                im = render(s, *scene_size(self.rng, self.size)).convert("L")
                self.add(self.scene_entry(category, s, im, "PNG"))
                continue
            s = self.new_scene()
            im = render(s, *scene_size(self.rng, self.size))
            if category == "exif_rotated":
                # stored turned a quarter, with the EXIF tag that turns it back upright
                orientation = 6 if self.rng.random() < 0.5 else 8
                stored = im.transpose(Image.Transpose.ROTATE_90 if orientation == 6 else Image.Transpose.ROTATE_270)
                exif = Image.Exif()
                exif[0x0112] = orientation
                self.add(self.scene_entry(category, s, stored, "JPEG", exif=exif.tobytes()))
            elif category == "wrong_extension":
                self.add(self.scene_entry(category, s, im, "JPEG", ext="png"))
            elif category == "png_alpha":
                self.add(self.scene_entry(category, s, with_feathered_alpha(im), "PNG"))
            else:
                raise ValueError(category)

    # --- rejected
    def bad(self, category: str, k: int) -> None:
        for _ in range(k):
            self.add(self.bad_entry(category))

    def bad_entry(self, category: str) -> Entry:
        rng, size = self.rng, self.size
        if category == "zero_bytes":
            return Entry(category, b"", str(rng.choice(["jpg", "png"])), None, None)
        if category == "not_image":
            return Entry(category, not_image_bytes(rng), str(rng.choice(["jpg", "png", "webp"])), None, None)
        if category == "flat":
            im = color_wash(rng, *scene_size(rng, size))
            return Entry(category, encode(im, "PNG"), "png", "PNG", im.size)
        if category == "few_colors":
            im = few_color_blocks(rng, *scene_size(rng, size))
            return Entry(category, encode(im, "PNG"), "png", "PNG", im.size)
        if category == "noise":
            w, h = scene_size(rng, size)
            im = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")
            return Entry(category, encode(im, "PNG"), "png", "PNG", im.size)
        s = self.new_scene()
        if category == "truncated":
            fmt = "PNG" if rng.random() < 0.5 else "JPEG"
            e = self.scene_entry(category, s, render(s, *scene_size(rng, size)), fmt)
            e.data = e.data[: int(len(e.data) * rng.uniform(0.4, 0.7))]
            e.caption = e.scene = None  # nothing decodable to describe
            return e
        if category == "tiny":
            side = int(rng.integers(12, 29))
            return self.scene_entry(category, s, render(s, side, int(rng.integers(side, 31))), "PNG")
        if category == "extreme_aspect":
            short = int(rng.integers(48, 80))
            long = int(short * rng.uniform(3.6, 5.0))
            wh = (long, short) if rng.random() < 0.5 else (short, long)
            return self.scene_entry(category, s, render(s, *wh), "JPEG")
        if category == "border":
            return self.scene_entry(category, s, with_border(rng, render(s, *scene_size(rng, size))), "PNG")
        raise ValueError(category)

    def derived(self, category: str, source: int) -> int:
        src = self.entries[source]
        if category == "exact_dup":
            e = Entry(category, src.data, src.ext, src.format, src.size)
        elif category == "color_variant":
            variant = recolor(Scene.from_json(src.scene), self.rng)
            self.signatures.add(variant.signature())
            e = self.scene_entry(category, variant, render(variant, *src.size), src.format)
        else:
            im = decode(src.data)
            if category == "near_dup_resized":
                scale = self.rng.uniform(0.7, 0.85)
                im = im.resize((round(im.width * scale), round(im.height * scale)), Image.Resampling.LANCZOS)
                fmt = src.format
            elif category == "near_dup_recompressed":
                fmt = "JPEG"
            elif category == "near_dup_cropped":
                im = crop_slightly(self.rng, im)
                fmt = src.format
            else:
                raise ValueError(category)
            quality = int(self.rng.integers(45, 66)) if category == "near_dup_recompressed" else 90
            data = encode(im, fmt, quality=quality) if fmt == "JPEG" else encode(im, fmt)
            e = Entry(category, data, EXT[fmt], fmt, im.size)
        if category != "color_variant":
            e.family, e.caption, e.scene = src.family, src.caption, src.scene
        e.source = source
        return self.add(e)


# --------------------------------------------------------------------------------- image ingredients
def with_feathered_alpha(im: Image.Image) -> Image.Image:
    """RGBA, opaque in the middle and fading to 75% at the edges (composited on white it stays readable)."""
    w, h = im.size
    yy, xx = np.mgrid[0:h, 0:w]
    edge = np.minimum(np.minimum(xx, w - 1 - xx), np.minimum(yy, h - 1 - yy)) / (0.15 * min(w, h))
    alpha = (255 * (0.75 + 0.25 * np.clip(edge, 0, 1))).astype(np.uint8)
    out = im.convert("RGBA")
    out.putalpha(Image.fromarray(alpha, "L"))
    return out


def with_border(rng: np.random.Generator, im: Image.Image) -> Image.Image:
    """Exactly flat black or white bands covering about half the picture: letterbox, pillarbox or frame."""
    w, h = im.size
    color = (0, 0, 0) if rng.random() < 0.5 else (255, 255, 255)
    kind = str(rng.choice(["letterbox", "pillarbox", "frame"]))
    out = Image.new("RGB", (w, h), color)
    if kind == "letterbox":
        band = int(round(h * rng.uniform(0.24, 0.3)))
        box = (0, band, w, h - band)
    elif kind == "pillarbox":
        band = int(round(w * rng.uniform(0.24, 0.3)))
        box = (band, 0, w - band, h)
    else:
        bx, by = int(round(w * rng.uniform(0.16, 0.2))), int(round(h * rng.uniform(0.16, 0.2)))
        box = (bx, by, w - bx, h - by)
    inner = im.resize((box[2] - box[0], box[3] - box[1]), Image.Resampling.LANCZOS)
    out.paste(inner, box[:2])
    return out


def color_wash(rng: np.random.Generator, w: int, h: int) -> Image.Image:
    """A smooth diagonal blend of two far-apart colours: no detail at all, yet hundreds of distinct values."""
    c1 = rng.integers(0, 80, 3).astype(np.float64)
    c2 = rng.integers(176, 256, 3).astype(np.float64)
    yy, xx = np.mgrid[0:h, 0:w]
    t = ((xx / max(w - 1, 1) + yy / max(h - 1, 1)) / 2)[..., None]
    return Image.fromarray(np.rint(c1 * (1 - t) + c2 * t).astype(np.uint8), "RGB")


def few_color_blocks(rng: np.random.Generator, w: int, h: int) -> Image.Image:
    """Blocks of two or three flat, mid-contrast colours: edges to measure, almost no histogram."""
    k = int(rng.integers(2, 4))
    base = rng.integers(90, 166, 3)
    palette = np.stack([np.clip(base + d, 0, 255) for d in (0, 40, -40)[:k]]).astype(np.uint8)
    block = int(rng.integers(12, 20))
    grid = rng.integers(0, k, (h // block + 1, w // block + 1))
    idx = np.repeat(np.repeat(grid, block, 0), block, 1)[:h, :w]
    return Image.fromarray(palette[idx], "RGB")


def crop_slightly(rng: np.random.Generator, im: Image.Image) -> Image.Image:
    """Trim 2-4% of each dimension, split unevenly between the two sides."""
    w, h = im.size
    cx, cy = int(round(w * rng.uniform(0.02, 0.04))), int(round(h * rng.uniform(0.02, 0.04)))
    lx, ty = int(rng.integers(0, cx + 1)), int(rng.integers(0, cy + 1))
    return im.crop((lx, ty, w - (cx - lx), h - (cy - ty)))


def not_image_bytes(rng: np.random.Generator) -> bytes:
    """What a crawler saves behind an image url when the server answers with something else."""
    pages = (
        b"<!DOCTYPE html>\n<html><head><title>404 Not Found</title></head>\n<body><h1>Not Found</h1></body></html>\n",
        b'{"error": "rate limited", "retry_after": 30}\n',
        b"Access denied. You do not have permission to view this resource.\n",
    )
    page = pages[int(rng.integers(len(pages)))]
    return page * int(rng.integers(1, 6))


# ------------------------------------------------------------------------------------------ assembly
def _final_order(entries: list[Entry], rng: np.random.Generator) -> list[int]:
    """A shuffled file order in which every derived file comes after its original."""
    waiting: dict[int, list[int]] = {}
    placed: set[int] = set()
    order: list[int] = []

    def place(i: int) -> None:
        order.append(i)
        placed.add(i)
        for j in waiting.pop(i, []):
            place(j)

    for i in rng.permutation(len(entries)).tolist():
        src = entries[i].source
        if src is not None and src not in placed:
            waiting.setdefault(src, []).append(i)
        else:
            place(i)
    return order


def build_entries(n: int, seed: int, size: int) -> list[Entry]:
    """Every file of the corpus with its truth, in final order with final file names."""
    counts = plan_counts(n)
    b = _Builder(seed, size)
    scene_ids = b.scenes(counts["scene"])
    b.photos(counts["photo"])
    for c in ("exif_rotated", "wrong_extension", "greyscale", "png_alpha"):
        b.tricky(c, counts[c])
    for c in EXPECTED_REASON:
        if c not in DERIVED:
            b.bad(c, counts[c])
    # each derived file has its own original, one of the plain PNG / JPEG scenes
    plain = [i for i in scene_ids if b.entries[i].format in ("PNG", "JPEG")]
    sources = iter(b.rng.permutation(plain).tolist())
    for c in DERIVED:
        for _ in range(counts[c]):
            b.derived(c, next(sources))
    order = _final_order(b.entries, b.rng)
    for index, i in enumerate(order):
        e = b.entries[i]
        e.file = f"{index // SHARD_FILES:02d}/{index:05d}.{e.ext}"
    for e in b.entries:
        if e.source is not None:
            e.source_file = b.entries[e.source].file
    return [b.entries[i] for i in order]


def truth_table(entries: list[Entry]) -> pa.Table:
    rows: dict[str, list] = {name: [] for name in TRUTH.names}
    for e in entries:
        variant = e.category == "color_variant"
        reason = EXPECTED_REASON.get(e.category)
        values = {
            "file": e.file,
            "md5": hashlib.md5(e.data).hexdigest(),
            "bytes": len(e.data),
            "format": e.format,
            "width": e.size[0] if e.size else None,
            "height": e.size[1] if e.size else None,
            "category": e.category,
            "family": e.family,
            "expected": "reject" if reason else "keep",
            "expected_reason": str(reason) if reason else None,
            "dup_of": None if variant else e.source_file,
            "variant_of": e.source_file if variant else None,
            "caption": e.caption,
            "scene": e.scene,
        }
        for k, v in values.items():
            rows[k].append(v)
    return pa.Table.from_pydict(rows, schema=TRUTH).replace_schema_metadata({"kiln.source": "demo-truth"})


# Every demo file gets this modification time (2000-01-01 UTC): a source's listing records mtimes as object
# versions, and a corpus written again must list, and so reproduce downstream, byte for byte.
DEMO_MTIME = 946_684_800


def write_demo_corpus(out: Path, n: int, seed: int, size: int = 96) -> pa.Table:
    """Write n files under out/images and their ground truth to out/truth.parquet (also returned)."""
    out = Path(out)
    entries = build_entries(n, seed, size)
    for e in entries:
        path = out / "images" / e.file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(e.data)
        os.utime(path, (DEMO_MTIME, DEMO_MTIME))
    table = truth_table(entries)
    write_table(table, out / "truth.parquet")
    (out / "demo.json").write_text(demo_stamp(n, seed, size))
    return table


def demo_data(out: Path, cfg, n: int | None = None, seed: int | None = None) -> str:
    """`kiln demo-data` (the DVC stage `demo_corpus`): the corpus `data.demo` describes, or `n` / `seed` given."""
    d = cfg.data.demo
    truth = write_demo_corpus(Path(out), n=d.n if n is None else n, seed=d.seed if seed is None else seed, size=d.size)
    return f"wrote {truth.num_rows} files under {Path(out) / 'images'}; truth in {Path(out) / 'truth.parquet'}"


def demo_stamp(n: int, seed: int, size: int) -> str:
    """What a written corpus was made with (out/demo.json): `source: demo` rewrites the corpus when it differs."""
    return json.dumps({"n": n, "seed": seed, "size": size}, sort_keys=True) + "\n"
