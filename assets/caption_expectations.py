"""great-expectations suites over the caption branch: OCR, OCR-grounded captions, rewrites, pairs, weights, mixes.

Same shape as assets.expectations (pure functions; Dagster asset checks and tests call
`assets.expectations.validate_dataset` alike, which finds these suites by name): every caption form's
length within its configured range (which also says it is there: the schema already forbids nulls), no
caption form leaks a file path, OCR measures in their ranges, mixes and weights well-formed.
"""

from __future__ import annotations

import pyarrow as pa

from assets.suite_runner import SuiteResult, run_suite
from kiln import schemas
from kiln.config import KilnConfig

PATH_LEAK = r"(/|\\|\.(png|jpe?g|webp|gif|tiff?|bmp|parquet|tar)\b)"
SUITE_SCHEMAS = {
    "ocred": schemas.OCRED,
    "ocr_captioned": schemas.OCR_CAPTIONED,
    "rewritten": schemas.REWRITTEN,
    "prompt_pairs": schemas.PROMPT_PAIRS,
    "concept_weights": schemas.CONCEPT_WEIGHTS,
    "mix": schemas.MIX,
}
MIXES = ["pretrain", "midtrain", "sft"]  # kiln.schemas.MixRow.mix
FORM_COLUMNS = {
    "short": "caption_short",
    "medium": "caption_medium",
    "long": "caption_long",
    "tags": "caption_tags",
    "json": "caption_json",
}


def ocr_engines(cfg: KilnConfig) -> list[str]:
    """What may have read a row: the configured engine, and its text gate where the gate did not fire."""
    from assets.ocr import TextGate

    return [cfg.data.ocr.engine] + ([TextGate(cfg.data.ocr.gate_side).name] if cfg.data.ocr.gate_side else [])


def expectations(dataset: str, cfg: KilnConfig) -> list:
    import great_expectations as gx

    E = gx.expectations
    ocred = [
        E.ExpectColumnValuesToBeUnique(column="id"),
        E.ExpectColumnValuesToBeInSet(column="ocr_engine", value_set=ocr_engines(cfg)),
        E.ExpectColumnValuesToBeBetween(column="text_area_share", min_value=0, max_value=1),
        E.ExpectColumnValuesToBeBetween(column="text_density", min_value=0),
        E.ExpectColumnValuesToBeBetween(column="text_complexity", min_value=0),
        E.ExpectColumnValuesToBeBetween(column="min_text_height", min_value=0),
        E.ExpectColumnValuesToMatchRegex(column="ocr_boxes", regex=r"^\[.*\]$"),
    ]
    captioned = ocred + [
        E.ExpectColumnValueLengthsToBeBetween(column="caption", min_value=3, max_value=2000),
        E.ExpectColumnValuesToNotMatchRegex(column="caption", regex=PATH_LEAK),
        E.ExpectColumnValuesToMatchRegex(column="caption_decoding", regex=r"^\{.*\}$"),
    ]
    rewritten = captioned + [
        E.ExpectColumnValuesToMatchRegex(column="caption_json", regex=r"^\{.*\}$"),
    ]
    for form, column in FORM_COLUMNS.items():
        lo, hi = cfg.data.rewrite.lengths[form]
        rewritten.append(E.ExpectColumnValueLengthsToBeBetween(column=column, min_value=lo, max_value=hi))
        if form != "json":  # JSON escapes slashes legitimately; its text is checked through the other forms
            rewritten.append(E.ExpectColumnValuesToNotMatchRegex(column=column, regex=PATH_LEAK))
    pairs = [
        E.ExpectColumnValuesToBeUnique(column="id"),
        E.ExpectColumnValueLengthsToBeBetween(column="prompt", min_value=1),
        E.ExpectColumnValuesToNotMatchRegex(column="prompt", regex=PATH_LEAK),
        E.ExpectColumnValuesToMatchRegex(column="dropped", regex=r'^\[".*"\]$'),
    ]
    weights = [
        E.ExpectColumnValuesToBeUnique(column="id"),
        E.ExpectColumnValuesToBeBetween(column="sampling_weight", min_value=0, strict_min=True),
        E.ExpectColumnMeanToBeBetween(column="sampling_weight", min_value=0.999, max_value=1.001),
    ]
    mix = [
        E.ExpectColumnValuesToBeUnique(column="id"),
        E.ExpectColumnValuesToBeUnique(column="order"),
        E.ExpectColumnValuesToBeBetween(column="order", min_value=0),
        E.ExpectColumnValuesToBeInSet(column="mix", value_set=MIXES),
        E.ExpectColumnValueLengthsToBeBetween(column="part", min_value=1),
        E.ExpectColumnValuesToBeBetween(column="sampling_weight", min_value=0, strict_min=True),
    ]
    suites = {
        "ocred": ocred,
        "ocr_captioned": captioned,
        "rewritten": rewritten,
        "prompt_pairs": pairs,
        "concept_weights": weights,
        "mix": mix,
    }
    if dataset not in suites:
        raise KeyError(f"no caption expectation suite for {dataset!r}; suites: {sorted(suites)}")
    return suites[dataset]


def validate_caption_table(table: pa.Table, dataset: str, cfg: KilnConfig) -> SuiteResult:
    return run_suite(table, dataset, expectations(dataset, cfg))
