"""One batch through a stage: a poison row is pinned down by bisection, the rest of the batch completes."""

from __future__ import annotations

import pyarrow as pa
import pytest

from kiln.config import KilnConfig
from kiln.stage import Stage, StageOutput
from kiln.warehouse.batch import process_batch
from kiln.warehouse.probes import COMPUTE, PROBE_INPUT, noop, probe_rows
from kiln.warehouse.schema import pg_type, rows_table, schema_from_bytes, schema_to_bytes, table_rows
from kiln.warehouse.stages import resolve_stage, stage_ref

CFG = KilnConfig()


def counting(stage_fn):
    calls = []

    def fn(rows: pa.Table, cfg: KilnConfig) -> StageOutput:
        calls.append(rows.num_rows)
        return stage_fn(rows, cfg)

    return fn, calls


def test_a_clean_batch_is_one_stage_call():
    fn, calls = counting(COMPUTE.fn)
    result = process_batch(Stage("c", fn, PROBE_INPUT, COMPUTE.output_schema), probe_rows(64), CFG)
    assert calls == [64] and not result.failed
    assert result.kept.num_rows + result.rejected.num_rows == 64


def test_poison_rows_are_isolated_and_every_other_row_gets_its_result():
    fn, calls = counting(COMPUTE.fn)
    result = process_batch(Stage("c", fn, PROBE_INPUT, COMPUTE.output_schema), probe_rows(64, poison=[9, 40]), CFG)
    assert sorted(result.failed) == ["row-0000009", "row-0000040"]
    assert result.failed["row-0000009"] == "ValueError: poison rows ['row-0000009']"
    assert len(result.statuses()) == 62
    assert len(calls) <= 1 + 2 * 2 * 6  # bisection, not one call per row
    # results keep input order, as if the batch had run clean without those rows
    clean = COMPUTE.fn(probe_rows(64).filter(pa.array([i not in (9, 40) for i in range(64)])), CFG)
    assert result.kept.equals(clean.kept) and result.rejected.equals(clean.rejected)


def test_a_stage_that_loses_a_row_fails_that_row_not_the_batch():
    def drops_row_3(rows: pa.Table, cfg: KilnConfig) -> StageOutput:
        out = noop(rows, cfg)
        return StageOutput(out.kept.filter(pa.compute.not_equal(out.kept.column("x"), 3)), out.rejected)

    result = process_batch(Stage("lossy", drops_row_3, PROBE_INPUT, PROBE_INPUT), probe_rows(16), CFG)
    assert list(result.failed) == ["row-0000003"] and "lost ['row-0000003']" in result.failed["row-0000003"]
    assert result.kept.num_rows == 15


def test_arrow_types_map_to_postgres_types_that_hold_them():
    assert [pg_type(t) for t in (pa.int8(), pa.int32(), pa.int64(), pa.float32(), pa.float64())] == [
        "smallint",
        "integer",
        "bigint",
        "real",
        "double precision",
    ]
    assert pg_type(pa.binary(18)) == "bytea" and pg_type(pa.string()) == "text"
    with pytest.raises(TypeError, match="no Postgres column type"):
        pg_type(pa.list_(pa.float32()))


def test_rows_and_schemas_round_trip_exactly():
    t = probe_rows(5, poison=[2])
    assert schema_from_bytes(schema_to_bytes(t.schema)).equals(t.schema)
    assert rows_table(table_rows(t), t.schema).equals(t)
    assert rows_table([], t.schema).equals(t.schema.empty_table())


def test_stages_are_found_again_by_reference():
    assert stage_ref(COMPUTE) == "kiln.warehouse.probes:COMPUTE"
    assert resolve_stage(stage_ref(COMPUTE)) is COMPUTE
    local = Stage("local", noop, PROBE_INPUT, PROBE_INPUT)
    with pytest.raises(ValueError, match="module level"):
        stage_ref(local)
