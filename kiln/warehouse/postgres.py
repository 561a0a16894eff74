"""The Postgres warehouse: typed tables, a per-stage queue, and the SQL that claims and completes it.

Tables, for an input table T (default `images`) and a stage S:

    T                 id text primary key + the typed columns of the rows loaded (the manifest)
    T__S              the queue: id, status ('kept' | 'rejected' | NULL), error, failure, attempts,
                      last_tried_at, worker, and the claim that holds the row now (claim, lease_until,
                      backend_pid); a partial index on (last_tried_at NULLS FIRST, id) over unclaimed
                      unfinished rows is the claim order
    T__S__kept        the stage's kept rows, typed by its output schema (itself a valid input table)
    T__S__rejected    the stage's rejects, REJECTED schema
    kiln_tables       name -> Arrow schema (IPC bytes): rows read back get their exact Arrow types
    kiln_jobs         (T, S) -> stage reference, config, batch size, max attempts, lease: what a worker
                      attached by (dsn, stage name) needs to run the stage

A claim is its own short transaction that counts the attempt and sets a lease; the results come back in
a second one, accepted only while the claim is still the row's. So a worker that dies (SIGKILL, segfault)
or hangs on a row has spent an attempt: its rows come back when its connection is gone or its lease runs
out, and a row that used up `max_attempts` becomes a reject (`worker_crash`, `timeout`, `stage_error`)
instead of killing worker after worker.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from psycopg import sql
from psycopg.types.json import Jsonb

from kiln.databases import DDL_LOCK
from kiln.reasons import Reason
from kiln.schemas import REJECTED
from kiln.warehouse.batch import MAX_ERROR_CHARS, BatchResult
from kiln.warehouse.schema import pg_type, rows_table, schema_from_bytes, schema_to_bytes, table_rows

MAX_IDENTIFIER = 63  # Postgres truncates longer names silently; we refuse them instead


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


# -------------------------------------------------------------------------------------------- tables
def ensure_registry(conn: psycopg.Connection) -> None:
    conn.execute(
        """
        CREATE TABLE IF NOT EXISTS kiln_tables (name text PRIMARY KEY, arrow_schema bytea NOT NULL);
        CREATE TABLE IF NOT EXISTS kiln_jobs (
            input_table text NOT NULL, stage text NOT NULL, stage_ref text NOT NULL, config jsonb NOT NULL,
            batch_size integer NOT NULL, max_attempts integer NOT NULL, PRIMARY KEY (input_table, stage));
        ALTER TABLE kiln_jobs ADD COLUMN IF NOT EXISTS lease_s double precision NOT NULL DEFAULT 1800;
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
            sql.SQL("CREATE TEMP TABLE {} (LIKE {}) ON COMMIT DROP").format(
                sql.Identifier(staging), sql.Identifier(name)
            )
        )
        copy_rows(conn, staging, table)
        (changed,) = conn.execute(
            sql.SQL("SELECT count(*) FROM {s} n JOIN {t} o USING (id) WHERE n IS DISTINCT FROM o").format(
                s=sql.Identifier(staging), t=sql.Identifier(name)
            )
        ).fetchone()
        if changed:
            raise ValueError(
                f"warehouse table {name!r} already holds {changed} of these ids with other values; "
                "load changed rows under a new table name (kiln map keys its tables by input and config)"
            )
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
    lease_s: float = 1800.0  # a claim older than this is taken back (the worker hung)

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
                   ALTER TABLE {q} ADD COLUMN IF NOT EXISTS failure text, ADD COLUMN IF NOT EXISTS claim text,
                     ADD COLUMN IF NOT EXISTS lease_until timestamptz, ADD COLUMN IF NOT EXISTS backend_pid integer;
                   CREATE INDEX IF NOT EXISTS {free} ON {q} (last_tried_at NULLS FIRST, id)
                     WHERE status IS NULL AND claim IS NULL;
                   CREATE INDEX IF NOT EXISTS {held} ON {q} (lease_until) WHERE status IS NULL AND claim IS NOT NULL"""
            ).format(
                q=q,
                free=sql.Identifier(_checked(f"{job.queue}_free")),
                held=sql.Identifier(_checked(f"{job.queue}_held")),
            )
        )
        create_table(conn, job.kept, output_schema)
        create_table(conn, job.rejected, REJECTED)
        conn.execute(
            """INSERT INTO kiln_jobs (input_table, stage, stage_ref, config, batch_size, max_attempts, lease_s)
               VALUES (%s, %s, %s, %s, %s, %s, %s)
               ON CONFLICT (input_table, stage) DO UPDATE SET stage_ref = EXCLUDED.stage_ref, config = EXCLUDED.config,
                 batch_size = EXCLUDED.batch_size, max_attempts = EXCLUDED.max_attempts, lease_s = EXCLUDED.lease_s""",
            (job.table, job.stage, job.stage_ref, Jsonb(job.config), job.batch_size, job.max_attempts, job.lease_s),
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


def refuse_other_config(conn: psycopg.Connection, job: Job) -> None:
    """A queue that holds results of this stage under another stage reference or config is never reused:
    its rows would come back as if this config had produced them. (`cluster` says where and how rows
    run, not what they give, so a change there resumes.)"""
    ensure_registry(conn)
    row = conn.execute(
        "SELECT stage_ref, config FROM kiln_jobs WHERE input_table = %s AND stage = %s", (job.table, job.stage)
    ).fetchone()
    if row is None:
        return
    ref, config = row
    config = config if isinstance(config, dict) else json.loads(config)
    if ref == job.stage_ref and {**config, "cluster": None} == {**job.config, "cluster": None}:
        return
    done = conn.execute(
        sql.SQL("SELECT count(*) FROM {} WHERE status IS NOT NULL").format(sql.Identifier(job.queue))
    ).fetchone()[0]
    if done:
        raise ValueError(
            f"warehouse queue {job.queue!r} holds {done} results of stage {job.stage!r} under another config; "
            "map into a new table name (kiln map's default keys it by input and config) or drop_job() first"
        )


def refuse_other_rows(conn: psycopg.Connection, job: Job, ids: list[str]) -> None:
    """A queue that already holds rows other than `ids` is another input's job: its results would come back
    with these (the same table name mapped twice with different rows, such as the API's default `images`).
    Refused before anything is loaded, never mixed in."""
    if conn.execute("SELECT to_regclass(%s)", (sql.Identifier(job.queue).as_string(conn),)).fetchone()[0] is None:
        return
    (other,) = conn.execute(
        sql.SQL("SELECT count(*) FROM {} WHERE NOT (id = ANY(%s))").format(sql.Identifier(job.queue)), (ids,)
    ).fetchone()
    if other:
        raise ValueError(
            f"warehouse queue {job.queue!r} holds {other} rows that are not among these {len(ids)}: it is another input's job; "
            "map into a table of its own (kiln map keys one by input and config) or drop_job() first"
        )


def read_job(conn: psycopg.Connection, table: str, stage: str) -> Job:
    row = conn.execute(
        "SELECT stage_ref, config, batch_size, max_attempts, lease_s FROM kiln_jobs WHERE input_table = %s AND stage = %s",
        (table, stage),
    ).fetchone()
    if row is None:
        raise KeyError(f"no warehouse job for stage {stage!r} over table {table!r}; start one with kiln.warehouse.map")
    ref, config, batch_size, max_attempts, lease_s = row
    config = config if isinstance(config, dict) else json.loads(config)
    return Job(table, stage, ref, config, batch_size, max_attempts, lease_s)


def drop_job(conn: psycopg.Connection, table: str, stage: str) -> None:
    """Forget a job: its queue, its results and its registry row (the input table stays)."""
    with conn.transaction():
        for name in (queue_table(table, stage), kept_table(table, stage), rejected_table(table, stage)):
            drop_table(conn, name)
        conn.execute("DELETE FROM kiln_jobs WHERE input_table = %s AND stage = %s", (table, stage))


# ------------------------------------------------------------------------------------- claim / write
@dataclass(frozen=True)
class Claim:
    token: str  # the rows' `claim` column while this worker holds them
    rows: pa.Table  # the stage's input columns, ordered by id


def claim(conn: psycopg.Connection, job: Job, input_schema: pa.Schema, n: int, worker: str) -> Claim | None:
    """Take up to n never-tried rows, else one row to retry (the longest-waiting), or None.

    Its own transaction: the attempt is counted now, before the stage runs, and the rows carry a lease
    (`lease_until`) and this connection's backend pid, so that a worker that dies or hangs on them has
    still used an attempt. A retry is claimed alone: a row that took its worker down is pinned to
    itself on the next try, and its former batch-mates complete without it.
    """
    q = sql.Identifier(job.queue)
    with conn.transaction():
        free = conn.execute(
            sql.SQL(
                """SELECT id, attempts FROM {q} WHERE status IS NULL AND claim IS NULL AND attempts < %s
                   ORDER BY last_tried_at NULLS FIRST, id LIMIT %s FOR UPDATE SKIP LOCKED"""
            ).format(q=q),
            (job.max_attempts, n),
        ).fetchall()
        if not free:
            return None
        ids = [i for i, attempts in free if attempts == 0] or [free[0][0]]
        token = uuid.uuid4().hex
        conn.execute(
            sql.SQL(
                """UPDATE {q} SET attempts = attempts + 1, claim = %s, worker = %s, backend_pid = pg_backend_pid(),
                     last_tried_at = clock_timestamp(), lease_until = clock_timestamp() + make_interval(secs => %s)
                   WHERE id = ANY(%s)"""
            ).format(q=q),
            (token, worker, job.lease_s, ids),
        )
        cols = sql.SQL(", ").join(map(sql.Identifier, input_schema.names))
        rows = conn.execute(
            sql.SQL("SELECT {cols} FROM {t} WHERE id = ANY(%s) ORDER BY id").format(
                cols=cols, t=sql.Identifier(job.table)
            ),
            (ids,),
        ).fetchall()
    return Claim(token, rows_table(rows, input_schema))


def write_results(conn: psycopg.Connection, job: Job, token: str, result: BatchResult, worker: str) -> int:
    """Results and failures of one claimed batch, for the rows this claim still holds; returns how many.

    A row whose lease ran out was taken back, and maybe completed by another worker: its result here is
    dropped, so a row still completes exactly once. A row that raised on its last attempt becomes a
    `stage_error` reject.
    """
    q = sql.Identifier(job.queue)
    with conn.transaction():
        held = {
            i
            for (i,) in conn.execute(
                sql.SQL("SELECT id FROM {q} WHERE claim = %s AND status IS NULL FOR UPDATE").format(q=q), (token,)
            ).fetchall()
        }
        ours = pa.array(sorted(held), pa.string())
        kept = result.kept.filter(pc.is_in(result.kept.column("id"), ours))
        rejected = result.rejected.filter(pc.is_in(result.rejected.column("id"), ours))
        failed = {i: e for i, e in result.failed.items() if i in held}
        copy_rows(conn, job.kept, kept)
        copy_rows(conn, job.rejected, rejected)
        statuses = BatchResult(kept, rejected, {}).statuses()
        ids = list(statuses) + list(failed)
        status = list(statuses.values()) + [None] * len(failed)
        error = [None] * len(statuses) + list(failed.values())
        conn.execute(
            sql.SQL(
                """UPDATE {q} SET status = v.status, error = v.error,
                     failure = CASE WHEN v.error IS NULL THEN NULL ELSE %s END,
                     claim = NULL, lease_until = NULL, backend_pid = NULL, last_tried_at = clock_timestamp(), worker = %s
                   FROM unnest(%s::text[], %s::text[], %s::text[]) AS v(id, status, error) WHERE {q}.id = v.id"""
            ).format(q=q),
            (Reason.STAGE_ERROR.value, worker, ids, status, error),
        )
        reject_exhausted(conn, job, list(failed))
    return len(ids)


def release_claim(conn: psycopg.Connection, job: Job, token: str, failure: str, error: str) -> int:
    """Give a claim's unfinished rows back with the reason its attempt failed (a worker's lease watchdog)."""
    with conn.transaction():
        ids = [
            i
            for (i,) in conn.execute(
                sql.SQL(
                    """UPDATE {q} SET claim = NULL, lease_until = NULL, backend_pid = NULL, failure = %s, error = %s,
                         last_tried_at = clock_timestamp()
                       WHERE claim = %s AND status IS NULL RETURNING id"""
                ).format(q=sql.Identifier(job.queue)),
                (failure, error, token),
            ).fetchall()
        ]
        reject_exhausted(conn, job, ids)
    return len(ids)


def release_abandoned(conn: psycopg.Connection, job: Job) -> int:
    """Take back the rows of claims whose worker is gone (`worker_crash`: its connection closed, as it does
    the moment a process dies) or whose lease ran out (`timeout`); returns how many came back.

    A row that has used its last attempt becomes a reject with that reason. Only held rows are looked at
    (a small partial index), so any worker can afford this whenever it finds nothing to claim.
    """
    q = sql.Identifier(job.queue)
    with conn.transaction():
        ids = [
            i
            for (i,) in conn.execute(
                sql.SQL(
                    """WITH held AS (
                         SELECT h.id, h.lease_until < clock_timestamp() AS expired,
                                EXISTS (SELECT 1 FROM pg_stat_activity a
                                        WHERE a.pid = h.backend_pid AND a.application_name = left(h.worker, 63)) AS alive
                         FROM {q} h WHERE h.status IS NULL AND h.claim IS NOT NULL FOR UPDATE OF h SKIP LOCKED)
                       UPDATE {q} SET claim = NULL, lease_until = NULL, backend_pid = NULL, last_tried_at = clock_timestamp(),
                         failure = CASE WHEN held.alive THEN %(timeout)s ELSE %(crash)s END,
                         error = CASE WHEN held.alive
                           THEN format('timeout: its batch ran past its lease of %%s s in %%s', %(lease)s, {q}.worker)
                           ELSE format('worker_crash: %%s died while it held this row (attempt %%s)', {q}.worker, {q}.attempts) END
                       FROM held WHERE {q}.id = held.id AND (held.expired OR NOT held.alive)
                       RETURNING {q}.id"""
                ).format(q=q),
                {"timeout": Reason.TIMEOUT.value, "crash": Reason.WORKER_CRASH.value, "lease": job.lease_s},
            ).fetchall()
        ]
        reject_exhausted(conn, job, ids)
    return len(ids)


def reject_exhausted(conn: psycopg.Connection, job: Job, ids: list[str] | None = None) -> int:
    """Rows (of `ids`, or all) that are unfinished, unclaimed and out of attempts become rejects whose reason
    is their last failure (`stage_error`, `worker_crash`, `timeout`) and whose detail is its error: the
    job ends with every row kept or rejected. Call inside a transaction."""
    if ids is not None and not ids:
        return 0
    q = sql.Identifier(job.queue)
    has_uri = "uri" in table_schema(conn, job.table).names
    only = sql.SQL("AND id = ANY(%(ids)s)") if ids is not None else sql.SQL("")
    cur = conn.execute(
        sql.SQL(
            """WITH gone AS (
                 UPDATE {q} SET status = 'rejected', last_tried_at = clock_timestamp()
                 WHERE status IS NULL AND claim IS NULL AND attempts >= %(max)s {only}
                 RETURNING id, failure, error, attempts)
               INSERT INTO {r} (id, uri, stage, reason, value, detail)
               SELECT g.id, {uri}, %(stage)s, coalesce(g.failure, %(stage_error)s),
                      CASE WHEN g.failure = %(timeout)s THEN %(lease)s END,
                      left(format('%%s (after %%s attempts)', coalesce(g.error, 'no error recorded'), g.attempts), %(chars)s)
               FROM gone g LEFT JOIN {t} i ON i.id = g.id"""
        ).format(
            q=q,
            r=sql.Identifier(job.rejected),
            t=sql.Identifier(job.table),
            only=only,
            uri=sql.SQL("coalesce(i.uri, '')" if has_uri else "''"),
        ),
        {
            "max": job.max_attempts,
            "ids": ids,
            "stage": job.stage,
            "stage_error": Reason.STAGE_ERROR.value,
            "timeout": Reason.TIMEOUT.value,
            "lease": float(job.lease_s),
            "chars": MAX_ERROR_CHARS,
        },
    )
    return cur.rowcount


def has_pending(conn: psycopg.Connection, job: Job) -> bool:
    """Rows without a result: claimable, held by a worker (maybe a dead or hung one) or waiting to be rejected."""
    return bool(
        conn.execute(
            sql.SQL("SELECT EXISTS (SELECT 1 FROM {} WHERE status IS NULL)").format(sql.Identifier(job.queue))
        ).fetchone()[0]
    )


def attempts_claimed(conn: psycopg.Connection, job: Job) -> int:
    """Attempts counted so far over the whole queue: it grows with every claim, so a supervisor can tell
    a worker that died holding rows from one that died before it claimed anything."""
    return int(
        conn.execute(sql.SQL("SELECT coalesce(sum(attempts), 0) FROM {}").format(sql.Identifier(job.queue))).fetchone()[
            0
        ]
    )


RATE_WINDOW_S = 5.0


def counts(conn: psycopg.Connection, job: Job) -> dict[str, float]:
    """Queue counts, and the completion rate over the last few seconds (rows/s)."""
    row = conn.execute(
        sql.SQL(
            """SELECT count(*), count(*) FILTER (WHERE status = 'kept'), count(*) FILTER (WHERE status = 'rejected'),
                      count(*) FILTER (WHERE status IS NULL AND error IS NOT NULL),
                      count(*) FILTER (WHERE status IS NULL AND (attempts < %(max)s OR claim IS NOT NULL)),
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
