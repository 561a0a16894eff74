"""The Postgres warehouse: typed tables, a per-stage queue, and the SQL that claims and completes it.

Tables, for an input table T (default `images`) and a stage S:

    T                 id text primary key + the typed columns of the rows loaded (the manifest)
    T__S              the queue: id, status ('kept' | 'rejected' | NULL), error, attempts,
                      last_tried_at, worker; a partial index on (last_tried_at NULLS FIRST, id)
                      WHERE status IS NULL is the claim order
    T__S__kept        the stage's kept rows, typed by its output schema (itself a valid input table)
    T__S__rejected    the stage's rejects, REJECTED schema
    kiln_tables       name -> Arrow schema (IPC bytes): rows read back get their exact Arrow types
    kiln_jobs         (T, S) -> stage reference, config, batch size, max attempts: what a worker
                      attached by (dsn, stage name) needs to run the stage

A claim and its results are one transaction: a worker that dies mid-batch takes nothing with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import psycopg
import pyarrow as pa
from psycopg import sql
from psycopg.types.json import Jsonb

from kiln.schemas import REJECTED
from kiln.warehouse.batch import BatchResult
from kiln.warehouse.schema import pg_type, rows_table, schema_from_bytes, schema_to_bytes, table_rows

MAX_IDENTIFIER = 63  # Postgres truncates longer names silently; we refuse them instead
DDL_LOCK = 7_345_001  # advisory lock key: one process at a time creates warehouse tables


def queue_table(table: str, stage: str) -> str:
    return _checked(f"{table}__{stage}")


def kept_table(table: str, stage: str) -> str:
    return _checked(f"{table}__{stage}__kept")


def rejected_table(table: str, stage: str) -> str:
    return _checked(f"{table}__{stage}__rejected")


def _checked(name: str) -> str:
    if len(name.encode()) > MAX_IDENTIFIER:
        raise ValueError(f"warehouse table name {name!r} is longer than {MAX_IDENTIFIER} bytes")
    return name


def connect(dsn: str, name: str = "kiln") -> psycopg.Connection:
    """Autocommit, so that every unit of work is an explicit `conn.transaction()`; `name` shows in pg_stat_activity."""
    return psycopg.connect(dsn, autocommit=True, application_name=name[:63])


# -------------------------------------------------------------------------------------------- tables
def ensure_registry(conn: psycopg.Connection) -> None:
    conn.execute(
        """
        CREATE TABLE IF NOT EXISTS kiln_tables (name text PRIMARY KEY, arrow_schema bytea NOT NULL);
        CREATE TABLE IF NOT EXISTS kiln_jobs (
            input_table text NOT NULL, stage text NOT NULL, stage_ref text NOT NULL, config jsonb NOT NULL,
            batch_size integer NOT NULL, max_attempts integer NOT NULL, PRIMARY KEY (input_table, stage));
        """
    )


def create_table(conn: psycopg.Connection, name: str, schema: pa.Schema) -> None:
    """A typed table with `id` as primary key, its Arrow schema registered; refuses a different schema."""
    if "id" not in schema.names:
        raise ValueError(f"warehouse table {name!r} needs an 'id' column; schema has {schema.names}")
    known = table_schema(conn, name, missing_ok=True)
    if known is not None:
        if not known.equals(schema):
            raise ValueError(f"warehouse table {name!r} exists with schema {known}, not {schema}")
        return
    cols = [
        sql.SQL("{} {}{}").format(
            sql.Identifier(f.name),
            sql.SQL(pg_type(f.type)),
            sql.SQL(" PRIMARY KEY" if f.name == "id" else (" NOT NULL" if not f.nullable else "")),
        )
        for f in schema
    ]
    conn.execute(sql.SQL("CREATE TABLE {} ({})").format(sql.Identifier(name), sql.SQL(", ").join(cols)))
    conn.execute("INSERT INTO kiln_tables VALUES (%s, %s)", (name, schema_to_bytes(schema)))


def table_schema(conn: psycopg.Connection, name: str, missing_ok: bool = False) -> pa.Schema | None:
    row = conn.execute("SELECT arrow_schema FROM kiln_tables WHERE name = %s", (name,)).fetchone()
    if row is None:
        if missing_ok:
            return None
        raise KeyError(f"no warehouse table {name!r}")
    return schema_from_bytes(row[0])


def copy_rows(conn: psycopg.Connection, name: str, table: pa.Table) -> None:
    """Bulk insert with COPY (the fastest path into Postgres)."""
    stmt = sql.SQL("COPY {} ({}) FROM STDIN").format(
        sql.Identifier(name), sql.SQL(", ").join(map(sql.Identifier, table.column_names))
    )
    with conn.cursor().copy(stmt) as copy:
        for row in table_rows(table):
            copy.write_row(row)


def load_rows(conn: psycopg.Connection, name: str, table: pa.Table) -> None:
    """Add rows to a warehouse table; ids already there are kept as they are (loading is idempotent)."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (DDL_LOCK,))
        create_table(conn, name, table.schema)
        staging = f"_load_{name}"[:MAX_IDENTIFIER]
        conn.execute(
            sql.SQL("CREATE TEMP TABLE {} (LIKE {}) ON COMMIT DROP").format(sql.Identifier(staging), sql.Identifier(name))
        )
        copy_rows(conn, staging, table)
        conn.execute(
            sql.SQL("INSERT INTO {} SELECT * FROM {} ON CONFLICT (id) DO NOTHING").format(
                sql.Identifier(name), sql.Identifier(staging)
            )
        )


def read_table(conn: psycopg.Connection, name: str) -> pa.Table:
    """A whole warehouse table, ordered by id, with its exact Arrow types."""
    schema = table_schema(conn, name)
    assert schema is not None
    rows = conn.execute(
        sql.SQL("SELECT {} FROM {} ORDER BY id").format(
            sql.SQL(", ").join(map(sql.Identifier, schema.names)), sql.Identifier(name)
        )
    ).fetchall()
    return rows_table(rows, schema)


def drop_table(conn: psycopg.Connection, name: str) -> None:
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(name)))
    conn.execute("DELETE FROM kiln_tables WHERE name = %s", (name,))


# ---------------------------------------------------------------------------------------------- jobs
@dataclass(frozen=True)
class Job:
    table: str
    stage: str  # the stage's name
    stage_ref: str  # how a worker imports it (kiln.warehouse.stages)
    config: dict  # KilnConfig.model_dump(mode="json")
    batch_size: int
    max_attempts: int

    @property
    def queue(self) -> str:
        return queue_table(self.table, self.stage)

    @property
    def kept(self) -> str:
        return kept_table(self.table, self.stage)

    @property
    def rejected(self) -> str:
        return rejected_table(self.table, self.stage)


def create_job(conn: psycopg.Connection, job: Job, output_schema: pa.Schema, ids: list[str] | None) -> int:
    """Create the queue and result tables and enqueue `ids` (all rows of the input table if None).

    Enqueueing is idempotent: rows already in the queue keep their state, so mapping the same rows
    again resumes a run instead of repeating it. Returns the number of rows newly enqueued.
    """
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (DDL_LOCK,))
        table_schema(conn, job.table)  # the input table must exist
        q = sql.Identifier(job.queue)
        conn.execute(
            sql.SQL(
                """CREATE TABLE IF NOT EXISTS {q} (
                    id text PRIMARY KEY, status text, error text, attempts integer NOT NULL DEFAULT 0,
                    last_tried_at timestamptz, worker text);
                   CREATE INDEX IF NOT EXISTS {ix} ON {q} (last_tried_at NULLS FIRST, id) WHERE status IS NULL"""
            ).format(q=q, ix=sql.Identifier(_checked(f"{job.queue}_claim")))
        )
        create_table(conn, job.kept, output_schema)
        create_table(conn, job.rejected, REJECTED)
        conn.execute(
            """INSERT INTO kiln_jobs VALUES (%s, %s, %s, %s, %s, %s)
               ON CONFLICT (input_table, stage) DO UPDATE SET stage_ref = EXCLUDED.stage_ref,
                 config = EXCLUDED.config, batch_size = EXCLUDED.batch_size, max_attempts = EXCLUDED.max_attempts""",
            (job.table, job.stage, job.stage_ref, Jsonb(job.config), job.batch_size, job.max_attempts),
        )
        where = sql.SQL("WHERE id = ANY(%s)") if ids is not None else sql.SQL("")
        cur = conn.execute(
            sql.SQL("INSERT INTO {q} (id) SELECT id FROM {t} {w} ON CONFLICT (id) DO NOTHING").format(
                q=q, t=sql.Identifier(job.table), w=where
            ),
            (ids,) if ids is not None else None,
        )
        added = cur.rowcount
    conn.execute(sql.SQL("ANALYZE {}").format(q))  # fresh statistics: the claim walks the partial index in order
    return added


def read_job(conn: psycopg.Connection, table: str, stage: str) -> Job:
    row = conn.execute(
        "SELECT stage_ref, config, batch_size, max_attempts FROM kiln_jobs WHERE input_table = %s AND stage = %s",
        (table, stage),
    ).fetchone()
    if row is None:
        raise KeyError(f"no warehouse job for stage {stage!r} over table {table!r}; start one with kiln.warehouse.map")
    ref, config, batch_size, max_attempts = row
    return Job(table, stage, ref, config if isinstance(config, dict) else json.loads(config), batch_size, max_attempts)


def drop_job(conn: psycopg.Connection, table: str, stage: str) -> None:
    """Forget a job: its queue, its results and its registry row (the input table stays)."""
    with conn.transaction():
        for name in (queue_table(table, stage), kept_table(table, stage), rejected_table(table, stage)):
            drop_table(conn, name)
        conn.execute("DELETE FROM kiln_jobs WHERE input_table = %s AND stage = %s", (table, stage))


# ------------------------------------------------------------------------------------- claim / write
def claim(conn: psycopg.Connection, job: Job, input_schema: pa.Schema, n: int) -> pa.Table:
    """Lock up to n unfinished rows, never-tried first, then the longest-waiting failures.

    Must run inside a transaction: the row locks are what keep other workers off these rows, and they
    last until this transaction commits its results (or dies with its worker).
    """
    cols = sql.SQL(", ").join(sql.Identifier("i", c) for c in input_schema.names)
    rows = conn.execute(
        sql.SQL(
            """WITH c AS (SELECT id FROM {q} WHERE status IS NULL AND attempts < %s
                          ORDER BY last_tried_at NULLS FIRST, id LIMIT %s FOR UPDATE SKIP LOCKED)
               SELECT {cols} FROM {t} i JOIN c ON i.id = c.id ORDER BY i.id"""
        ).format(q=sql.Identifier(job.queue), t=sql.Identifier(job.table), cols=cols),
        (job.max_attempts, n),
    ).fetchall()
    return rows_table(rows, input_schema)


def write_results(conn: psycopg.Connection, job: Job, result: BatchResult, worker: str) -> None:
    """Results and failures of one claimed batch, in the claim's transaction."""
    copy_rows(conn, job.kept, result.kept)
    copy_rows(conn, job.rejected, result.rejected)
    statuses = result.statuses()
    ids = list(statuses) + list(result.failed)
    status = list(statuses.values()) + [None] * len(result.failed)
    error = [None] * len(statuses) + list(result.failed.values())
    conn.execute(
        sql.SQL(
            """UPDATE {q} SET status = v.status, error = v.error, attempts = {q}.attempts + 1,
                   last_tried_at = clock_timestamp(), worker = %s
               FROM unnest(%s::text[], %s::text[], %s::text[]) AS v(id, status, error) WHERE {q}.id = v.id"""
        ).format(q=sql.Identifier(job.queue)),
        (worker, ids, status, error),
    )


def has_pending(conn: psycopg.Connection, job: Job) -> bool:
    """Unfinished rows that may still be claimed, including rows other workers hold right now."""
    return bool(
        conn.execute(
            sql.SQL("SELECT EXISTS (SELECT 1 FROM {} WHERE status IS NULL AND attempts < %s)").format(
                sql.Identifier(job.queue)
            ),
            (job.max_attempts,),
        ).fetchone()[0]
    )


RATE_WINDOW_S = 5.0


def counts(conn: psycopg.Connection, job: Job) -> dict[str, float]:
    """Queue counts, and the completion rate over the last few seconds (rows/s)."""
    row = conn.execute(
        sql.SQL(
            """SELECT count(*), count(*) FILTER (WHERE status = 'kept'), count(*) FILTER (WHERE status = 'rejected'),
                      count(*) FILTER (WHERE status IS NULL AND error IS NOT NULL),
                      count(*) FILTER (WHERE status IS NULL AND attempts < %(max)s),
                      count(*) FILTER (WHERE status IS NOT NULL
                                       AND last_tried_at > clock_timestamp() - make_interval(secs => %(w)s)),
                      extract(epoch FROM clock_timestamp() - min(last_tried_at))
               FROM {q}"""
        ).format(q=sql.Identifier(job.queue)),
        {"max": job.max_attempts, "w": RATE_WINDOW_S},
    ).fetchone()
    total, kept, rejected, failed, pending, recent, since_first = row
    window = min(RATE_WINDOW_S, max(float(since_first or 0.0), 0.5))
    return {
        "total": total,
        "kept": kept,
        "rejected": rejected,
        "failed": failed,
        "pending": pending,
        "rate": recent / window,
    }


def attempts(conn: psycopg.Connection, job: Job) -> dict[str, tuple[int, str | None, str | None]]:
    """id -> (attempts, status, error): the queue's own record, for inspection and tests."""
    rows = conn.execute(
        sql.SQL("SELECT id, attempts, status, error FROM {} ORDER BY id").format(sql.Identifier(job.queue))
    ).fetchall()
    return {i: (a, s, e) for i, a, s, e in rows}
