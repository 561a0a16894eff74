"""OCR: real engines read the demo's signs, the measurements mean what they say, and the text filter
rejects text that a low-resolution stage could not draw legibly. Nothing is lost on the way."""

from __future__ import annotations

import json

import pytest
from caption_fixtures import deduped_rows, ocred_rows, scene_image, shape, sign

from assets.ocr import (
    RapidOCREngine,
    TesseractEngine,
    TextBox,
    measure,
    ocr_rows,
    reading_order,
    text_filter_rows,
    union_area,
)
from kiln.config import OCRConfig, load_config
from kiln.reasons import Reason
from kiln.schemas import OCRED, check_schema
from kiln.stage import read_dataset, run_stage, write_table


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    d = tmp_path_factory.mktemp("ocr")
    return {"PIZZA": scene_image(d, "pizza", sign("PIZZA")), "circle": scene_image(d, "circle", shape("circle"))}


def test_measurements_count_overlaps_once_and_grow_with_the_amount_of_text():
    a, b = TextBox(0, 0, 10, 10, "AB", 0.99), TextBox(5, 0, 15, 10, "CD", 0.99)
    assert union_area([a, b], 20, 20) == 150  # 100 + 100 - 50 overlap
    one, two = measure([a], 20, 20, "x"), measure([TextBox(0, 12, 10, 16, "EFG HI", 0.9), a], 20, 20, "x")
    assert one["contains_text"] and one["text_area_share"] == pytest.approx(0.25)
    assert one["text_density"] == pytest.approx(2 / 400 * 1e4)
    assert two["text_complexity"] > one["text_complexity"] > 0
    assert two["ocr_text"] == "AB\nEFG HI"  # reading order: top line first
    assert two["min_text_height"] == 4
    assert json.loads(two["ocr_boxes"])[0][4] == "AB"
    none = measure([], 20, 20, "x")
    assert (none["contains_text"], none["ocr_text"], none["text_complexity"], none["text_area_share"]) == (False, "", 0.0, 0.0)
    assert [b.text for b in reading_order([TextBox(30, 1, 40, 9, "right", 1), TextBox(0, 2, 10, 9, "left", 1)])] == ["left", "right"]


def test_rapidocr_reads_the_sign_and_finds_no_text_in_a_circle(images):
    rows = deduped_rows([images["PIZZA"], images["circle"]])
    out = ocr_rows(rows, RapidOCREngine(), min_confidence=0.9, min_line_chars=2)
    kept = check_schema(out.kept, OCRED, "ocr").to_pylist()
    assert out.rejected.num_rows == 0
    assert kept[0]["ocr_text"] == "PIZZA" and kept[0]["contains_text"] and kept[0]["ocr_engine"] == "rapidocr"
    assert 0 < kept[0]["text_area_share"] < 0.5 and kept[0]["min_text_height"] > 8
    assert not kept[1]["contains_text"] and kept[1]["ocr_text"] == ""


def test_tesseract_reads_the_sign(images):
    boxes = TesseractEngine(upscale=3).read(__import__("PIL.Image", fromlist=["Image"]).open(images["PIZZA"]).convert("RGB"))
    assert "PIZZA" in " ".join(b.text for b in boxes)
    assert all(0 <= b.x0 < b.x1 <= 112 and 0 <= b.y0 < b.y1 <= 104 for b in boxes)  # boxes back in source pixels


def test_an_unreadable_file_is_rejected_with_a_reason(tmp_path, images):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    out = ocr_rows(deduped_rows([broken]), RapidOCREngine(), 0.9)
    assert out.kept.num_rows == 0 and out.rejected.column("reason").to_pylist() == [Reason.OCR_ERROR]


def test_text_filter_rejects_text_too_small_for_the_stage_resolution(tmp_path, images):
    rows = ocred_rows(deduped_rows([images["PIZZA"], images["circle"]]), ["PIZZA", ""], [20.0, 0.0])
    low = text_filter_rows(rows, OCRConfig(filter_resolution=32, min_text_height=6))
    # a 20 px line in a 112x104 image is 20 * 32 / sqrt(112 * 104) = 5.9 px at 32^2
    assert low.rejected.column("reason").to_pylist() == [Reason.TEXT_ILLEGIBLE]
    assert low.rejected.column("value")[0].as_py() == pytest.approx(20 * 32 / (112 * 104) ** 0.5)
    assert low.kept.column("ocr_text").to_pylist() == [""]  # images without text always pass
    assert text_filter_rows(rows, OCRConfig(filter_resolution=64, min_text_height=6)).kept.num_rows == 2

    write_table(rows, tmp_path / "ocred" / "kept" / "part-00000.parquet")
    cfg = load_config(["data.ocr.filter_resolution=32", "cluster.workers=1"])
    summary = run_stage("text_filter", tmp_path / "ocred", tmp_path / "filtered", cfg)
    assert (summary.input_rows, summary.kept, summary.by_reason) == (2, 1, {Reason.TEXT_ILLEGIBLE: 1})
    assert read_dataset(tmp_path / "filtered" / "rejected").column("stage").to_pylist() == ["text_filter"]
