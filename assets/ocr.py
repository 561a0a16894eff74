"""OCR: what text an image shows, where, and how much of it; then a legibility filter per resolution.

The OCR stage keeps every row it can read (text or not) and adds the OCRRow columns; the captioner
later puts `ocr_text` into its prompt. Two engines, both offline: RapidOCR (ONNX models inside the
wheel; the better reader of small, coloured signs) and the `tesseract` binary (Debian tesseract-ocr).

The text filter (`text_filter` stage, assets.ocr_filter) runs per low-resolution training stage: text
whose shortest line would be under `min_text_height` px once the image is resized to the stage's
pixel area cannot be drawn legibly there, so the image would teach garbled glyphs: it is rejected,
with that height as the measured value. The OCR is not redone for each resolution.
"""

from __future__ import annotations

import io
import json
import math
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import numpy as np
import pyarrow as pa
from PIL import Image

from assets.imageio import open_rgb
from kiln.config import KilnConfig, OCRConfig
from kiln.reasons import Reason
from kiln.schemas import DEDUPED, OCRED, OCRRow, arrow_schema
from kiln.stage import Rejects, Stage, StageOutput
from kiln.uri import read_bytes

OCR_COLUMNS = arrow_schema(OCRRow)


@dataclass(frozen=True)
class TextBox:
    x0: float
    y0: float
    x1: float
    y1: float
    text: str
    confidence: float

    @property
    def height(self) -> float:
        return self.y1 - self.y0


class OCREngine(Protocol):
    name: str

    def read(self, image: Image.Image) -> list[TextBox]:
        """Text lines in the image, boxes in its pixels."""
        ...


class RapidOCREngine:
    name = "rapidocr"

    def __init__(self) -> None:
        self.engine = _rapidocr()

    def read(self, image: Image.Image) -> list[TextBox]:
        result, _ = self.engine(np.asarray(image.convert("RGB")), use_cls=False)  # upright text only: 2x faster
        boxes = []
        for quad, text, conf in result or []:
            xs, ys = [p[0] for p in quad], [p[1] for p in quad]
            boxes.append(TextBox(float(min(xs)), float(min(ys)), float(max(xs)), float(max(ys)), str(text), float(conf)))
        return boxes


@lru_cache(maxsize=1)
def _rapidocr():
    from rapidocr_onnxruntime import RapidOCR

    return RapidOCR()  # models load once per process


class TesseractEngine:
    """The `tesseract` CLI, one line per box (TSV level 4), on an upscaled copy: it misses small glyphs."""

    name = "tesseract"

    def __init__(self, upscale: int = 3):
        self.upscale = upscale

    def read(self, image: Image.Image) -> list[TextBox]:
        s = self.upscale
        big = image.convert("RGB").resize((image.width * s, image.height * s), Image.LANCZOS)
        buf = io.BytesIO()
        big.save(buf, format="PNG")
        out = subprocess.run(["tesseract", "stdin", "stdout", "--psm", "11", "tsv"], input=buf.getvalue(), capture_output=True, check=True)
        lines: dict[tuple, list] = {}
        for row in out.stdout.decode().splitlines()[1:]:
            f = row.split("\t")
            if len(f) < 12 or f[0] != "5" or not f[11].strip() or float(f[10]) < 0:
                continue
            left, top, w, h, conf = int(f[6]), int(f[7]), int(f[8]), int(f[9]), float(f[10]) / 100
            lines.setdefault((f[2], f[3], f[4]), []).append((left, top, left + w, top + h, f[11].strip(), conf))
        boxes = []
        for words in lines.values():
            boxes.append(TextBox(
                min(w[0] for w in words) / s, min(w[1] for w in words) / s, max(w[2] for w in words) / s, max(w[3] for w in words) / s,
                " ".join(w[4] for w in words), float(np.mean([w[5] for w in words])),
            ))
        return boxes


def make_engine(cfg: OCRConfig) -> OCREngine:
    if cfg.engine == "rapidocr":
        return RapidOCREngine()
    return TesseractEngine(cfg.tesseract_upscale)


# ------------------------------------------------------------------------------------------ measures
def reading_order(boxes: list[TextBox]) -> list[TextBox]:
    """Top to bottom, then left to right; rounded so that engines' sub-pixel jitter cannot reorder lines."""
    return sorted(boxes, key=lambda b: (round(b.y0 / 4), round(b.x0), b.text))


def union_area(boxes: list[TextBox], width: int, height: int) -> float:
    """Pixels covered by at least one box (overlaps counted once), on the image's own grid."""
    mask = np.zeros((height, width), dtype=bool)
    for b in boxes:
        x0, y0 = max(0, math.floor(b.x0)), max(0, math.floor(b.y0))
        x1, y1 = min(width, math.ceil(b.x1)), min(height, math.ceil(b.y1))
        mask[y0:y1, x0:x1] = True
    return float(mask.sum())


def text_complexity(boxes: list[TextBox]) -> float:
    """Grows with the amount of text and with the number of lines: a word is easy, a page is hard."""
    chars = sum(len(b.text.replace(" ", "")) for b in boxes)
    return 0.0 if not boxes else math.log2(1 + chars) + (len(boxes) - 1)


def measure(boxes: list[TextBox], width: int, height: int, engine: str) -> dict:
    """The OCRRow of one image from its (confident) boxes."""
    boxes = reading_order(boxes)
    chars = sum(len(b.text.replace(" ", "")) for b in boxes)
    area = width * height
    return {
        "ocr_text": "\n".join(b.text for b in boxes),
        "ocr_boxes": json.dumps([[round(b.x0, 1), round(b.y0, 1), round(b.x1, 1), round(b.y1, 1), b.text, round(b.confidence, 3)] for b in boxes]),
        "ocr_engine": engine,
        "contains_text": bool(boxes),
        "text_area_share": union_area(boxes, width, height) / area if area else 0.0,
        "text_density": chars / area * 1e4 if area else 0.0,
        "text_complexity": text_complexity(boxes),
        "min_text_height": min((b.height for b in boxes), default=0.0),
    }


def is_text(box: TextBox, min_confidence: float, min_line_chars: int) -> bool:
    """A confident line with a few letters or digits: shapes read as 'O', 'A' or a CJK glyph are not text."""
    return box.confidence >= min_confidence and sum(ch.isalnum() for ch in box.text) >= min_line_chars


def ocr_rows(table: pa.Table, engine: OCREngine, min_confidence: float, min_line_chars: int = 2, stage: str = "ocr") -> StageOutput:
    """Pure core of the OCR stage: OCR columns for every readable row; unreadable ones rejected."""
    rejects = Rejects(stage)
    keep, measured = [], []
    for i, (id_, uri) in enumerate(zip(table.column("id").to_pylist(), table.column("uri").to_pylist())):
        try:
            image = open_rgb(read_bytes(uri))
            boxes = [b for b in engine.read(image) if is_text(b, min_confidence, min_line_chars)]
        except Exception as e:  # noqa: BLE001 - a bad file is a reject, not a crash
            rejects.add(id_, uri, Reason.OCR_ERROR, None, f"{type(e).__name__}: {e}"[:500])
            continue
        keep.append(i)
        measured.append(measure(boxes, image.width, image.height, engine.name))
    kept = table.take(pa.array(keep, pa.int64()))
    for f in OCR_COLUMNS:
        kept = kept.append_column(f, pa.array([m[f.name] for m in measured], f.type))
    return StageOutput(kept, rejects.table())


def ocr_stage(table: pa.Table, cfg: KilnConfig) -> StageOutput:
    return ocr_rows(table, make_engine(cfg.data.ocr), cfg.data.ocr.min_confidence, cfg.data.ocr.min_line_chars)


# ------------------------------------------------------------------------------------------ filter
def text_height_at(min_text_height: float, width: int, height: int, resolution: int) -> float:
    """A line's height once the image is resized to the stage's pixel area (resolution**2), as pack does."""
    return min_text_height * resolution / math.sqrt(width * height)


def text_filter_rows(table: pa.Table, cfg: OCRConfig, stage: str = "text_filter") -> StageOutput:
    """Reject text-bearing images whose shortest text line would be illegible at cfg.filter_resolution."""
    rejects = Rejects(stage)
    keep = []
    cols = [table.column(c).to_pylist() for c in ("id", "uri", "contains_text", "min_text_height", "width", "height")]
    for i, (id_, uri, has_text, h, w, hh) in enumerate(zip(*cols)):
        at = text_height_at(h, w, hh, cfg.filter_resolution) if has_text else math.inf
        if at < cfg.min_text_height:
            rejects.add(id_, uri, Reason.TEXT_ILLEGIBLE, at, f"text {h:.1f} px high is {at:.1f} px at {cfg.filter_resolution}^2 px (min {cfg.min_text_height})")
        else:
            keep.append(i)
    return StageOutput(table.take(pa.array(keep, pa.int64())), rejects.table())


def text_filter_stage(table: pa.Table, cfg: KilnConfig) -> StageOutput:
    return text_filter_rows(table, cfg.data.ocr)


STAGE = Stage("ocr", ocr_stage, input_schema=DEDUPED, output_schema=OCRED, scope="shard")
TEXT_FILTER_STAGE = Stage("text_filter", text_filter_stage, input_schema=OCRED, output_schema=OCRED, scope="shard")
