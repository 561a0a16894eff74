"""The embedded warehouse: the same queue semantics over Parquet folders, DuckDB for queries, no server.

Layout under the root (default data/warehouse), mirroring the Postgres tables name for name:

    <T>/part-*.parquet                      the input rows
    <T>__<S>/job.json, done.json            the job, and its end marker
    <T>__<S>/part-PP-BBBBB.parquet          queue state per (pass, batch): id, status, error, failure, attempts
    <T>__<S>__kept/part-PP-BBBBB.parquet    kept rows (a valid input folder for kiln.stage and for map)
    <T>__<S>__rejected/part-PP-BBBBB.parquet

Pass 0 runs every batch on worker processes (kiln.warehouse.pool); rows that failed go to the back,
into pass 1, one row per batch, and so on up to max_attempts passes: the retry order of the Postgres
queue. A row fails when the stage raises on it (`stage_error`), when its worker process dies under it
(`worker_crash`) or when its batch outlives the lease (`timeout`, the worker is killed); a row that fails
every pass becomes a reject with that reason, in a last file `part-<max_attempts>-00000`. Each file is
written atomically when its batch finishes, so another process can watch progress live, and a run that
is stopped resumes where it was: mapping the same input under the same config again skips every batch
whose state file is there. File names depend only on the input and the batch size, never on timing or
worker count: two runs write byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kiln.config import KilnConfig
from kiln.databases import embedded_root
from kiln.reasons import Reason
from kiln.schemas import REJECTED
from kiln.sql import quote_identifier, read_parquet
from kiln.stage import Rejects, StageOutput, read_dataset, split_rows, write_shards, write_table
from kiln.warehouse.batch import MAX_ERROR_CHARS, BatchResult
from kiln.warehouse.handle import Progress, wait_until
from kiln.warehouse.pool import BatchPool, Lost
from kiln.warehouse.postgres import kept_table, queue_table, rejected_table
from kiln.warehouse.stages import resolve_stage

STATE = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("status", pa.string()),
        pa.field("error", pa.string()),
        pa.field("failure", pa.string()),  # the reason code of a failed attempt: stage_error, worker_crash, timeout
        pa.field("attempts", pa.int32(), nullable=False),
    ]
)
RATE_WINDOW_S = 5.0


def default_root() -> Path:
    return embedded_root()


def _write_atomic(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write_table(table, tmp)
    os.replace(tmp, path)


def state_table(
    ids: list[str], status: list[str | None], error: list[str | None], failure: list[str | None], attempts: int
) -> pa.Table:
    return pa.table(
        {"id": ids, "status": status, "error": error, "failure": failure, "attempts": [attempts] * len(ids)},
        schema=STATE,
    )


def batch_state(result: BatchResult, attempts: int) -> pa.Table:
    statuses = result.statuses()
    n_ok, n_bad = len(statuses), len(result.failed)
    return state_table(
        list(statuses) + list(result.failed),
        list(statuses.values()) + [None] * n_bad,
        [None] * n_ok + list(result.failed.values()),
        [None] * n_ok + [Reason.STAGE_ERROR.value] * n_bad,
        attempts,
    )


def files_digest(folder: Path) -> str:
    """sha256 over a folder's part files, names and bytes: the input version a job's results belong to."""
    h = hashlib.sha256()
    for p in sorted(folder.glob("part-*.parquet")):
        h.update(p.name.encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


class EmbeddedJob:
    """Paths and reads of one (input table, stage) job under a warehouse root."""

    def __init__(self, root: Path, table: str, stage: str):
        self.root, self.table, self.stage = Path(root), table, stage
        self.input = self.root / table
        self.queue = self.root / queue_table(table, stage)
        self.kept = self.root / kept_table(table, stage)
        self.rejected = self.root / rejected_table(table, stage)

    def meta(self) -> dict:
        path = self.queue / "job.json"
        if not path.exists():
            raise KeyError(f"no embedded warehouse job for stage {self.stage!r} over {self.table!r} under {self.root}")
        return json.loads(path.read_text())

    def input_schema(self, rows: pa.Table | None = None) -> pa.Schema:
        """The schema of the rows about to be loaded, else of the input table already there."""
        if rows is not None:
            return rows.schema
        parts = sorted(self.input.glob("part-*.parquet"))
        if not parts:
            raise KeyError(f"no embedded warehouse table {self.table!r} under {self.root}")
        return pq.read_schema(parts[0])

    def finished(self) -> bool:
        return (self.queue / "done.json").exists()

    def write_batch(self, name: str, result: BatchResult, attempts: int, output_schema: pa.Schema) -> None:
        """Results first, queue state last: a state file names only rows whose results are on disk."""
        _write_atomic(result.kept.cast(output_schema), self.kept / name)
        _write_atomic(result.rejected.cast(REJECTED), self.rejected / name)
        _write_atomic(batch_state(result, attempts), self.queue / name)

    def write_lost(self, name: str, ids: list[str], lost: Lost, attempts: int) -> None:
        """A batch whose worker died or timed out: an attempt spent on each of its rows, no results."""
        n = len(ids)
        _write_atomic(state_table(ids, [None] * n, [lost.error] * n, [lost.failure] * n, attempts), self.queue / name)

    def write_exhausted(
        self, name: str, rows: pa.Table, last: dict[str, tuple[str, str]], attempts: int, lease_s: float
    ) -> None:
        """Rows that failed every attempt, as rejects whose reason is their last failure and detail its error."""
        rejects = Rejects(self.stage)
        uris = rows.column("uri").to_pylist() if "uri" in rows.column_names else [""] * rows.num_rows
        for i, uri in zip(rows.column("id").to_pylist(), uris):
            failure, error = last[i]
            value = lease_s if failure == Reason.TIMEOUT else None
            rejects.add(
                i, uri or "", failure, value=value, detail=f"{error} (after {attempts} attempts)"[:MAX_ERROR_CHARS]
            )
        ids = list(last)
        _write_atomic(rejects.table(), self.rejected / name)
        n = len(ids)
        state = state_table(ids, ["rejected"] * n, [last[i][1] for i in ids], [last[i][0] for i in ids], attempts)
        _write_atomic(state, self.queue / name)

    def failures_in(self, name: str) -> dict[str, tuple[str, str]]:
        """id -> (failure, error) of the rows a finished batch left without a result."""
        t = pq.read_table(self.queue / name).filter(pc.is_null(pc.field("status")))
        return {
            i: (f or Reason.STAGE_ERROR.value, e or "")
            for i, f, e in zip(*(t.column(c).to_pylist() for c in ("id", "failure", "error")))
        }

    def connection(self) -> duckdb.DuckDBPyConnection:
        """DuckDB with one view per table, named as in Postgres; the queue view is each row's latest state.

        Every name and path is quoted (kiln.sql) and files are listed, not globbed, so any folder name works.
        """
        con = duckdb.connect()
        for name, folder in (
            (self.table, self.input),
            (self.kept.name, self.kept),
            (self.rejected.name, self.rejected),
        ):
            if parts := sorted(folder.glob("part-*.parquet")):
                con.execute(f"CREATE VIEW {quote_identifier(name)} AS SELECT * FROM {read_parquet(parts)}")
        if parts := sorted(self.queue.glob("part-*.parquet")):
            con.execute(
                f"""CREATE VIEW {quote_identifier(self.queue.name)} AS SELECT * EXCLUDE (filename),
                        regexp_extract(filename, '[^/]+$') AS part FROM {read_parquet(parts, filename=True)}
                    QUALIFY row_number() OVER (PARTITION BY id ORDER BY attempts DESC, filename DESC) = 1"""
            )
        return con

    def progress(self) -> Progress:
        meta = self.meta()
        total, max_attempts = meta["total"], meta["max_attempts"]
        if not any(self.queue.glob("part-*.parquet")):
            return Progress(total, 0, 0, 0, total, 0.0)
        con = self.connection()
        q = quote_identifier(self.queue.name)
        kept, rejected, failed, exhausted = con.execute(
            f"""SELECT count(*) FILTER (WHERE status = 'kept'), count(*) FILTER (WHERE status = 'rejected'),
                       count(*) FILTER (WHERE status IS NULL),
                       count(*) FILTER (WHERE status IS NULL AND attempts >= $max)
                FROM {q}""",
            {"max": int(max_attempts)},
        ).fetchone()
        per_part = dict(con.execute(f"SELECT part, count(status) FROM {q} GROUP BY part").fetchall())
        con.close()
        now = time.time()
        mtimes = {p.name: p.stat().st_mtime for p in self.queue.glob("part-*.parquet")}
        recent = sum(n for part, n in per_part.items() if now - mtimes.get(part, 0.0) <= RATE_WINDOW_S)
        window = min(RATE_WINDOW_S, max(now - (self.queue / "job.json").stat().st_mtime, 0.5))
        pending = total - kept - rejected - exhausted
        return Progress(total, kept, rejected, failed, 0 if self.finished() else pending, recent / window)

    def results(self) -> StageOutput:
        kept = read_dataset(self.kept).sort_by("id")
        rejected = read_dataset(self.rejected).sort_by("id")
        return StageOutput(kept, rejected)

    def state(self) -> dict[str, tuple[int, str | None, str | None]]:
        """id -> (attempts, status, error): each row's latest queue state."""
        con = self.connection()
        rows = con.execute(
            f"SELECT id, attempts, status, error FROM {quote_identifier(self.queue.name)} ORDER BY id"
        ).fetchall()
        con.close()
        return {i: (a, s, e) for i, a, s, e in rows}


def prepare(job: EmbeddedJob, rows: pa.Table | None, meta: dict) -> pa.Table:
    """The job's input rows, written (or read, for a named table), and its folders: kept as they are when
    the job on disk ran the same stage and config over the same input (a resume), else emptied (only
    these three folders, which the warehouse itself wrote)."""
    if rows is not None:
        if job.input.exists():
            shutil.rmtree(job.input)
        write_shards(split_rows(rows, 100_000), job.input, rows.schema)
    else:
        rows = read_dataset(job.input)
    meta = {**meta, "total": rows.num_rows, "input_sha256": files_digest(job.input)}
    on_disk = json.loads((job.queue / "job.json").read_text()) if (job.queue / "job.json").exists() else None
    if on_disk == meta:
        (job.queue / "done.json").unlink(missing_ok=True)
        return rows
    for folder in (job.queue, job.kept, job.rejected):
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
    (job.queue / "job.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    return rows


def run_passes(
    job: EmbeddedJob,
    rows: pa.Table,
    stage_ref: str,
    config_json: str,
    batch_size: int,
    workers: int,
    max_attempts: int,
    lease_s: float,
) -> None:
    """Every batch, then the rows that failed, one per batch, up to max_attempts passes; rows that failed
    them all become rejects; then done.json. A batch whose state file exists is done (a resume)."""
    stage = resolve_stage(stage_ref)
    todo = rows.select(stage.input_schema.names)
    last: dict[str, tuple[str, str]] = {}  # id -> (failure, error) of its latest failed attempt
    with BatchPool(workers, stage_ref, config_json, lease_s) as pool:
        for attempt in range(1, max_attempts + 1):
            if not todo.num_rows:
                break
            batches = split_rows(todo, batch_size if attempt == 1 else 1)
            names = [f"part-{attempt - 1:02d}-{i:05d}.parquet" for i in range(len(batches))]
            failed: dict[str, tuple[str, str]] = {}
            for name in names:
                if (job.queue / name).exists():
                    failed.update(job.failures_in(name))
            run = [(n, b) for n, b in zip(names, batches) if not (job.queue / n).exists()]
            by_name = dict(run)
            for name, outcome in pool.run(run):
                if isinstance(outcome, Lost):
                    ids = by_name[name].column("id").to_pylist()
                    job.write_lost(name, ids, outcome, attempt)
                    failed.update(dict.fromkeys(ids, (outcome.failure, outcome.error)))
                else:
                    job.write_batch(name, outcome, attempt, stage.output_schema)
                    failed.update({i: (Reason.STAGE_ERROR.value, e) for i, e in outcome.failed.items()})
            last = failed
            todo = todo.filter(pc.is_in(todo.column("id"), pa.array(list(failed), pa.string())))
    if todo.num_rows:
        job.write_exhausted(
            f"part-{max_attempts:02d}-00000.parquet",
            todo,
            {i: last[i] for i in todo.column("id").to_pylist()},
            max_attempts,
            lease_s,
        )
    (job.queue / "done.json").write_text("{}\n")


class EmbeddedHandle:
    """A running (or finished) embedded job; `attach` makes one from another process too."""

    def __init__(self, job: EmbeddedJob, thread: threading.Thread | None = None):
        self.job = job
        self._thread = thread
        self.error: BaseException | None = None

    @property
    def stage(self) -> str:
        return self.job.stage

    def progress(self) -> Progress:
        return self.job.progress()

    def wait(self, progress_bar: bool = True, timeout: float | None = None) -> Progress:
        wait_until(
            self.progress,
            lambda p: self.job.finished() or self._crashed(),
            f"{self.stage} (embedded)",
            progress_bar,
            timeout=timeout,
        )
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise RuntimeError(f"embedded {self.stage} run failed: {self.error}") from self.error
        return self.progress()  # read again after the end: the last poll may predate the last file

    def _crashed(self) -> bool:
        return self._thread is not None and not self._thread.is_alive() and not self.job.finished()

    def results(self) -> StageOutput:
        return self.job.results()

    def state(self) -> dict[str, tuple[int, str | None, str | None]]:
        return self.job.state()

    def query(self, sql: str) -> list[tuple]:
        con = self.job.connection()
        try:
            return con.execute(sql).fetchall()
        finally:
            con.close()


def start(
    stage_ref: str,
    rows: pa.Table | None,
    table: str,
    cfg: KilnConfig,
    root: Path,
    workers: int,
    batch_size: int,
    max_attempts: int,
    lease_s: float,
) -> EmbeddedHandle:
    """Begin (or resume) an embedded run in a background thread, which drives the worker processes, and return its handle."""
    stage = resolve_stage(stage_ref)
    job = EmbeddedJob(root, table, stage.name)
    config_json = cfg.model_dump_json()
    results_config = cfg.model_dump_json(exclude={"cluster"})  # where rows run changes no result
    meta = {
        "stage_ref": stage_ref,
        "batch_size": batch_size,
        "max_attempts": max_attempts,
        "lease_s": lease_s,
        "config_sha256": hashlib.sha256(results_config.encode()).hexdigest(),
    }
    missing = [n for n in stage.input_schema.names if n not in job.input_schema(rows).names]
    if missing:
        raise ValueError(f"warehouse table {table!r} lacks the columns {missing} that stage {stage.name!r} reads")
    rows = prepare(job, rows, meta)
    handle = EmbeddedHandle(job)

    def drive() -> None:
        try:
            run_passes(job, rows, stage_ref, config_json, batch_size, workers, max_attempts, lease_s)
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            handle.error = e

    handle._thread = threading.Thread(target=drive, name=f"kiln-warehouse-{stage.name}", daemon=True)
    handle._thread.start()
    return handle
