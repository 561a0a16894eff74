"""The stage contract: every input row comes out exactly once, kept or rejected, and outputs are deterministic."""

import pyarrow as pa
import pytest

from kiln.schemas import MANIFEST, REJECTED, SchemaError, check_schema
from kiln.stage import AccountingError, Rejects, StageOutput, check_accounting, split_rows, write_table


def _ids(*ids):
    return pa.table({"id": list(ids)})


def test_accounting_accepts_a_partition_of_the_input():
    rej = Rejects("s")
    rej.add("c", "c.png", "too_small", 3.0)
    check_accounting("s", _ids("a", "b", "c"), StageOutput(_ids("a", "b"), rej.table()))


@pytest.mark.parametrize(
    "kept, rejected, message",
    [
        (("a",), (), "lost"),
        (("a", "b", "b"), (), "more than once"),
        (("a", "b"), ("b",), "more than once"),
        (("a", "b", "z"), (), "invented"),
    ],
)
def test_accounting_refuses_lost_duplicated_or_invented_rows(kept, rejected, message):
    rej = Rejects("s")
    for r in rejected:
        rej.add(r, r, "x")
    with pytest.raises(AccountingError, match=message):
        check_accounting("s", _ids("a", "b"), StageOutput(_ids(*kept), rej.table()))


def test_rejects_carry_reason_and_measured_value():
    rej = Rejects("filter")
    rej.add("a", "a.png", "bad_aspect", 4.5, "4.5 > 3.0")
    t = rej.table()
    assert t.schema == REJECTED
    assert t.to_pylist() == [
        {"id": "a", "uri": "a.png", "stage": "filter", "reason": "bad_aspect", "value": 4.5, "detail": "4.5 > 3.0"}
    ]


def test_schema_check_names_missing_and_mistyped_columns():
    bad = pa.table({"id": ["a"], "uri": ["u"], "bytes": ["not an int"]})
    with pytest.raises(SchemaError, match=r"column 'bytes' is string.*missing column 'md5'"):
        check_schema(bad, MANIFEST, "ingest output")


def test_parquet_writes_are_byte_identical(tmp_path):
    t = pa.table({"id": ["b", "a"], "v": [1.5, 2.5]})
    write_table(t, tmp_path / "1.parquet")
    write_table(t, tmp_path / "2.parquet")
    assert (tmp_path / "1.parquet").read_bytes() == (tmp_path / "2.parquet").read_bytes()


def test_split_rows_covers_every_row_once():
    t = pa.table({"id": [str(i) for i in range(10)]})
    parts = split_rows(t, 4)
    assert [p.num_rows for p in parts] == [4, 4, 2]
    assert split_rows(t.slice(0, 0), 4) == []
