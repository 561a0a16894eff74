"""The `caption_ocr` stage: captions that see the OCR text, each stored with how it was produced
(`caption_decoding`). It runs after the OCR stage, through the `Captioner` interface of assets.caption.

- A VLM captioner (components.vlm.VLMCaptioner) is prompted with the OCR text itself.
- `OCRGroundedCaptioner`: wraps a captioner that cannot read (the demo's scene-metadata lookup) and
  adds the OCR'd text where its caption does not already quote it; named for both halves.
"""

from __future__ import annotations

import pyarrow as pa

from assets.caption import Captioner, caption_rows, make_captioner
from components.vlm import VLMCaptioner
from kiln.config import KilnConfig
from kiln.schemas import OCR_CAPTIONED, OCRED
from kiln.stage import Stage, StageOutput


class OCRGroundedCaptioner:
    """A reading-blind captioner plus the OCR: quotes the OCR'd text where the caption does not."""

    def __init__(self, base: Captioner, engine: str):
        self.base = base
        self.name = f"{base.name}+ocr:{engine}"
        self.decoding = {"method": "lookup+ocr", "base": base.name, "ocr_engine": engine}

    def caption(self, rows: pa.Table) -> list[str | None]:
        out = []
        for cap, text in zip(self.base.caption(rows), rows.column("ocr_text").to_pylist()):
            words = " ".join(text.split())
            if cap is not None and words and words.lower() not in cap.lower():
                cap = f'{cap}, with the text "{words}" visible'
            out.append(cap)
        return out


def make_ocr_captioner(cfg: KilnConfig) -> Captioner:
    captioner = make_captioner(cfg.data.caption)
    return captioner if isinstance(captioner, VLMCaptioner) else OCRGroundedCaptioner(captioner, cfg.data.ocr.engine)


def caption_ocr_stage(table: pa.Table, cfg: KilnConfig) -> StageOutput:
    return caption_rows(table, make_ocr_captioner(cfg), stage="caption_ocr", record_decoding=True)


STAGE = Stage(
    "caption_ocr",
    caption_ocr_stage,
    input_schema=OCRED,
    output_schema=OCR_CAPTIONED,
    scope="shard",
    setup=make_ocr_captioner,
)
