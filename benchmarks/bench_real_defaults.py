"""Real-data defaults: filter statistics and near-dup detection measured on real photographs.

Builds a fixed set (seeded; no download) from the photographs that ship inside scikit-image, plus
near-duplicate copies of each (resized 0.5x / 0.25x, centre-cropped to 90% / 80% of each side, JPEG
quality 90 / 50, mirrored, brightness +10%), distinct images of similar layout (textures, disjoint
halves of one photo, signs / posters / screenshots drawn from one template with different text) and
negative controls the filter must reject (blank, one colour with a thin frame, noise, a flat wash,
heavy blur, letterbox). Every image goes through the product code: `assets.ingest.describe` for the
manifest row, `assets.filters.filter_row` (the filter stage's single decode) for the statistics and
hashes, `assets.dedup.near_pairs` / `find_groups` for near duplicates. Prints one JSON line.

    .venv/bin/python benchmarks/bench_real_defaults.py [--details]

Ground truth: every image has a family (its source photo). Two images of one family are a
near-duplicate pair, two of different families are not; the motorcycle stereo pair (one scene, a
few-percent viewpoint shift) is one family. Pairs between a disjoint half of a photo and that photo's
family are not scored (a half is a heavy crop, neither clearly a copy nor clearly distinct).
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
from PIL import Image, ImageDraw, ImageEnhance, ImageFilter, ImageFont, ImageOps

from assets.dedup import components, find_groups, near_pairs
from assets.filters import filter_row, header_failure
from assets.hashes import COLOR_BYTES, PHASH_BYTES, hamming_rows, to_words
from assets.ingest import describe, uri_id
from kiln.config import DedupConfig, FilterConfig

SEED = 0

# The candidate real-data defaults this benchmark reports on (docs/real-data-defaults.md).
FILTER_DEFAULTS = dict(
    min_side=128,
    max_aspect=3.0,
    min_laplacian_var=2.0,
    max_laplacian_var=28000.0,
    min_entropy=0.3,
    max_white_ratio=0.98,
    max_black_ratio=0.98,
    max_border_share=0.9,
)
DEDUP_DEFAULTS = dict(phash_radius=12, color_radius=6, bands=7, mirror=True)
# The demo-tuned thresholds these replace (pinned: the schema defaults will become the ones above).
DEMO_FILTER = dict(
    min_side=32,
    max_aspect=3.0,
    min_laplacian_var=8.0,
    max_laplacian_var=12000.0,
    min_entropy=2.5,
    max_white_ratio=0.95,
    max_black_ratio=0.95,
    max_border_share=0.4,
)
PIXEL_COPIES = ("resize50", "resize25", "jpeg90", "jpeg50", "bright10")  # what a pHash is built to see


# -------------------------------------------------------------------------------------------- the set
@dataclass
class Item:
    name: str
    family: str
    kind: str  # photo / text / graphic / control
    transform: str  # original, resize50, ..., stereo, tile
    data: bytes
    related: str = ""  # a family whose pairs with this item are not scored
    expect_reject: bool | None = False  # True: the filter should reject it; None: reported only
    row: dict = field(default_factory=dict)


def png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def jpeg(im: Image.Image, quality: int) -> bytes:
    buf = io.BytesIO()
    im.convert("RGB" if im.mode not in ("L", "RGB") else im.mode).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def skimage_photos() -> dict[str, Image.Image]:
    """The photographs bundled with scikit-image (no pooch / network needed); grey ones stay grey."""
    import skimage.data as sd

    names = [
        "astronaut",
        "camera",
        "cell",
        "chelsea",
        "clock",
        "coffee",
        "coins",
        "hubble_deep_field",
        "immunohistochemistry",
        "microaneurysms",
        "moon",
        "page",
        "retina",
        "rocket",
        "text",
        "brick",
        "grass",
        "gravel",
    ]
    out = {}
    for n in names:
        try:
            out[n] = Image.fromarray(getattr(sd, n)())
        except Exception:  # absent from this scikit-image or needs a download: skipped
            continue
    try:
        left, right, _ = sd.stereo_motorcycle()
        out["motorcycle_left"], out["motorcycle_right"] = Image.fromarray(left), Image.fromarray(right)
    except Exception:
        pass
    return out


def skimage_graphics() -> dict[str, Image.Image]:
    import skimage.data as sd

    out = {}
    for n in ["colorwheel", "logo", "horse", "checkerboard", "shepp_logan_phantom"]:
        try:
            a = getattr(sd, n)()
        except Exception:
            continue
        if a.dtype == bool:
            a = np.where(a, 255, 0).astype(np.uint8)
        elif a.dtype != np.uint8:
            a = np.clip(a * 255, 0, 255).astype(np.uint8)
        out[n] = Image.fromarray(a)
    return out


def font_path() -> str | None:
    """A TrueType font on this machine (fc-list), DejaVu Sans preferred; None = PIL's built-in font."""
    try:
        listed = subprocess.run(["fc-list", ":", "file"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        listed = ""
    files = sorted(
        line.split(":")[0].strip()
        for line in listed.splitlines()
        if line.strip().endswith((".ttf", ".ttf:")) or ".ttf" in line
    )
    for pref in ("DejaVuSans-Bold.ttf", "DejaVuSans.ttf", "LiberationSans-Regular.ttf"):
        for f in files:
            if f.endswith(pref):
                return f
    return files[0] if files else None


def get_font(path: str | None, size: int) -> ImageFont.ImageFont:
    if path:
        try:
            return ImageFont.truetype(path, size)
        except OSError:
            pass
    return ImageFont.load_default(size)


SIGN_TEXTS = ["OPEN", "CLOSED", "EXIT", "NO PARKING", "SALE 50%", "WELCOME"]
WORDS = (
    "the quick brown fox jumps over lazy dog market river station museum garden coffee ticket "
    "morning evening city summer winter music film night light open free entry daily news"
).split()


def sentence(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, n)).capitalize()


def sign(text: str, scheme: str, font: str | None) -> Image.Image:
    """One 512x256 layout: flat background, a frame line, centred text; only the text changes."""
    bg, fg = {"blue": ((24, 78, 160), (255, 255, 255)), "paper": ((255, 255, 255), (20, 20, 20))}[scheme]
    im = Image.new("RGB", (512, 256), bg)
    d = ImageDraw.Draw(im)
    d.rectangle((12, 12, 499, 243), outline=fg, width=6)
    f = get_font(font, 72 if len(text) <= 8 else 56)
    d.text((256, 128), text, fill=fg, font=f, anchor="mm")
    return im


def quote_card(text: str, bg: tuple[int, int, int], font: str | None) -> Image.Image:
    """512x512 flat colour, a few centred lines of text, no frame: the commonest text-on-flat image."""
    im = Image.new("RGB", (512, 512), bg)
    d = ImageDraw.Draw(im)
    ink = (255, 255, 255) if sum(bg) < 384 else (25, 25, 25)
    d.multiline_text((256, 256), text, fill=ink, font=get_font(font, 34), anchor="mm", align="center", spacing=12)
    return im


def poster(rng: np.random.Generator, font: str | None) -> Image.Image:
    """512x768 poster: flat cream background, a two-line title, body text, a footer line."""
    im = Image.new("RGB", (512, 768), (245, 236, 214))
    d = ImageDraw.Draw(im)
    title = get_font(font, 52)
    body = get_font(font, 22)
    d.text((40, 60), sentence(rng, 2).upper(), fill=(160, 30, 30), font=title)
    d.text((40, 125), sentence(rng, 2).upper(), fill=(160, 30, 30), font=title)
    for k in range(12):
        d.text((40, 240 + 34 * k), sentence(rng, 5), fill=(40, 40, 40), font=body)
    d.text((40, 700), f"{rng.integers(1, 29)} June  {rng.integers(10, 23)}:00", fill=(160, 30, 30), font=body)
    return im


def screenshot(rng: np.random.Generator, font: str | None, dark: bool) -> Image.Image:
    """800x600 app window: title bar, sidebar, lines of text on a flat page (light or dark theme)."""
    page, bar, side, ink = (
        ((30, 30, 30), (55, 55, 60), (42, 42, 46), (220, 220, 220))
        if dark
        else ((255, 255, 255), (222, 222, 226), (243, 243, 245), (30, 30, 30))
    )
    im = Image.new("RGB", (800, 600), page)
    d = ImageDraw.Draw(im)
    d.rectangle((0, 0, 799, 34), fill=bar)
    d.rectangle((0, 35, 179, 599), fill=side)
    small, text = get_font(font, 15), get_font(font, 17)
    d.text((12, 9), sentence(rng, 3), fill=ink, font=small)
    for k in range(14):
        d.text((16, 55 + 36 * k), sentence(rng, 1), fill=ink, font=small)
    for k in range(20):
        d.text((200, 55 + 26 * k), sentence(rng, int(rng.integers(4, 9))), fill=ink, font=text)
    return im


def copies(im: Image.Image) -> dict[str, bytes]:
    """The near-duplicate copies of one image (a copy under 32 px on a side is not made)."""
    w, h = im.size
    out = {}
    for name, k in (("resize50", 2), ("resize25", 4)):
        if min(w, h) // k >= 32:
            out[name] = png(im.resize((w // k, h // k), Image.Resampling.LANCZOS))
    for name, share in (("crop90", 0.9), ("crop80", 0.8)):
        cw, ch = round(w * share), round(h * share)
        x, y = (w - cw) // 2, (h - ch) // 2
        out[name] = png(im.crop((x, y, x + cw, y + ch)))
    out["jpeg90"], out["jpeg50"] = jpeg(im, 90), jpeg(im, 50)
    out["flip"] = png(ImageOps.mirror(im))
    out["bright10"] = png(ImageEnhance.Brightness(im).enhance(1.1))
    return out


def product_shot(im: Image.Image, share: float) -> Image.Image:
    """A photo scaled to `share` of the side, centred on a flat white canvas (studio / catalogue style)."""
    canvas = Image.new("RGB", (512, 512), (255, 255, 255))
    side = round(512 * share)
    small = im.convert("RGB").resize((side, side), Image.Resampling.LANCZOS)
    canvas.paste(small, ((512 - side) // 2, (512 - side) // 2))
    return canvas


def document(rng: np.random.Generator, font: str | None, lines: int) -> Image.Image:
    """A text page: black 14-px text on white, 1-inch-like margins; `lines` of 34 fit a full page."""
    im = Image.new("RGB", (620, 877), (255, 255, 255))
    d = ImageDraw.Draw(im)
    f = get_font(font, 14)
    for k in range(lines):
        d.text((72, 80 + 21 * k), sentence(rng, int(rng.integers(9, 12))), fill=(0, 0, 0), font=f)
    return im


def controls(photos: dict[str, Image.Image], rng: np.random.Generator) -> dict[str, tuple[Image.Image, bool | None]]:
    """Broken / flat / blank images (True: the filter should reject them), edge cases that should pass
    (False) and cases only reported (None)."""
    astro = (
        photos["astronaut"] if "astronaut" in photos else next(iter(photos.values())).convert("RGB").resize((512, 512))
    )
    framed = Image.new("RGB", (512, 512), (200, 40, 40))
    ImageDraw.Draw(framed).rectangle((0, 0, 511, 511), outline=(20, 20, 20), width=4)
    yy, xx = np.mgrid[0:512, 0:512]
    wash = np.stack([xx / 2, yy / 2, np.full_like(xx, 128)], -1).astype(np.uint8)
    radial = np.clip(230 - 0.45 * np.hypot(xx - 256, yy - 256), 0, 255)
    radial = np.stack([radial * 0.6, radial * 0.8, radial], -1).astype(np.uint8)
    letter_heavy = Image.new("RGB", (512, 512), (0, 0, 0))
    letter_heavy.paste(astro.resize((512, 256)), (0, 128))  # 50% black bars
    letter_light = Image.new("RGB", (512, 512), (0, 0, 0))
    letter_light.paste(astro.resize((512, 448)), (0, 32))  # 12.5% black bars
    few_words = Image.new("RGB", (512, 512), (255, 255, 255))
    ImageDraw.Draw(few_words).text((180, 240), "hi", fill=(0, 0, 0), font=get_font(font_path(), 24))
    small_noise = Image.fromarray(rng.integers(0, 256, (96, 96, 3), dtype=np.uint8))
    cat = photos.get("chelsea", astro)
    return {
        "blank_white": (Image.new("RGB", (512, 512), (255, 255, 255)), True),
        "blank_black": (Image.new("RGB", (512, 512), (0, 0, 0)), True),
        "blank_grey": (Image.new("RGB", (512, 512), (128, 128, 128)), True),
        "one_colour_thin_frame": (framed, True),
        "flat_wash_linear": (Image.fromarray(wash), True),
        "flat_wash_radial": (Image.fromarray(radial), True),
        "noise_uniform_96px": (small_noise, True),
        "noise_uniform_512px": (Image.fromarray(rng.integers(0, 256, (512, 512, 3), dtype=np.uint8)), True),
        "letterbox_50pct": (letter_heavy, None),
        "two_letters_on_white": (few_words, True),
        "blur_r24_astronaut": (astro.filter(ImageFilter.GaussianBlur(24)), True),
        "blur_r16_astronaut": (astro.filter(ImageFilter.GaussianBlur(16)), None),
        "blur_r8_astronaut": (astro.filter(ImageFilter.GaussianBlur(8)), False),
        "blur_r3_astronaut": (astro.filter(ImageFilter.GaussianBlur(3)), False),
        "letterbox_12pct": (letter_light, False),
        "noise_sigma25_astronaut": (
            Image.fromarray(
                np.clip(np.asarray(astro, np.float32) + rng.normal(0, 25, (512, 512, 3)), 0, 255).astype(np.uint8)
            ),
            False,
        ),
        "product_on_white_80pct": (product_shot(cat, 0.8), None),
        "product_on_white_50pct": (product_shot(cat, 0.5), None),
        "document_half_page": (document(rng, font_path(), 17), None),
    }


def build_set() -> list[Item]:
    rng = np.random.default_rng(SEED)
    font = font_path()
    items: list[Item] = []
    photos = skimage_photos()
    for name, im in photos.items():
        if name == "motorcycle_right":
            items.append(Item(name, "motorcycle", "photo", "stereo", png(im)))
            continue
        family = "motorcycle" if name == "motorcycle_left" else name
        items.append(Item(name, family, "photo", "original", png(im)))
        items += [Item(f"{name}/{t}", family, "photo", t, d) for t, d in copies(im).items()]
    # distinct images of similar layout: disjoint halves of one photo (not scored against the photo)
    for name, vertical in (("hubble_deep_field", True), ("grass", False), ("retina", True)):
        if name in photos:
            w, h = photos[name].size
            halves = [(0, 0, w // 2, h), (w // 2, 0, w, h)] if vertical else [(0, 0, w, h // 2), (0, h // 2, w, h)]
            for k, box in enumerate(halves):
                items.append(
                    Item(
                        f"{name}_half{k}", f"{name}_half{k}", "photo", "tile", png(photos[name].crop(box)), related=name
                    )
                )
    # recoloured variants (hue +120 degrees): same pHash, a different picture by kiln's definition
    for name in ("astronaut", "chelsea", "coffee", "rocket", "immunohistochemistry", "motorcycle_left"):
        if name in photos:
            h, sat, v = photos[name].convert("HSV").split()
            recoloured = Image.merge("HSV", (h.point(lambda x: (x + 85) % 256), sat, v)).convert("RGB")
            items.append(Item(f"{name}_hue120", f"{name}_hue120", "photo", "recolour", png(recoloured)))
    # text on flat backgrounds: one template, different text = distinct images
    texts: dict[str, Image.Image] = {}
    for scheme in ("blue", "paper"):
        for t in SIGN_TEXTS:
            texts[f"sign_{scheme}_{t.replace(' ', '_').replace('%', 'pct')}"] = sign(t, scheme, font)
    for k in range(4):
        texts[f"poster_{k}"] = poster(rng, font)
    for k in range(4):
        texts[f"screenshot_light_{k}"] = screenshot(rng, font, dark=False)
    for k in range(2):
        texts[f"screenshot_dark_{k}"] = screenshot(rng, font, dark=True)
    for k in range(2):
        texts[f"document_{k}"] = document(rng, font, 34)
    for k, bg in enumerate([(250, 248, 240), (20, 60, 50), (235, 120, 60)]):
        texts[f"quote_card_{k}"] = quote_card("\n".join(sentence(rng, 3) for _ in range(3)), bg, font)
    for name, im in texts.items():
        items.append(Item(name, name, "text", "original", png(im)))
        items += [Item(f"{name}/{t}", name, "text", t, d) for t, d in copies(im).items()]
    for name, im in skimage_graphics().items():
        items.append(Item(name, name, "graphic", "original", png(im)))
        items += [Item(f"{name}/{t}", name, "graphic", t, d) for t, d in copies(im).items()]
    for name, (im, bad) in controls(photos, rng).items():
        items.append(Item(name, name, "control", "original", png(im), expect_reject=bad))
    return items


# --------------------------------------------------------------------------------------- measuring
OPEN = FilterConfig(
    min_side=1,
    max_aspect=1000.0,
    min_laplacian_var=-1.0,
    max_laplacian_var=float("inf"),
    min_entropy=-1.0,
    max_white_ratio=1.0,
    max_black_ratio=1.0,
    max_border_share=1.0,
)


def measure_all(items: list[Item], folder: Path) -> None:
    """Each item through the filter stage's own path: file -> manifest row -> one decode -> Measures."""
    for it in items:
        path = folder / (it.name.replace("/", "__") + (".jpg" if it.transform.startswith("jpeg") else ".png"))
        path.write_bytes(it.data)
        uri = path.as_posix()
        row = describe(uri_id(uri), uri, it.data)
        m, failed = filter_row(row, OPEN)
        if failed:
            raise RuntimeError(f"{it.name}: {failed}")
        it.row = {**row, **m.as_row()}


def measures_of(row: dict):
    from assets.decode import Measures

    return Measures(**{k: row[k] for k in Measures.__dataclass_fields__})


def filter_reason(it: Item, f: FilterConfig) -> str | None:
    """The filter stage's verdict under `f` (header checks, then the statistics in the stage's order)."""
    from assets.filters import stats_failure

    failed = header_failure(it.row, f) or stats_failure(measures_of(it.row), f)
    return failed[0].value if failed else None


def group_of(it: Item) -> str:
    if it.kind == "control":
        return "control"
    return f"{it.kind}_{'original' if it.transform in ('original', 'stereo', 'tile', 'recolour') else 'copy'}"


def filter_report(items: list[Item], f: FilterConfig) -> dict:
    """Rejections per group under `f`; names for everything but the expected ones."""
    out: dict = {}
    for g in sorted({group_of(it) for it in items}):
        members = [it for it in items if group_of(it) == g]
        verdicts = {it.name: filter_reason(it, f) for it in members}
        out[g] = {"n": len(members), "rejected": {n: r for n, r in verdicts.items() if r}}
    controls = [it for it in items if it.kind == "control"]
    out["controls_wrong"] = {
        it.name: filter_reason(it, f)
        for it in controls
        if it.expect_reject is not None and bool(filter_reason(it, f)) != it.expect_reject
    }
    out["controls_reported"] = {it.name: filter_reason(it, f) for it in controls if it.expect_reject is None}
    return out


def stat_ranges(items: list[Item]) -> dict:
    """min / max of each statistic per group (originals and copies together), with the extreme item."""
    stats = ["laplacian_var", "entropy", "white_ratio", "black_ratio", "border_share", "aspect"]
    out = {}
    for kind in ("photo", "text", "graphic"):
        members = [it for it in items if it.kind == kind]
        side = min(members, key=lambda it: min(it.row["width"], it.row["height"]))
        out[kind] = {"min_side": [min(side.row["width"], side.row["height"]), side.name]}
        for s in stats:
            lo, hi = min(members, key=lambda it: it.row[s]), max(members, key=lambda it: it.row[s])
            out[kind][s] = [[round(lo.row[s], 3), lo.name], [round(hi.row[s], 3), hi.name]]
    out["control"] = {it.name: {s: round(it.row[s], 3) for s in stats[:5]} for it in items if it.kind == "control"}
    return out


SWEEPS = {
    "min_entropy": [0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5],
    "min_laplacian_var": [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
    "max_laplacian_var": [12000.0, 16000.0, 20000.0, 24000.0, 28000.0, 32000.0],
    "max_white_ratio": [0.9, 0.95, 0.98, 0.99],
    "max_black_ratio": [0.9, 0.95, 0.98, 0.99],
    "max_border_share": [0.3, 0.4, 0.5, 0.6, 0.75, 0.9, 0.95],
    "min_side": [32, 64, 128, 192, 256],
    "max_aspect": [2.0, 2.5, 3.0, 4.0],
}


def filter_sweep(items: list[Item], base: FilterConfig) -> dict:
    """For each threshold alone (others at `base`): rejected count per group, and names outside controls."""
    out = {}
    for key, values in SWEEPS.items():
        rows = {}
        for v in values:
            f = base.model_copy(update={key: v})
            lost = [it for it in items if filter_reason(it, f)]
            counts: dict[str, int] = {}
            for it in lost:
                counts[group_of(it)] = counts.get(group_of(it), 0) + 1
            rows[str(v)] = {
                "rejected": counts,
                "controls_missed": sorted(it.name for it in items if it.expect_reject and not filter_reason(it, f)),
            }
        out[key] = rows
    return out


# ------------------------------------------------------------------------------------------- dedup
@dataclass
class Truth:
    i: np.ndarray
    j: np.ndarray
    pos: np.ndarray  # same family
    scored: np.ndarray  # not an ignored pair
    dp: np.ndarray  # pHash distance
    dpm: np.ndarray  # min(pHash distance, distance to the mirror)
    dc: np.ndarray  # colour-hash distance


def truth_of(items: list[Item]) -> Truth:
    from assets.hashes import mirror_phash

    n = len(items)
    phash = np.frombuffer(b"".join(it.row["phash"] for it in items), np.uint8).reshape(n, PHASH_BYTES)
    color = np.frombuffer(b"".join(it.row["colorhash"] for it in items), np.uint8).reshape(n, COLOR_BYTES)
    pw, mw, cw = to_words(phash, PHASH_BYTES), to_words(mirror_phash(phash), PHASH_BYTES), to_words(color, COLOR_BYTES)
    i, j = np.triu_indices(n, 1)
    fam = np.array([it.family for it in items])
    rel = np.array([it.related for it in items])
    dp = hamming_rows(pw[i], pw[j])
    return Truth(
        i,
        j,
        fam[i] == fam[j],
        ~((rel[i] == fam[j]) | (rel[j] == fam[i])),
        dp,
        np.minimum(dp, hamming_rows(mw[i], pw[j])),
        hamming_rows(cw[i], cw[j]),
    )


def scores(items: list[Item], t: Truth, found: np.ndarray) -> dict:
    """Edge-level (the pairs the search returns) and group-level (connected components: what the stage
    rejects) precision / recall over all scored pairs, and per transform: copy grouped with its original."""
    n = len(items)
    pos, scored = t.pos & t.scored, t.scored
    label = components(n, np.stack([t.i[found], t.j[found]], 1))
    grouped = label[t.i] == label[t.j]
    out = {}
    for name, hit in (("edge", found), ("group", grouped)):
        tp, fp = int((hit & pos).sum()), int((hit & scored & ~t.pos).sum())
        out[f"{name}_precision"] = round(tp / max(tp + fp, 1), 4)
        out[f"{name}_recall"] = round(tp / max(int(pos.sum()), 1), 4)
        out[f"{name}_false_pairs"] = fp
    first = {}
    for k, it in enumerate(items):
        if it.transform == "original":
            first.setdefault(it.family, k)
    per: dict[str, list[int]] = {}
    for k, it in enumerate(items):
        if it.family in first and k != first[it.family] and it.transform not in ("original", "tile", "recolour"):
            per.setdefault(f"{it.kind}:{it.transform}", []).append(int(label[k] == label[first[it.family]]))
    real = {
        tr: [] for tr in ("resize50", "resize25", "crop90", "crop80", "jpeg90", "jpeg50", "flip", "bright10", "stereo")
    }
    for key, v in per.items():
        kind, tr = key.split(":")
        if kind in ("photo", "text"):
            real[tr] += v
    out["copy_recall_photo_text"] = {tr: [round(float(np.mean(v)), 3), len(v)] for tr, v in real.items() if v}
    pix = [x for tr in PIXEL_COPIES for x in real[tr]]
    out["copy_recall_pixel_copies"] = round(float(np.mean(pix)), 4)  # resize / JPEG / brightness, photos and text
    out["copy_recall_pixel_copies_and_flips"] = round(float(np.mean(pix + real["flip"])), 4)
    out["copy_recall_graphics"] = round(
        float(
            np.mean(
                [
                    x
                    for key, v in per.items()
                    if key.startswith("graphic:") and not key.endswith(("crop90", "crop80"))
                    for x in v
                ]
            )
        ),
        3,
    )
    false = [
        (items[a].name, items[b].name) for a, b in zip(t.i[grouped & scored & ~t.pos], t.j[grouped & scored & ~t.pos])
    ]
    out["false_merges"] = false[:8]
    return out


def dedup_sweep(items: list[Item], t: Truth, radii: list[int], color_radii: list[int]) -> dict:
    out = {}
    for mirror in (False, True):
        d = t.dpm if mirror else t.dp
        for r in radii:
            for c in color_radii:
                s = scores(items, t, (d <= r) & (t.dc <= c))
                out[f"r{r}_c{c}{'_mirror' if mirror else ''}"] = {k: v for k, v in s.items() if k != "false_merges"}
    return out


def distance_table(items: list[Item], t: Truth) -> dict:
    """pHash / colour distance of each copy to its original (max, p90 per transform; photos and text)."""
    first = {}
    for k, it in enumerate(items):
        if it.transform == "original":
            first.setdefault(it.family, k)
    idx = {(a, b): k for k, (a, b) in enumerate(zip(t.i.tolist(), t.j.tolist()))}
    per: dict[str, list[tuple[int, int, int]]] = {}
    for k, it in enumerate(items):
        if it.family in first and k != first[it.family] and it.kind in ("photo", "text"):
            e = idx[(min(k, first[it.family]), max(k, first[it.family]))]
            per.setdefault(it.transform, []).append((int(t.dp[e]), int(t.dpm[e]), int(t.dc[e])))
    out = {
        tr: {
            "n": len(v),
            "phash_max": max(x[0] for x in v),
            "phash_p50": float(np.median([x[0] for x in v])),
            "mirror_aware_max": max(x[1] for x in v),
            "color_max": max(x[2] for x in v),
        }
        for tr, v in sorted(per.items())
    }
    neg = t.scored & ~t.pos
    k = int(np.argmin(np.where(neg, t.dp, 999)))
    km = int(np.argmin(np.where(neg, t.dpm, 999)))
    recol = (
        np.array([items[a].transform == "recolour" or items[b].transform == "recolour" for a, b in zip(t.i, t.j)]) & neg
    )
    kr = int(np.argmin(np.where(recol, t.dp, 999))) if recol.any() else k
    out["nearest_distinct"] = {
        "phash": int(t.dp[k]),
        "color": int(t.dc[k]),
        "pair": [items[t.i[k]].name, items[t.j[k]].name],
    }
    out["nearest_distinct_mirror_aware"] = {
        "phash": int(t.dpm[km]),
        "color": int(t.dc[km]),
        "pair": [items[t.i[km]].name, items[t.j[km]].name],
    }
    out["nearest_recolour"] = {
        "phash": int(t.dp[kr]),
        "color": int(t.dc[kr]),
        "pair": [items[t.i[kr]].name, items[t.j[kr]].name],
        "min_color_of_recolour_pairs_within_r": int(t.dc[recol & (t.dp <= 24)].min())
        if (recol & (t.dp <= 24)).any()
        else None,
    }
    signs = (
        np.array([items[a].name.startswith("sign_") and items[b].name.startswith("sign_") for a, b in zip(t.i, t.j)])
        & neg
    )
    out["distinct_signs_min_phash"] = int(t.dp[signs].min()) if signs.any() else None
    return out


def scale_cost(n: int, settings: list[tuple[int, int, bool]]) -> dict:
    """near_pairs wall time on n uniform hashes: what a radius / bands / mirror choice costs at scale."""
    rng = np.random.default_rng(SEED)
    phash = rng.integers(0, 256, (n, PHASH_BYTES), dtype=np.uint8)
    color = rng.integers(0, 256, (n, COLOR_BYTES), dtype=np.uint8)
    out = {}
    for r, b, m in settings:
        t0 = time.perf_counter()
        near_pairs(phash, color, r, 64, b, m)
        out[f"r{r}_b{b}{'_mirror' if m else ''}_s"] = round(time.perf_counter() - t0, 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scale", type=int, default=100_000, help="uniform hashes for the cost of each radius (0: skip)")
    p.add_argument("--details", action="store_true", help="also the full threshold and radius sweeps")
    a = p.parse_args()
    t0 = time.perf_counter()
    items = build_set()
    with tempfile.TemporaryDirectory() as tmp:
        measure_all(items, Path(tmp))
    t_measure = time.perf_counter() - t0
    f_new, f_old = FilterConfig(**FILTER_DEFAULTS), FilterConfig(**DEMO_FILTER)
    d_new = DedupConfig(**{k: v for k, v in DEDUP_DEFAULTS.items() if k in DedupConfig.model_fields})
    dd = [it for it in items if it.kind != "control"]
    t = truth_of(dd)
    # the product search at the chosen setting must equal brute force (it is exact)
    phash = np.frombuffer(b"".join(it.row["phash"] for it in dd), np.uint8).reshape(-1, PHASH_BYTES)
    color = np.frombuffer(b"".join(it.row["colorhash"] for it in dd), np.uint8).reshape(-1, COLOR_BYTES)
    chosen = {}
    for mirror in (False, True):
        pairs = near_pairs(phash, color, d_new.phash_radius, d_new.color_radius, d_new.bands, mirror)
        d = t.dpm if mirror else t.dp
        brute = np.flatnonzero((d <= d_new.phash_radius) & (t.dc <= d_new.color_radius))
        lsh = np.sort(np.searchsorted(t.i * len(dd) + t.j, pairs[:, 0] * len(dd) + pairs[:, 1]))
        found = np.zeros(len(t.i), bool)
        found[lsh] = True
        table = pa.table(
            {
                "id": [f"{k:06d}" for k in range(len(dd))],
                "md5": [it.row["md5"] for it in dd],
                "width": [it.row["width"] for it in dd],
                "height": [it.row["height"] for it in dd],
                "bytes": [it.row["bytes"] for it in dd],
                "phash": [it.row["phash"] for it in dd],
                "colorhash": [it.row["colorhash"] for it in dd],
            }
        )
        g = find_groups(table, d_new.phash_radius, d_new.color_radius, d_new.bands, mirror)
        chosen["mirror" if mirror else "plain"] = {
            "lsh_equals_brute_force": bool(np.array_equal(lsh, brute)),
            "stage_rejects": int((g.keeper != np.arange(len(dd))).sum()),
            **scores(dd, t, found),
        }
    out = {
        "images": len(items),
        "families": len({it.family for it in items}),
        "dedup_images": len(dd),
        "positive_pairs": int((t.pos & t.scored).sum()),
        "distinct_pairs": int((t.scored & ~t.pos).sum()),
        "font": font_path(),
        "measure_s": round(t_measure, 1),
        "filter_defaults": FILTER_DEFAULTS,
        "dedup_defaults": DEDUP_DEFAULTS,
        "filter_at_defaults": filter_report(items, f_new),
        "filter_at_demo_defaults": {
            g: len(v["rejected"]) if isinstance(v, dict) and "rejected" in v else v
            for g, v in filter_report(items, f_old).items()
        },
        "demo_defaults_text_rejected": {
            k: v
            for g, r in filter_report(items, f_old).items()
            if g.startswith("text")
            for k, v in r["rejected"].items()
        },
        "stat_ranges": stat_ranges(items),
        "copy_distances": distance_table(dd, t),
        "dedup_at_defaults": chosen,
        "dedup_radius_sweep": {
            k: v
            for k, v in dedup_sweep(dd, t, [4, 8, 12, 16, 20, 24, 28, 32, 36, 40], [2, 4, 6, 8]).items()
            if a.details or k.endswith(f"_c{d_new.color_radius}") or k.endswith(f"_c{d_new.color_radius}_mirror")
        },
    }
    if a.details:
        out["filter_sweep"] = filter_sweep(items, f_new)
    if a.scale:
        out["scale_cost"] = {
            "n": a.scale,
            **scale_cost(a.scale, [(12, 7, False), (12, 7, True), (16, 6, False), (20, 7, False)]),
        }
    out["total_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
