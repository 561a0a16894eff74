"""Arrow <-> Postgres column types, and Arrow schemas kept losslessly beside the tables.

Postgres has no 1-byte integer and no fixed-size binary, so a column's Postgres type does not say
which Arrow type it came from. The Arrow schema of every warehouse table is therefore stored (as
Arrow IPC bytes) in `kiln_tables`, and rows read back are cast to it: int8, float32 and
fixed_size_binary columns round-trip exactly.
"""

from __future__ import annotations

import pyarrow as pa

# The queue's own columns; a stage output column may not reuse these names.
QUEUE_COLUMNS = ("id", "status", "error", "attempts", "last_tried_at", "worker")


def pg_type(t: pa.DataType) -> str:
    """The Postgres column type that holds every value of Arrow type `t` exactly."""
    if pa.types.is_int8(t) or pa.types.is_int16(t) or pa.types.is_uint8(t):
        return "smallint"
    if pa.types.is_int32(t) or pa.types.is_uint16(t):
        return "integer"
    if pa.types.is_int64(t) or pa.types.is_uint32(t):
        return "bigint"
    if pa.types.is_float32(t):
        return "real"
    if pa.types.is_float64(t):
        return "double precision"
    if pa.types.is_boolean(t):
        return "boolean"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "text"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return "bytea"
    raise TypeError(f"no Postgres column type for Arrow type {t}; add one in kiln/warehouse/schema.py")


def schema_to_bytes(schema: pa.Schema) -> bytes:
    return schema.serialize().to_pybytes()


def schema_from_bytes(data: bytes) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(data))


def table_rows(table: pa.Table) -> list[tuple]:
    """Rows as Python tuples, in column order: what COPY and executemany take."""
    return list(zip(*(c.to_pylist() for c in table.columns)))


def rows_table(rows: list[tuple], schema: pa.Schema) -> pa.Table:
    """Rows fetched from Postgres (columns in schema order) as an Arrow table of exactly `schema`."""
    cols = list(zip(*rows)) if rows else [()] * len(schema)
    return pa.table([pa.array(list(c), type=f.type) for c, f in zip(cols, schema)], schema=schema)
