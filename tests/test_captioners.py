"""Captioners that see the OCR text: a tiny random VLM through the real load + generate path, and the demo's
honest metadata captioner grounded by OCR. Random weights write nonsense; these tests check the plumbing:
the prompt carries the OCR text and the metadata, decoding settings are stored, greedy decoding repeats."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
import torch
from caption_fixtures import (
    deduped_rows,
    ocred_rows,
    scene_image,
    shape,
    sign,
)

from assets.caption import Captioner, make_captioner
from assets.captioners import OCRGroundedCaptioner, caption_ocr_stage
from components.vlm import VLMCaptioner, build_prompt, chat_text, load_vlm
from kiln.config import load_config
from kiln.reasons import Reason
from kiln.schemas import OCR_CAPTIONED, check_schema

torch.set_num_threads(1)
PROMPT = "Describe this image in detail.{ocr} The image is {width}x{height} pixels."


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    d = tmp_path_factory.mktemp("img")
    paths = [
        scene_image(d, "sale", sign("SALE")),
        scene_image(d, "circle", shape("circle")),
        scene_image(d, "open", sign("OPEN", "yellow"), 96, 90),
    ]
    return ocred_rows(deduped_rows(paths), ["SALE", "", "OPEN"])


def test_the_prompt_carries_the_ocr_text_and_the_image_metadata():
    p = build_prompt(PROMPT, {"ocr_text": "HOTEL\nOPEN", "width": 640, "height": 480, "format": "JPEG"})
    assert p == 'Describe this image in detail. It shows the text: "HOTEL OPEN". The image is 640x480 pixels.'
    assert (
        build_prompt(PROMPT, {"ocr_text": "", "width": 8, "height": 9})
        == "Describe this image in detail. The image is 8x9 pixels."
    )


def test_vlm_captioner_loads_by_path_and_generates_batched_with_its_settings_recorded(vlm, rows, tmp_path):
    cfg = load_config(
        [
            "data.caption.captioner=vlm",
            f"data.caption.vlm_path={vlm}",
            "data.caption.batch_size=2",
            "data.caption.max_new_tokens=6",
        ]
    )
    captioner = make_captioner(cfg.data.caption)
    assert isinstance(captioner, VLMCaptioner) and isinstance(captioner, Captioner) and captioner.name == "vlm:llava"
    _, processor = load_vlm(str(vlm))
    text = chat_text(processor, build_prompt(PROMPT, rows.to_pylist()[0]))
    assert '"SALE"' in text and "112x104" in text and processor.image_token in text

    out = caption_ocr_stage(rows, cfg)
    kept = check_schema(out.kept, OCR_CAPTIONED, "caption_ocr")
    assert kept.num_rows + out.rejected.num_rows == rows.num_rows
    assert set(out.rejected.column("reason").to_pylist()) <= {Reason.NO_CAPTION}
    assert kept.num_rows >= 1 and all(c.strip() for c in kept.column("caption").to_pylist())
    decoding = json.loads(kept.column("caption_decoding")[0].as_py())
    assert decoding == {
        "model": str(vlm),
        "prompt": cfg.data.caption.prompt,
        "batch_size": 2,
        "max_new_tokens": 6,
        "min_new_tokens": 1,
        "num_beams": 1,
        "do_sample": False,
        "seed": 0,
    }
    again = caption_ocr_stage(rows, cfg)  # greedy: the same rows give the same captions
    assert again.kept.column("caption").to_pylist() == kept.column("caption").to_pylist()


def test_the_vlm_needs_a_local_path():
    with pytest.raises(ValueError, match="vlm_path"):
        make_captioner(load_config(["data.caption.captioner=vlm"]).data.caption)


class TruthStub:
    """A reading-blind captioner over known captions (what the demo's truth lookup is)."""

    name = "known"

    def __init__(self, captions):
        self.captions = captions

    def caption(self, rows: pa.Table):
        return self.captions[: rows.num_rows]


def test_ocr_grounding_quotes_text_the_caption_does_not_already_carry(rows):
    base = TruthStub(
        [
            'a red sign with the word "SALE", on a blue background',
            "a yellow circle, on a blue background",
            "a yellow sign",
        ]
    )
    grounded = OCRGroundedCaptioner(base, "rapidocr")
    caps = grounded.caption(rows)
    assert caps[0] == base.captions[0]  # already quotes SALE: unchanged
    assert caps[1] == base.captions[1]  # no text found: unchanged
    assert caps[2] == 'a yellow sign, with the text "OPEN" visible'
    assert grounded.name == "known+ocr:rapidocr" and grounded.decoding["method"] == "lookup+ocr"
