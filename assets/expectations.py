"""great-expectations suites over each dataset: the data itself checked, not only its schema.

Pure functions (no Dagster): Dagster asset checks and CI tests call `validate_dataset` the same way.
Binary columns (hashes, pixels) are dropped before validation; their sizes are pinned by the Arrow schema.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from kiln.config import KilnConfig
from kiln.reasons import Reason

os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")


@dataclass(frozen=True)
class ExpectationOutcome:
    expectation: str
    column: str | None
    success: bool
    observed: str


@dataclass(frozen=True)
class SuiteResult:
    suite: str
    success: bool
    outcomes: list[ExpectationOutcome] = field(default_factory=list)

    @property
    def failed(self) -> list[ExpectationOutcome]:
        return [o for o in self.outcomes if not o.success]


def _expectations(dataset: str, cfg: KilnConfig) -> list:
    import great_expectations as gx

    E = gx.expectations
    f = cfg.data.filters
    manifest = [
        E.ExpectColumnValuesToBeUnique(column="id"),
        E.ExpectColumnValuesToNotBeNull(column="uri"),
        E.ExpectColumnValuesToMatchRegex(column="md5", regex=r"^[0-9a-f]{32}$"),
        E.ExpectColumnValuesToBeBetween(column="bytes", min_value=1),
        E.ExpectColumnValuesToBeBetween(column="width", min_value=1),
        E.ExpectColumnValuesToBeBetween(column="height", min_value=1),
    ]
    filtered = manifest + [
        E.ExpectColumnValuesToBeBetween(column="width", min_value=f.min_side),
        E.ExpectColumnValuesToBeBetween(column="height", min_value=f.min_side),
        E.ExpectColumnValuesToBeBetween(column="aspect", min_value=1.0, max_value=f.max_aspect),
        E.ExpectColumnValuesToBeBetween(column="laplacian_var", min_value=f.min_laplacian_var, max_value=f.max_laplacian_var),
        E.ExpectColumnValuesToBeBetween(column="white_ratio", min_value=0, max_value=f.max_white_ratio),
        E.ExpectColumnValuesToBeBetween(column="black_ratio", min_value=0, max_value=f.max_black_ratio),
    ]
    deduped = filtered + [
        E.ExpectColumnValuesToBeUnique(column="md5"),
        E.ExpectColumnValuesToNotBeNull(column="dup_group"),
    ]
    captioned = deduped + [
        E.ExpectColumnValuesToNotBeNull(column="caption"),
        E.ExpectColumnValueLengthsToBeBetween(column="caption", min_value=3, max_value=2000),
        # A caption must describe the image, never leak where it came from.
        E.ExpectColumnValuesToNotMatchRegex(column="caption", regex=r"(/|\\|\.(png|jpe?g|webp|gif|tiff?|bmp)\b)"),
    ]
    train = [
        E.ExpectColumnValuesToBeUnique(column="id"),
        E.ExpectColumnValuesToBeUnique(column="order"),
        E.ExpectColumnValuesToNotBeNull(column="caption"),
        E.ExpectColumnValuesToMatchRegex(column="bucket", regex=r"^\d+x\d+$"),
        E.ExpectColumnValuesToBeBetween(column="height", min_value=8),
        E.ExpectColumnValuesToBeBetween(column="width", min_value=8),
    ]
    rejected = [
        E.ExpectColumnValuesToBeUnique(column="id"),
        E.ExpectColumnValuesToBeInSet(column="reason", value_set=[r.value for r in Reason]),
    ]
    embedded = deduped + [E.ExpectColumnValuesToNotBeNull(column="embedder")]
    clustered = embedded + [
        E.ExpectColumnValuesToNotBeNull(column="cluster_path"),
        E.ExpectColumnValuesToBeBetween(column="leaf_cosine", min_value=-1.001, max_value=1.001),
    ]
    suites = {"embedded": embedded, "clustered": clustered, "manifest": manifest, "filtered": filtered, "deduped": deduped, "captioned": captioned, "train_set": train, "rejected": rejected}
    if dataset in suites:
        return suites[dataset]
    from assets import caption_expectations  # the caption branch's suites

    return caption_expectations._expectations(dataset, cfg)


def run_suite(table: pa.Table, dataset: str, expectations: list) -> SuiteResult:
    """Run expectations over a table with great-expectations (ephemeral context, pandas engine)."""
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    keep = [f.name for f in table.schema if not (pa.types.is_binary(f.type) or pa.types.is_fixed_size_binary(f.type))]
    df = table.select(keep).to_pandas()
    if df.empty:
        return SuiteResult(dataset, True, [])
    ctx = gx.get_context(mode="ephemeral")
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
    batch = ctx.data_sources.add_pandas("kiln").add_dataframe_asset(dataset).add_batch_definition_whole_dataframe("all")
    suite = ctx.suites.add(gx.ExpectationSuite(name=dataset, expectations=expectations))
    res = ctx.validation_definitions.add(gx.ValidationDefinition(name=dataset, data=batch, suite=suite)).run(batch_parameters={"dataframe": df})
    outcomes = []
    for r in res.results:
        conf = r.expectation_config
        observed = r.result.get("unexpected_percent", r.result.get("observed_value", ""))
        outcomes.append(ExpectationOutcome(conf.type, conf.kwargs.get("column"), bool(r.success), str(observed)))
    return SuiteResult(dataset, bool(res.success), outcomes)


def validate_table(table: pa.Table, dataset: str, cfg: KilnConfig) -> SuiteResult:
    return run_suite(table, dataset, _expectations(dataset, cfg))


def validate_dataset(folder: Path, dataset: str, cfg: KilnConfig) -> SuiteResult:
    """Validate a stage output folder's kept rows, a plain dataset folder, or one Parquet file."""
    import pyarrow.parquet as pq

    from kiln.stage import read_dataset

    folder = Path(folder)
    if folder.is_file():
        return validate_table(pq.read_table(folder), dataset, cfg)
    sub = folder / "kept" if (folder / "kept").is_dir() else folder
    return validate_table(read_dataset(sub), dataset, cfg)
