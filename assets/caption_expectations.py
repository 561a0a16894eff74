"""great-expectations suites over the caption branch: OCR, OCR-grounded captions, rewrites, pairs, weights, mixes.

Same shape as assets.expectations (pure functions; Dagster asset checks and tests call
`validate_caption_dataset` alike). The checks the issue asks for: every kept row has every caption
form, no caption form leaks a file path, lengths fall within the configured ranges.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa

from assets.expectations import ExpectationOutcome, SuiteResult
from kiln.config import KilnConfig

os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")

PATH_LEAK = r"(/|\\|\.(png|jpe?g|webp|gif|tiff?|bmp|parquet|tar)\b)"
FORM_COLUMNS = {"short": "caption_short", "medium": "caption_medium", "long": "caption_long", "tags": "caption_tags", "json": "caption_json"}


def _expectations(dataset: str, cfg: KilnConfig) -> list:
    import great_expectations as gx

    E = gx.expectations
    ocred = [
        E.ExpectColumnValuesToBeUnique(column="id"),
        E.ExpectColumnValuesToNotBeNull(column="ocr_text"),
        E.ExpectColumnValuesToBeInSet(column="ocr_engine", value_set=["rapidocr", "tesseract"]),
        E.ExpectColumnValuesToBeBetween(column="text_area_share", min_value=0, max_value=1),
        E.ExpectColumnValuesToBeBetween(column="text_density", min_value=0),
        E.ExpectColumnValuesToBeBetween(column="text_complexity", min_value=0),
        E.ExpectColumnValuesToMatchRegex(column="ocr_boxes", regex=r"^\[.*\]$"),
    ]
    captioned = ocred + [
        E.ExpectColumnValuesToNotBeNull(column="caption"),
        E.ExpectColumnValueLengthsToBeBetween(column="caption", min_value=3, max_value=2000),
        E.ExpectColumnValuesToNotMatchRegex(column="caption", regex=PATH_LEAK),
        E.ExpectColumnValuesToMatchRegex(column="caption_decoding", regex=r"^\{.*\}$"),
    ]
    rewritten = captioned + [
        E.ExpectColumnValuesToNotBeNull(column="rewrite_source"),
        E.ExpectColumnValuesToMatchRegex(column="caption_json", regex=r"^\{.*\}$"),
    ]
    for form, column in FORM_COLUMNS.items():
        lo, hi = cfg.data.rewrite.lengths[form]
        rewritten += [
            E.ExpectColumnValuesToNotBeNull(column=column),
            E.ExpectColumnValueLengthsToBeBetween(column=column, min_value=lo, max_value=hi),
        ]
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
        E.ExpectColumnValuesToNotBeNull(column="part"),
    ]
    suites = {"ocred": ocred, "ocr_captioned": captioned, "rewritten": rewritten, "prompt_pairs": pairs, "concept_weights": weights, "mix": mix}
    if dataset not in suites:
        raise KeyError(f"no caption expectation suite for {dataset!r}; suites: {sorted(suites)}")
    return suites[dataset]


def validate_caption_table(table: pa.Table, dataset: str, cfg: KilnConfig) -> SuiteResult:
    """Run one caption-branch suite over a table (ephemeral great-expectations context, pandas engine)."""
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    keep = [f.name for f in table.schema if not (pa.types.is_binary(f.type) or pa.types.is_fixed_size_binary(f.type))]
    df = table.select(keep).to_pandas()
    if df.empty:
        return SuiteResult(dataset, True, [])
    ctx = gx.get_context(mode="ephemeral")
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
    batch = ctx.data_sources.add_pandas("kiln").add_dataframe_asset(dataset).add_batch_definition_whole_dataframe("all")
    suite = ctx.suites.add(gx.ExpectationSuite(name=dataset, expectations=_expectations(dataset, cfg)))
    res = ctx.validation_definitions.add(gx.ValidationDefinition(name=dataset, data=batch, suite=suite)).run(batch_parameters={"dataframe": df})
    outcomes = []
    for r in res.results:
        conf = r.expectation_config
        observed = r.result.get("unexpected_percent", r.result.get("observed_value", ""))
        outcomes.append(ExpectationOutcome(conf.type, conf.kwargs.get("column"), bool(r.success), str(observed)))
    return SuiteResult(dataset, bool(res.success), outcomes)


def validate_caption_dataset(folder: Path, dataset: str, cfg: KilnConfig) -> SuiteResult:
    """A stage output folder (its kept rows), a mix folder, or a single Parquet file (weights.parquet)."""
    import pyarrow.parquet as pq

    from kiln.stage import read_dataset

    folder = Path(folder)
    if folder.is_file():
        return validate_caption_table(pq.read_table(folder), dataset, cfg)
    sub = folder / "kept" if (folder / "kept").is_dir() else folder
    return validate_caption_table(read_dataset(sub), dataset, cfg)
