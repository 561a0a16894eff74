"""OCR: real engines read the demo's signs word by word and line by line, the measurements mean what they
say, and the text filter rejects text that a low-resolution stage could not draw legibly. Nothing is lost
on the way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from caption_fixtures import deduped_rows, ocred_rows, scene_image, shape, sign
from PIL import Image, ImageDraw, ImageFont

from assets.ocr import measure, ocr_rows, text_filter_rows, union_area
from components.ocr_engines import (
    RapidOCREngine,
    TesseractEngine,
    TextBox,
    hocr_words,
    merge_lines,
    reading_order,
    spaced_text,
)
from kiln.config import OCRConfig, load_config
from kiln.reasons import Reason
from kiln.schemas import OCRED, check_schema
from kiln.stage import read_dataset, run_stage, write_table


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    d = tmp_path_factory.mktemp("ocr")
    return {"PIZZA": scene_image(d, "pizza", sign("PIZZA")), "circle": scene_image(d, "circle", shape("circle"))}


def printed_sign(directory: Path, name: str, lines: list[tuple[int, int, str]], size=(512, 256), px: int = 40) -> Path:
    """Black DejaVu Sans text on white, each line centred on (x, y): glyphs about 30 px high, easy to read."""
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    for x, y, text in lines:
        draw.text((x, y), text, fill="black", font=ImageFont.truetype("DejaVuSans.ttf", px), anchor="mm")
    path = directory / f"{name}.png"
    image.save(path)
    return path


@pytest.fixture(scope="module")
def signs(tmp_path_factory):
    """Multi-word signs, keyed by what they say."""
    d = tmp_path_factory.mktemp("signs")
    return {
        "OPEN DAILY 9 TO 5": printed_sign(d, "one_line", [(256, 128, "OPEN DAILY 9 TO 5")]),
        "OPEN DAILY\n9 TO 5": printed_sign(d, "two_lines", [(256, 96, "OPEN DAILY"), (256, 160, "9 TO 5")]),
        "EXIT PARKING": printed_sign(d, "far_apart", [(90, 128, "EXIT"), (400, 128, "PARKING")]),  # one line, two boxes
        "OPEN DAILY": scene_image(
            d, "demo_sign", sign("OPEN DAILY")
        ),  # the demo corpus's renderer and size: ~10 px glyphs
    }


ENGINES = {"rapidocr": RapidOCREngine, "tesseract": TesseractEngine}


def ocr_text(engine: str, path: Path) -> str:
    """What the OCR stage would hand the captioner; tesseract's word confidences run low (0.68 for a clean '9')."""
    out = ocr_rows(deduped_rows([path]), ENGINES[engine](), min_confidence=0.5)
    return out.kept.column("ocr_text")[0].as_py()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_line_keeps_the_spaces_between_its_words(engine, signs):
    assert (
        ocr_text(engine, signs["OPEN DAILY 9 TO 5"]) == "OPEN DAILY 9 TO 5"
    )  # without the spacing rule rapidocr gives 'OPENDAILY 9TO 5'


@pytest.mark.parametrize("engine", ENGINES)
def test_a_two_line_sign_reads_top_line_first_one_line_each(engine, signs):
    assert (
        ocr_text(engine, signs["OPEN DAILY\n9 TO 5"]) == "OPEN DAILY\n9 TO 5"
    )  # without the spacing rule tesseract gives '9TO5'


@pytest.mark.parametrize("engine", ENGINES)
def test_words_far_apart_on_one_line_are_one_line_joined_by_a_space(engine, signs):
    assert ocr_text(engine, signs["EXIT PARKING"]) == "EXIT PARKING"  # read as two boxes: unmerged, 'EXIT\nPARKING'


@pytest.mark.parametrize("engine", ENGINES)
def test_the_small_demo_sign_keeps_its_word_space(engine, signs):
    assert ocr_text(engine, signs["OPEN DAILY"]) == "OPEN DAILY"  # without the spacing rule rapidocr gives 'OPENDAILY'


def test_a_wide_blank_between_two_characters_is_a_space_a_narrow_one_is_not():
    chars, centres = list("OPENDAILY"), [10, 30, 50, 70, 110, 130, 150, 170, 190]
    assert spaced_text(chars, centres, [(80, 100, 0.6), (135, 140, 0.1)]) == "OPEN DAILY"  # run widths in text heights
    assert (
        spaced_text(list("OPEN DAILY"), [10, 30, 50, 70, 90, 110, 130, 150, 170, 190], []) == "OPEN DAILY"
    )  # the recogniser's own space
    # digits share one advance, so a narrow '1' stands well clear of its neighbour: '11' is one number, '1 1' two
    assert spaced_text(list("11"), [10, 40], [(20, 30, 0.43)]) == "11"
    assert spaced_text(list("11"), [10, 50], [(20, 40, 0.64)]) == "1 1"


def test_pieces_of_a_line_join_left_to_right_and_lines_read_top_to_bottom():
    pieces = [
        TextBox(300, 52, 400, 80, "PARKING", 0.9),
        TextBox(10, 100, 90, 130, "9 TO 5", 0.8),
        TextBox(10, 50, 90, 78, "EXIT", 1.0),
    ]
    lines = merge_lines(pieces)
    assert [b.text for b in lines] == ["EXIT PARKING", "9 TO 5"]
    assert (lines[0].x0, lines[0].y0, lines[0].x1, lines[0].y1, lines[0].confidence) == (
        10,
        50,
        400,
        80,
        pytest.approx(0.95),
    )
    # the detector sometimes boxes a line's last glyph a second time: that reading is dropped
    assert [
        b.text
        for b in merge_lines([TextBox(60, 40, 430, 86, "OPEN DAILY 9 TO 5", 0.9), TextBox(417, 47, 443, 79, "5", 1.0)])
    ] == ["OPEN DAILY 9 TO 5"]
    # but a word under an overrunning box of another word is kept
    assert [
        b.text
        for b in merge_lines([TextBox(108, 112, 481, 142, "PARKING", 0.96), TextBox(291, 93, 359, 156, "ANY", 0.96)])
    ] == ["PARKING ANY"]


PARKING_HOCR = """<span class='ocrx_word' id='word_1_2' title='bbox 323 335 1443 427; x_wconf 96'>
 <span class='ocrx_cinfo' title='x_bboxes 323 339 381 427; x_conf 99.52932'>P</span>
 <span class='ocrx_cinfo' title='x_bboxes 379 338 459 426; x_conf 99.574905'>A</span>
 <span class='ocrx_cinfo' title='x_bboxes 469 338 539 427; x_conf 99.574585'>R</span>
 <span class='ocrx_cinfo' title='x_bboxes 523 335 587 427; x_conf 99.566162'>K</span>
 <span class='ocrx_cinfo' title='x_bboxes 553 338 647 426; x_conf 99.57428'>I</span>
 <span class='ocrx_cinfo' title='x_bboxes 667 338 736 427; x_conf 99.56501'>N</span>
 <span class='ocrx_cinfo' title='x_bboxes 753 335 1443 427; x_conf 99.543121'>G</span>
</span>"""  # tesseract 5.3 on "NO PARKING ANY TIME": the boxes of the word and of its G run on over "ANY TIME"


def test_a_tesseract_character_box_that_runs_on_over_the_next_words_does_not_split_its_word():
    [(box, confidence, chars)] = hocr_words(PARKING_HOCR)
    assert (box, confidence, "".join(c for c, _ in chars)) == ((323, 335, 1443, 427), 0.96, "PARKING")
    before_any = (830, 881, 0.57)  # the blank columns between PARKING and ANY, under the G's box
    assert spaced_text([c for c, _ in chars], [x for _, x in chars], [before_any]) == "PARKING"


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
    assert (none["contains_text"], none["ocr_text"], none["text_complexity"], none["text_area_share"]) == (
        False,
        "",
        0.0,
        0.0,
    )
    assert [b.text for b in reading_order([TextBox(30, 1, 40, 9, "right", 1), TextBox(0, 2, 10, 9, "left", 1)])] == [
        "left",
        "right",
    ]


def test_rapidocr_reads_the_sign_and_finds_no_text_in_a_circle(images):
    rows = deduped_rows([images["PIZZA"], images["circle"]])
    out = ocr_rows(rows, RapidOCREngine(), min_confidence=0.9, min_line_chars=2)
    kept = check_schema(out.kept, OCRED, "ocr").to_pylist()
    assert out.rejected.num_rows == 0
    assert kept[0]["ocr_text"] == "PIZZA" and kept[0]["contains_text"] and kept[0]["ocr_engine"] == "rapidocr"
    assert 0 < kept[0]["text_area_share"] < 0.5 and kept[0]["min_text_height"] > 8
    assert not kept[1]["contains_text"] and kept[1]["ocr_text"] == ""


def test_tesseract_reads_the_sign(images):
    boxes = TesseractEngine(upscale=3).read(
        __import__("PIL.Image", fromlist=["Image"]).open(images["PIZZA"]).convert("RGB")
    )
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
