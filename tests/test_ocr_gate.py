"""The cheap text detector in front of the OCR: the full OCR reads only images the detector fires on; an
image it does not fire on is kept, recorded as text-free with the gate named, never lost."""

from __future__ import annotations

import pytest
from caption_fixtures import deduped_rows, scene_image, shape, sign

from assets.ocr import TextGate, ocr_rows
from components.ocr_engines import RapidOCREngine
from kiln.schemas import OCRED, check_schema


class CountingEngine(RapidOCREngine):
    """The real engine, counting the images it is asked to read."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def read(self, image):
        self.reads += 1
        return super().read(image)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    d = tmp_path_factory.mktemp("gate")
    return [
        scene_image(d, "pizza", sign("PIZZA")),
        scene_image(d, "circle", shape("circle")),
        scene_image(d, "square", shape("square")),
    ]


def test_only_images_the_detector_fires_on_are_read_and_the_rest_are_kept_as_text_free(images):
    engine, gate = CountingEngine(), TextGate(side=256)
    out = ocr_rows(deduped_rows(images), engine, min_confidence=0.9, min_line_chars=2, gate=gate)
    kept = check_schema(out.kept, OCRED, "ocr").to_pylist()
    assert out.rejected.num_rows == 0 and len(kept) == len(images)  # nothing lost
    assert kept[0]["ocr_text"] == "PIZZA" and kept[0]["ocr_engine"] == "rapidocr"
    assert [r["ocr_engine"] for r in kept[1:]] == [gate.name, gate.name] and not any(
        r["contains_text"] for r in kept[1:]
    )
    assert engine.reads == 1  # the shapes never reached the full OCR
