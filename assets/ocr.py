"""OCR: what text an image shows, where, and how much of it; then a legibility filter per resolution.

The OCR stage keeps every row it can read (text or not) and adds the OCRRow columns; the captioner
later puts `ocr_text` into its prompt: the image's lines top to bottom, each read left to right with
its words spaced (captions quote it verbatim). Two engines, both offline: RapidOCR (ONNX models inside the
wheel; the better reader of small, coloured signs) and the `tesseract` binary (Debian tesseract-ocr).

The text filter (`text_filter` stage, assets.ocr_filter) runs per low-resolution training stage: text
whose shortest line would be under `min_text_height` px once the image is resized to the stage's
pixel area cannot be drawn legibly there, so the image would teach garbled glyphs: it is rejected,
with that height as the measured value. The OCR is not redone for each resolution.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache

import numpy as np
import pyarrow as pa
from PIL import Image

from components.ocr_engines import OCREngine, TextBox, make_engine, reading_order
from kiln.config import KilnConfig, OCRConfig
from kiln.imageio import open_rgb
from kiln.reasons import Reason
from kiln.schemas import DEDUPED, OCRED, OCRRow, arrow_schema
from kiln.stage import Rejects, Stage, StageOutput
from kiln.uri import read_bytes

OCR_COLUMNS = arrow_schema(OCRRow)


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
        "ocr_boxes": json.dumps(
            [
                [round(b.x0, 1), round(b.y0, 1), round(b.x1, 1), round(b.y1, 1), b.text, round(b.confidence, 3)]
                for b in boxes
            ]
        ),
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


class TextGate:
    """A cheap text detector in front of the OCR: RapidOCR's detection network alone, on the image shrunk so its
    longer side is at most `side` px. About 20 ms an image against about 1.2 s for the full OCR on 2 CPU
    cores; on the demo corpus it fired on every image with text and on 1 of 25 without."""

    def __init__(self, side: int):
        self.side = side
        self.name = f"gate:rapidocr-det@{side}"

    def fires(self, image: Image.Image) -> bool:
        result, _ = _rapidocr_gate(self.side)(
            np.asarray(image.convert("RGB")), use_det=True, use_cls=False, use_rec=False
        )
        return bool(result)


@lru_cache(maxsize=2)
def _rapidocr_gate(side: int):
    from rapidocr_onnxruntime import RapidOCR

    return RapidOCR(det_limit_type="max", det_limit_side_len=side)


def ocr_rows(
    table: pa.Table,
    engine: OCREngine,
    min_confidence: float,
    min_line_chars: int = 2,
    stage: str = "ocr",
    gate: TextGate | None = None,
) -> StageOutput:
    """Pure core of the OCR stage: OCR columns for every readable row; unreadable ones rejected.

    With a gate, an image it does not fire on is recorded as text-free (`ocr_engine` names the gate) unread."""
    rejects = Rejects(stage)
    keep, measured = [], []
    for i, (id_, uri) in enumerate(zip(table.column("id").to_pylist(), table.column("uri").to_pylist())):
        try:
            image = open_rgb(read_bytes(uri))
            if gate is not None and not gate.fires(image):
                keep.append(i)
                measured.append(measure([], image.width, image.height, gate.name))
                continue
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
    c = cfg.data.ocr
    return ocr_rows(
        table, make_engine(c), c.min_confidence, c.min_line_chars, gate=TextGate(c.gate_side) if c.gate_side else None
    )


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
            rejects.add(
                id_,
                uri,
                Reason.TEXT_ILLEGIBLE,
                at,
                f"text {h:.1f} px high is {at:.1f} px at {cfg.filter_resolution}^2 px (min {cfg.min_text_height})",
            )
        else:
            keep.append(i)
    return StageOutput(table.take(pa.array(keep, pa.int64())), rejects.table())


def text_filter_stage(table: pa.Table, cfg: KilnConfig) -> StageOutput:
    return text_filter_rows(table, cfg.data.ocr)


STAGE = Stage("ocr", ocr_stage, input_schema=DEDUPED, output_schema=OCRED, scope="shard")
TEXT_FILTER_STAGE = Stage("text_filter", text_filter_stage, input_schema=OCRED, output_schema=OCRED, scope="shard")
