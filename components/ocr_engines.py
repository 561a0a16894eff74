"""OCR engines, both offline, behind one interface (`OCREngine.read(image) -> [TextBox]`, a line each,
words spaced, boxes in the image's pixels): RapidOCR (PP-OCR: ONNX models inside the wheel; the better
reader of small, coloured signs) and the `tesseract` binary (Debian tesseract-ocr). The OCR stage
(assets.ocr) and the text reward (training.evaluation.rewards) read with them, top line first."""

from __future__ import annotations

import html
import io
import math
import re
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise
from typing import Protocol

import numpy as np
from PIL import Image

from kiln.config import OCRConfig

# Blank runs between glyphs, in text heights, that are word spaces: letters mostly leave under 0.3, spaces over 0.36
# (DejaVu, Aileron; 14-40 px). Digits share one advance, so a narrow '1' leaves up to 0.43 beside another digit
# (Aileron '11') but '1 1' leaves 0.64.
WORD_GAP, DIGIT_GAP = 0.34, 0.5


@dataclass(frozen=True)
class TextBox:
    x0: float
    y0: float
    x1: float
    y1: float
    text: str
    confidence: float

    @property
    def width(self) -> float:
        return self.x1 - self.x0

    @property
    def height(self) -> float:
        return self.y1 - self.y0


class OCREngine(Protocol):
    name: str

    def read(self, image: Image.Image) -> list[TextBox]:
        """Text lines in the image, words spaced, boxes in its pixels."""
        ...


class RapidOCREngine:
    """RapidOCR (PP-OCR): a detector boxes lines, a CTC recogniser reads each one.

    The recogniser's alphabet has a space but it seldom emits it ("OPENDAILY 9TO 5"). Where CTC emits a
    character wanders within the glyph, so character pitch cannot tell a wide letter from a word gap
    (rendered signs: 5% of letter pitches over 1.3x the line's median, 5% of word pitches under 1.05x);
    the blank pixel columns between glyphs can (`spaced_text`). On 1,227 rendered lines (7 fonts,
    14-40 px) the text comes back exact for 89%, was 51%; most misses are misread letters.
    """

    name = "rapidocr"

    def __init__(self) -> None:
        self.engine = _rapidocr()

    def read(self, image: Image.Image) -> list[TextBox]:
        rgb = np.asarray(image.convert("RGB"))
        # upright text only (2x faster); word boxes: where each character sits along its line
        result, _ = self.engine(rgb, use_cls=False, return_word_box=True)
        return merge_lines([_spaced_box(rgb, *line) for line in result or []])


@lru_cache(maxsize=1)
def _rapidocr():
    from rapidocr_onnxruntime import RapidOCR

    return RapidOCR()  # models load once per process


def _spaced_box(rgb: np.ndarray, quad, text, confidence, char_boxes, chars, char_confidences) -> TextBox:
    """One recognised line with its word spaces; confident as its characters (the recogniser's spaces score ~0.5)."""
    xs, ys = [p[0] for p in quad], [p[1] for p in quad]
    x0, y0, x1, y1 = float(min(xs)), float(min(ys)), float(max(xs)), float(max(ys))
    if len(char_boxes) != len(chars) or not chars:  # no character positions: the text as read
        return TextBox(x0, y0, x1, y1, str(text).strip(), float(confidence))
    centres = [float(np.mean([p[0] for p in b])) for b in char_boxes]
    letters = [c for ch, c in zip(chars, char_confidences) if ch != " "]
    return TextBox(
        x0,
        y0,
        x1,
        y1,
        spaced_text(chars, centres, gaps_in(rgb, x0, y0, x1, y1)),
        float(np.mean(letters)) if letters else float(confidence),
    )


def ink(crop: np.ndarray) -> np.ndarray:
    """Pixels nearer the text's colour than the background's (the crop's border median): either polarity, any hue."""
    a = crop.astype(np.float32)
    ring = np.concatenate([a[0], a[-1], a[:, 0], a[:, -1]])
    far = np.linalg.norm(a - np.median(ring, 0), axis=-1)
    strongest = float(np.percentile(far, 99))
    return far > strongest / 2 if strongest > 32 else np.zeros(far.shape, bool)  # a flat crop has no ink


def gaps_in(rgb: np.ndarray, x0: float, y0: float, x1: float, y1: float) -> list[tuple[int, int, float]]:
    """`blank_runs` of a text box in image columns; padded so that its border is background even when the box is tight."""
    pad = max(2, round(0.15 * (y1 - y0)))
    left, top = max(0, math.floor(x0) - pad), max(0, math.floor(y0) - pad)
    crop = rgb[top : math.ceil(y1) + pad, left : math.ceil(x1) + pad]
    return [(left + a, left + b, w) for a, b, w in blank_runs(crop)]


def blank_runs(crop: np.ndarray) -> list[tuple[int, int, float]]:
    """Runs of ink-free columns between glyphs: [start, end) columns of the crop and width in text heights."""
    mask = ink(crop)
    columns, rows = np.flatnonzero(mask.any(0)), np.flatnonzero(mask.any(1))
    if len(columns) < 2:
        return []
    height = rows[-1] - rows[0] + 1
    return [(int(a) + 1, int(b), (b - a - 1) / height) for a, b in pairwise(columns) if b - a > 1]


def spaced_text(chars: list[str], xs: list[float], gaps: list[tuple[int, int, float]]) -> str:
    """Characters (each at an x within its glyph) joined with a space where the recogniser emitted one or a
    wide blank run lies between two of them."""
    out, prev, pending = "", 0.0, False
    for ch, x in zip(chars, xs):
        if ch == " ":
            pending = True
            continue
        if out and (pending or _word_gap(out[-1], ch, [w for a, b, w in gaps if prev < (a + b) / 2 < x])):
            out += " "
        out, prev, pending = out + ch, x, False
    return out


def _word_gap(before: str, after: str, widths: list[float]) -> bool:
    return max(widths, default=0.0) > (DIGIT_GAP if before.isdigit() and after.isdigit() else WORD_GAP)


class TesseractEngine:
    """The `tesseract` CLI's words with their characters (hOCR), on an upscaled copy: it misses small glyphs.

    Tesseract spaces words itself but runs a short line's words together ("9TO5"), so its words get the
    same pixel spacing rule as RapidOCR's lines, and `merge_lines` joins them: psm 11 (sparse text)
    reports a line's far-apart words as separate blocks.
    """

    name = "tesseract"

    def __init__(self, upscale: int = 3):
        self.upscale = upscale

    def read(self, image: Image.Image) -> list[TextBox]:
        s = self.upscale
        big = image.convert("RGB").resize((image.width * s, image.height * s), Image.LANCZOS)
        buf = io.BytesIO()
        big.save(buf, format="PNG")
        cmd = ["tesseract", "stdin", "stdout", "--psm", "11", "-c", "hocr_char_boxes=1", "hocr"]
        hocr = subprocess.run(cmd, input=buf.getvalue(), capture_output=True, check=True).stdout.decode()
        rgb = np.asarray(big)
        words = []
        for (x0, y0, x1, y1), confidence, chars in hocr_words(hocr):
            text = spaced_text([c for c, _ in chars], [x for _, x in chars], gaps_in(rgb, x0, y0, x1, y1))
            words.append(TextBox(x0 / s, y0 / s, x1 / s, y1 / s, text, confidence))
        return merge_lines(words)


_HOCR_WORD = re.compile(
    r"class='ocrx_word'[^>]*title='bbox (\d+) (\d+) (\d+) (\d+); x_wconf (\d+)'>((?:\s*<span class='ocrx_cinfo'[^>]*>[^<]*</span>)+)"
)


_HOCR_CHAR = re.compile(r"title='x_bboxes (\d+) \d+ (\d+) \d+;[^']*'>([^<]*)</span>")


def hocr_words(hocr: str) -> list[tuple[tuple[int, int, int, int], float, list[tuple[str, float]]]]:
    """(box, confidence, [(character, x)]) of each non-blank word of tesseract's hOCR with hocr_char_boxes=1.

    x is the centre of the character's box cut to the word's height: no glyph is much wider than high,
    but a box can run on to the end of the line (the 'G' of "NO PARKING ANY TIME" spans "ANY TIME").
    """
    words = []
    for m in _HOCR_WORD.finditer(hocr):
        x0, y0, x1, y1 = (int(v) for v in m.groups()[:4])
        chars = [
            (html.unescape(c), int(a) + min(int(b) - int(a), y1 - y0) / 2) for a, b, c in _HOCR_CHAR.findall(m.group(6))
        ]
        chars = [(c, x) for c, x in chars if c.strip()]
        if chars:
            words.append(((x0, y0, x1, y1), int(m.group(5)) / 100, chars))
    return words


def merge_lines(boxes: list[TextBox]) -> list[TextBox]:
    """Words or line pieces joined into lines in reading order, with a space between pieces.

    Both engines split lines: Tesseract reports words, RapidOCR's detector breaks a line at wide gaps,
    and captions quote lines. Pieces share a line when they overlap vertically by half the shorter one;
    a line's confidence is the mean of its pieces'.
    """
    lines: list[list[TextBox]] = []
    for b in sorted(boxes, key=lambda b: (b.y0 + b.y1) / 2):
        if lines and _same_line(lines[-1], b):
            lines[-1].append(b)
        else:
            lines.append([b])
    return [_joined(_without_rereads(line)) for line in lines]


def _same_line(line: list[TextBox], b: TextBox) -> bool:
    top, bottom = min(p.y0 for p in line), max(p.y1 for p in line)
    return min(bottom, b.y1) - max(top, b.y0) >= 0.5 * min(bottom - top, b.height)


def _without_rereads(line: list[TextBox]) -> list[TextBox]:
    """Left to right, minus pieces half inside a wider one that reads them too: RapidOCR's detector
    sometimes boxes a line's last glyph twice ("... 9 TO 5" and "5"), and Tesseract's boxes can overrun."""
    kept: list[TextBox] = []
    for b in sorted(line, key=lambda b: b.width, reverse=True):
        if not any(b.text in k.text and min(b.x1, k.x1) - max(b.x0, k.x0) >= 0.5 * b.width for k in kept):
            kept.append(b)
    return sorted(kept, key=lambda b: b.x0)


def _joined(line: list[TextBox]) -> TextBox:
    return TextBox(
        min(b.x0 for b in line),
        min(b.y0 for b in line),
        max(b.x1 for b in line),
        max(b.y1 for b in line),
        " ".join(b.text for b in line),
        float(np.mean([b.confidence for b in line])),
    )


def make_engine(cfg: OCRConfig) -> OCREngine:
    if cfg.engine == "rapidocr":
        return RapidOCREngine()
    return TesseractEngine(cfg.tesseract_upscale)


# ------------------------------------------------------------------------------------------ measures
def reading_order(boxes: list[TextBox]) -> list[TextBox]:
    """Top to bottom, then left to right; rounded so that engines' sub-pixel jitter cannot reorder lines."""
    return sorted(boxes, key=lambda b: (round(b.y0 / 4), round(b.x0), b.text))
