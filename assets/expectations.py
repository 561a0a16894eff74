"""great-expectations suites over each dataset: the data itself checked, not only its schema.

Pure functions (no Dagster): Dagster asset checks and CI tests call `validate_dataset` the same way.
Every expectation here is one the Arrow schema cannot make: a not-null check on a column the schema
already declares non-nullable could never fail (check_schema refuses such a table), so there are none.
What is checked instead: value ranges, the stage's own thresholds holding on the rows it kept, accepted
codes (reject reasons from kiln.reasons, stage names), the uniqueness and form of ids, and, on a stage
output folder, the drift of its aspect-ratio and caption-length distributions against its previous
version (assets.drift).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from assets import caption_expectations
from assets.drift import check_against_previous
from assets.suite_runner import ExpectationOutcome, SuiteResult, run_suite
from kiln import schemas
from kiln.config import KilnConfig
from kiln.reasons import Reason
from kiln.stage_names import STAGE_MODULES
from kiln.trainshards import is_train_set, metadata_table

__all__ = [
    "ExpectationOutcome",
    "SuiteResult",
    "SUITE_SCHEMAS",
    "run_suite",
    "suite_expectations",
    "validate_dataset",
    "validate_table",
]

MANIFEST_ID = r"^[0-9a-f]{16}$"  # sha1 of the uri, 16 hex characters (kiln.schemas.ManifestRow)

# The Arrow schema each suite's table has (user_prompts rows are checked by the prompt_pairs suite: they carry its columns).
SUITE_SCHEMAS = {
    "manifest": schemas.MANIFEST,
    "filtered": schemas.FILTERED,
    "deduped": schemas.DEDUPED,
    "embedded": schemas.EMBEDDED,
    "clustered": schemas.CLUSTERED,
    "captioned": schemas.CAPTIONED,
    "train_set": schemas.TRAIN_META,
    "rejected": schemas.REJECTED,
    **caption_expectations.SUITE_SCHEMAS,
}


def suite_expectations(dataset: str, cfg: KilnConfig) -> list:
    """The expectations of one suite: the main chain's here, the caption branch's in assets.caption_expectations."""
    import great_expectations as gx

    E = gx.expectations
    f = cfg.data.filters
    manifest = [
        E.ExpectColumnValuesToBeUnique(column="id"),
        E.ExpectColumnValuesToMatchRegex(column="id", regex=MANIFEST_ID),
        E.ExpectColumnValuesToMatchRegex(column="md5", regex=r"^[0-9a-f]{32}$"),
        E.ExpectColumnValuesToBeBetween(column="bytes", min_value=1, max_value=cfg.data.ingest.max_bytes),
        E.ExpectColumnValuesToBeBetween(column="width", min_value=1),
        E.ExpectColumnValuesToBeBetween(column="height", min_value=1),
        E.ExpectColumnValuesToBeBetween(
            column="exif_orientation", min_value=0, max_value=8
        ),  # 0 = no tag, 1-8 the EXIF values
        E.ExpectColumnValuesToBeBetween(column="n_frames", min_value=1),
    ]
    # the filter's own thresholds hold on every row it kept
    filtered = manifest + [
        E.ExpectColumnValuesToBeInSet(column="format", value_set=list(f.formats)),
        E.ExpectColumnValuesToBeBetween(column="width", min_value=f.min_side),
        E.ExpectColumnValuesToBeBetween(column="height", min_value=f.min_side),
        E.ExpectColumnValuesToBeBetween(column="aspect", min_value=1.0, max_value=f.max_aspect),
        E.ExpectColumnValuesToBeBetween(
            column="laplacian_var", min_value=f.min_laplacian_var, max_value=f.max_laplacian_var
        ),
        E.ExpectColumnValuesToBeBetween(
            column="entropy", min_value=f.min_entropy, max_value=8
        ),  # bits of 256-bin histograms
        E.ExpectColumnValuesToBeBetween(column="white_ratio", min_value=0, max_value=f.max_white_ratio),
        E.ExpectColumnValuesToBeBetween(column="black_ratio", min_value=0, max_value=f.max_black_ratio),
        E.ExpectColumnValuesToBeBetween(column="border_share", min_value=0, max_value=f.max_border_share),
        E.ExpectColumnValuesToBeBetween(column="flat_share", min_value=0, max_value=1),
    ]
    deduped = filtered + [
        E.ExpectColumnValuesToBeUnique(column="md5"),
        E.ExpectColumnPairValuesToBeEqual(column_A="id", column_B="dup_group"),  # a kept row is its own group's keeper
    ]
    captioned = deduped + [
        E.ExpectColumnValueLengthsToBeBetween(column="caption", min_value=3, max_value=2000),
        # A caption must describe the image, never leak where it came from.
        E.ExpectColumnValuesToNotMatchRegex(column="caption", regex=r"(/|\\|\.(png|jpe?g|webp|gif|tiff?|bmp)\b)"),
    ]
    train = [
        E.ExpectColumnValuesToBeUnique(column="id"),
        E.ExpectColumnValuesToMatchRegex(column="id", regex=MANIFEST_ID),
        E.ExpectColumnValuesToBeUnique(column="order"),
        E.ExpectColumnValuesToBeBetween(column="order", min_value=0),
        E.ExpectColumnValuesToBeBetween(column="batch", min_value=0),
        E.ExpectColumnValueLengthsToBeBetween(column="caption", min_value=3, max_value=2000),
        E.ExpectColumnValuesToMatchRegex(column="caption_forms", regex=r"^\{.*\}$"),
        E.ExpectColumnValuesToBeBetween(column="sampling_weight", min_value=0, strict_min=True),
        E.ExpectColumnValuesToMatchRegex(column="bucket", regex=r"^\d+x\d+$"),
        E.ExpectColumnValuesToBeBetween(column="height", min_value=8),
        E.ExpectColumnValuesToBeBetween(column="width", min_value=8),
    ]
    rejected = [
        E.ExpectColumnValuesToBeUnique(column="id"),
        E.ExpectColumnValuesToBeInSet(column="reason", value_set=[r.value for r in Reason]),
        E.ExpectColumnValuesToBeInSet(column="stage", value_set=sorted(STAGE_MODULES)),
    ]
    # one embedder per dataset: cosines between two embedders' vectors mean nothing
    embedded = deduped + [E.ExpectColumnUniqueValueCountToBeBetween(column="embedder", min_value=1, max_value=1)]
    depth = len(cfg.data.clustering.levels)
    clustered = embedded + [
        E.ExpectColumnValuesToMatchRegex(
            column="cluster_path", regex=r"^\d+" + r"\.\d+" * (depth - 1) + "$"
        ),  # one label per level
        E.ExpectColumnValuesToBeBetween(column="leaf", min_value=0),
        E.ExpectColumnValuesToBeBetween(column="leaf_cosine", min_value=-1.001, max_value=1.001),
    ]
    suites = {
        "embedded": embedded,
        "clustered": clustered,
        "manifest": manifest,
        "filtered": filtered,
        "deduped": deduped,
        "captioned": captioned,
        "train_set": train,
        "rejected": rejected,
    }
    if dataset in suites:
        return suites[dataset]
    return caption_expectations.expectations(dataset, cfg)


def validate_table(table: pa.Table, dataset: str, cfg: KilnConfig) -> SuiteResult:
    return run_suite(table, dataset, suite_expectations(dataset, cfg))


def validate_dataset(folder: Path, dataset: str, cfg: KilnConfig) -> SuiteResult:
    """Validate a stage output folder's kept rows, a plain dataset folder, or one Parquet file.

    A stage output folder (one with kept/) is also checked for drift against its previous version, whose
    profile is stored beside it (assets.drift)."""
    import pyarrow.parquet as pq

    from kiln.stage import read_dataset

    folder = Path(folder)
    if folder.is_file():
        return validate_table(pq.read_table(folder), dataset, cfg)
    if is_train_set(folder):  # the pack stage's shards: their metadata, without the images
        table = metadata_table(folder).select(schemas.TRAIN_META.names).cast(schemas.TRAIN_META)
    elif (folder / "kept").is_dir():
        table = read_dataset(folder / "kept")
    else:
        return validate_table(read_dataset(folder), dataset, cfg)
    return validate_table(table, dataset, cfg).with_outcomes(check_against_previous(folder, table))
