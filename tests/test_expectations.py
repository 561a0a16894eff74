"""The great-expectations suites check what the Arrow schema cannot: ranges, a stage's thresholds on the rows
it kept, registered codes, ids, and drift against the previous version. Each check is shown failing on real
demo rows changed the way a broken stage would change them."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from assets.drift import EXPECTATION as DRIFT
from assets.drift import drift_outcomes, profile, store_path
from assets.expectations import (
    SUITE_SCHEMAS,
    suite_expectations,
    validate_dataset,
    validate_table,
)
from kiln.config import load_config
from kiln.outputs import output_hash
from kiln.stage import read_dataset, write_table


def columns_of(e) -> list[str]:
    return [c for c in (getattr(e, "column", None), getattr(e, "column_A", None), getattr(e, "column_B", None)) if c]


@pytest.mark.slow
def test_no_suite_checks_for_nulls_that_the_schema_already_forbids():
    cfg = load_config([])
    for suite, schema in SUITE_SCHEMAS.items():
        for e in suite_expectations(suite, cfg):
            assert set(columns_of(e)) <= set(schema.names), (
                suite,
                type(e).__name__,
                columns_of(e),
            )  # a typo would test nothing
            if type(e).__name__ == "ExpectColumnValuesToNotBeNull":
                assert all(schema.field(c).nullable for c in columns_of(e)), (
                    f"{suite}: {columns_of(e)} cannot be null by schema"
                )


@pytest.fixture(scope="module")
def demo(demo_embedded):
    overrides, root = demo_embedded
    return load_config(overrides), root


@pytest.mark.slow
def test_the_demo_stage_outputs_pass_their_suites(demo):
    cfg, root = demo
    for key in ("manifest", "filtered", "deduped", "embedded"):
        res = validate_table(read_dataset(root / key / "kept"), key, cfg)
        assert res.success, res.failed
        rejected = validate_table(read_dataset(root / key / "rejected"), "rejected", cfg)
        assert rejected.success, rejected.failed


def with_value(table: pa.Table, column: str, row: int, value) -> pa.Table:
    values = table.column(column).to_pylist()
    values[row] = value
    return table.set_column(
        table.schema.get_field_index(column), column, pa.array(values, table.schema.field(column).type)
    )


def failed(table: pa.Table, suite: str, cfg) -> list[tuple[str, str | None]]:
    return [(o.expectation, o.column) for o in validate_table(table, suite, cfg).failed]


@pytest.mark.slow
def test_a_filter_that_let_a_bordered_image_through_fails_its_threshold_check(demo):
    cfg, root = demo
    kept = read_dataset(root / "filtered" / "kept")
    bordered = with_value(kept, "border_share", 0, cfg.data.filters.max_border_share + 0.05)
    assert failed(bordered, "filtered", cfg) == [("expect_column_values_to_be_between", "border_share")]


def test_a_kept_row_that_is_not_its_groups_keeper_fails(demo):
    cfg, root = demo
    kept = read_dataset(root / "deduped" / "kept")
    assert failed(with_value(kept, "dup_group", 0, kept.column("id")[1].as_py()), "deduped", cfg) == [
        ("expect_column_pair_values_to_be_equal", "id,dup_group")
    ]


def test_ids_are_unique_and_the_uri_hash(demo):
    cfg, root = demo
    kept = read_dataset(root / "manifest" / "kept")
    assert failed(pa.concat_tables([kept, kept.slice(0, 1)]), "manifest", cfg) == [
        ("expect_column_values_to_be_unique", "id")
    ]
    assert failed(with_value(kept, "id", 0, "not-a-sha1"), "manifest", cfg) == [
        ("expect_column_values_to_match_regex", "id")
    ]
    assert failed(with_value(kept, "exif_orientation", 0, 9), "manifest", cfg) == [
        ("expect_column_values_to_be_between", "exif_orientation")
    ]


def test_rejects_name_a_registered_reason_and_a_known_stage(demo):
    cfg, root = demo
    rejected = read_dataset(root / "filtered" / "rejected")
    assert failed(with_value(rejected, "reason", 0, "blurry"), "rejected", cfg) == [
        ("expect_column_values_to_be_in_set", "reason")
    ]
    assert failed(with_value(rejected, "stage", 0, "filters"), "rejected", cfg) == [
        ("expect_column_values_to_be_in_set", "stage")
    ]


def test_one_dataset_holds_one_embedders_vectors(demo):
    cfg, root = demo
    kept = read_dataset(root / "embedded" / "kept")
    assert failed(with_value(kept, "embedder", 0, "hf:siglip:other"), "embedded", cfg) == [
        ("expect_column_unique_value_count_to_be_between", "embedder")
    ]


# ------------------------------------------------------------------------------------------------ drift
def as_stage_output(table: pa.Table, folder) -> None:
    """Rows written the way a stage writes its output: <folder>/kept/part-00000.parquet."""
    write_table(table, folder / "kept" / "part-00000.parquet")


def drift_of(res) -> list:
    return [o for o in res.outcomes if o.expectation == DRIFT]


def test_aspect_drift_is_measured_against_the_previous_version_stored_beside_the_output(demo, tmp_path):
    cfg, root = demo
    kept = read_dataset(root / "deduped" / "kept")
    folder = tmp_path / "data" / "deduped"
    evens, odds = kept.take(pa.array(range(0, kept.num_rows, 2))), kept.take(pa.array(range(1, kept.num_rows, 2)))

    as_stage_output(evens, folder)
    before = output_hash(folder)
    first = validate_dataset(folder, "deduped", cfg)
    assert (
        first.success
        and [o.success for o in drift_of(first)] == [True]
        and "no previous version" in drift_of(first)[0].observed
    )
    assert (
        output_hash(folder) == before and store_path(folder).is_file()
    )  # stored beside the output, its data version untouched

    as_stage_output(odds, folder)  # a new version drawn from the same corpus: no drift
    second = validate_dataset(folder, "deduped", cfg)
    assert second.success and "PSI" in drift_of(second)[0].observed

    wider = odds.set_column(
        odds.schema.get_field_index("aspect"),
        "aspect",
        pc.min_element_wise(pc.multiply(odds.column("aspect"), 1.5), 2.9).cast(pa.float32()),
    )
    as_stage_output(wider, folder)  # a new source of wide images
    third = validate_dataset(folder, "deduped", cfg)
    assert [(o.expectation, o.column) for o in third.failed] == [(DRIFT, "aspect")]
    rerun = validate_dataset(
        folder, "deduped", cfg
    )  # the check run again on the same version still compares with the one before
    assert [(o.expectation, o.column) for o in rerun.failed] == [(DRIFT, "aspect")]
    assert json.loads(store_path(folder).read_text())["previous"]["profile"] == profile(odds)


def test_caption_length_drift_flags_a_captioner_that_writes_three_times_as_much(demo):
    cfg, root = demo
    captions = [c for c in pq.read_table(root / "raw" / "truth.parquet").column("caption").to_pylist() if c]
    half = len(captions) // 2
    previous = profile(pa.table({"caption": captions[:half]}))
    same_source = drift_outcomes(profile(pa.table({"caption": captions[half:]})), previous)
    assert [o.success for o in same_source] == [True]
    longer = drift_outcomes(profile(pa.table({"caption": [" ".join([c] * 3) for c in captions[half:]]})), previous)
    assert [(o.column, o.success) for o in longer] == [("caption", False)]


def test_drift_tolerates_the_sampling_noise_of_small_datasets():
    rng = np.random.default_rng(0)
    for _ in range(20):  # two samples of 60 rows from one distribution of aspects
        a, b = (pa.table({"aspect": pa.array(1 + rng.exponential(0.3, 60), pa.float32())}) for _ in range(2))
        assert all(o.success for o in drift_outcomes(profile(a), profile(b)))
