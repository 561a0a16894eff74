"""The embedded warehouse: the same queue semantics over Parquet folders, DuckDB for queries, no server.

Layout under the root (default data/warehouse), mirroring the Postgres tables name for name:

    <T>/part-*.parquet                      the input rows
    <T>__<S>/job.json, done.json            the job, and its end marker
    <T>__<S>/part-PP-BBBBB.parquet          queue state per (pass, batch): id, status, error, attempts
    <T>__<S>__kept/part-PP-BBBBB.parquet    kept rows (a valid input folder for kiln.stage and for map)
    <T>__<S>__rejected/part-PP-BBBBB.parquet

Pass 0 runs every batch on a process pool; rows a stage raised on go to the back, into pass 1, and so
on up to max_attempts passes: the retry order of the Postgres queue. Each file is written atomically
when its batch finishes, so another process can watch progress live. File names depend only on the
input and the batch size, never on timing or worker count: two runs write byte-identical files.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from functools import lru_cache
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kiln.config import KilnConfig
from kiln.paths import artifact
from kiln.schemas import REJECTED
from kiln.stage import StageOutput, read_dataset, split_rows, write_shards, write_table
from kiln.warehouse.batch import BatchResult, process_batch
from kiln.warehouse.handle import Progress, wait_until
from kiln.warehouse.processes import worker_context
from kiln.warehouse.postgres import kept_table, queue_table, rejected_table
from kiln.warehouse.stages import resolve_stage

STATE = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("status", pa.string()),
        pa.field("error", pa.string()),
        pa.field("attempts", pa.int32(), nullable=False),
    ]
)
RATE_WINDOW_S = 5.0


def default_root() -> Path:
    return artifact("warehouse")


@lru_cache(maxsize=8)
def _stage_and_config(stage_ref: str, config_json: str):
    return resolve_stage(stage_ref), KilnConfig.model_validate_json(config_json)


def run_batch(stage_ref: str, config_json: str, rows: pa.Table) -> BatchResult:
    """One batch in a pool process; the stage and config are resolved once per process."""
    stage, cfg = _stage_and_config(stage_ref, config_json)
    return process_batch(stage, rows, cfg)


def _write_atomic(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write_table(table, tmp)
    os.replace(tmp, path)


def state_table(result: BatchResult, attempts: int) -> pa.Table:
    statuses = result.statuses()
    ids = list(statuses) + list(result.failed)
    return pa.table(
        {
            "id": ids,
            "status": list(statuses.values()) + [None] * len(result.failed),
            "error": [None] * len(statuses) + list(result.failed.values()),
            "attempts": [attempts] * len(ids),
        },
        schema=STATE,
    )


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
        _write_atomic(state_table(result, attempts), self.queue / name)

    def connection(self) -> duckdb.DuckDBPyConnection:
        """DuckDB with one view per table, named as in Postgres; the queue view is each row's latest state."""
        con = duckdb.connect()
        for name, folder in ((self.table, self.input), (self.kept.name, self.kept), (self.rejected.name, self.rejected)):
            if any(folder.glob("part-*.parquet")):
                con.execute(f"CREATE VIEW \"{name}\" AS SELECT * FROM read_parquet('{folder}/part-*.parquet')")
        if any(self.queue.glob("part-*.parquet")):
            con.execute(
                f"""CREATE VIEW "{self.queue.name}" AS SELECT * EXCLUDE (filename),
                        regexp_extract(filename, '[^/]+$') AS part FROM read_parquet('{self.queue}/part-*.parquet', filename=true)
                    QUALIFY row_number() OVER (PARTITION BY id ORDER BY attempts DESC) = 1"""
            )
        return con

    def progress(self) -> Progress:
        meta = self.meta()
        total, max_attempts = meta["total"], meta["max_attempts"]
        if not any(self.queue.glob("part-*.parquet")):
            return Progress(total, 0, 0, 0, total, 0.0)
        con = self.connection()
        kept, rejected, failed, exhausted = con.execute(
            f"""SELECT count(*) FILTER (WHERE status = 'kept'), count(*) FILTER (WHERE status = 'rejected'),
                       count(*) FILTER (WHERE status IS NULL),
                       count(*) FILTER (WHERE status IS NULL AND attempts >= {int(max_attempts)})
                FROM "{self.queue.name}" """
        ).fetchone()
        per_part = dict(
            con.execute(f'SELECT part, count(status) FROM "{self.queue.name}" GROUP BY part').fetchall()
        )
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
        rows = con.execute(f'SELECT id, attempts, status, error FROM "{self.queue.name}" ORDER BY id').fetchall()
        con.close()
        return {i: (a, s, e) for i, a, s, e in rows}


def prepare(job: EmbeddedJob, rows: pa.Table | None, meta: dict) -> pa.Table:
    """A fresh job: previous results removed, input rows written (or read, for a named table)."""
    for folder in (job.queue, job.kept, job.rejected):
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
    if rows is not None:
        if job.input.exists():
            shutil.rmtree(job.input)
        write_shards(split_rows(rows, 100_000), job.input, rows.schema)
    else:
        rows = read_dataset(job.input)
    (job.queue / "job.json").write_text(json.dumps({**meta, "total": rows.num_rows}, indent=2, sort_keys=True))
    return rows


def run_passes(job: EmbeddedJob, rows: pa.Table, stage_ref: str, config_json: str, batch_size: int, workers: int, max_attempts: int) -> None:
    """Every batch, then the rows that raised at the back, up to max_attempts passes; then done.json."""
    stage = resolve_stage(stage_ref)
    module = (stage_ref.split(":")[0],) if ":" in stage_ref else ()
    pool = ProcessPoolExecutor(workers, mp_context=worker_context(("kiln.warehouse.embedded", *module))) if workers > 1 else None
    try:
        todo = rows.select(stage.input_schema.names)
        for attempt in range(1, max_attempts + 1):
            if not todo.num_rows:
                break
            batches = split_rows(todo, batch_size)
            names = [f"part-{attempt - 1:02d}-{i:05d}.parquet" for i in range(len(batches))]
            if pool is None:
                done = ((n, run_batch(stage_ref, config_json, b)) for n, b in zip(names, batches))
            else:
                futs = {pool.submit(run_batch, stage_ref, config_json, b): n for n, b in zip(names, batches)}
                done = ((futs[f], f.result()) for f in as_completed(futs))
            failed: list[str] = []
            for name, result in done:
                job.write_batch(name, result, attempt, stage.output_schema)
                failed += sorted(result.failed)
            todo = todo.filter(pc.is_in(todo.column("id"), pa.array(failed, pa.string())))
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
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
        final = wait_until(self.progress, lambda p: self.job.finished() or self._crashed(), f"{self.stage} (embedded)", progress_bar, timeout=timeout)
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise RuntimeError(f"embedded {self.stage} run failed: {self.error}") from self.error
        return self.progress() if final.pending else final

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


def start(stage_ref: str, rows: pa.Table | None, table: str, cfg: KilnConfig, root: Path, workers: int, batch_size: int, max_attempts: int) -> EmbeddedHandle:
    """Begin an embedded run in a background thread (which drives the process pool) and return its handle."""
    stage = resolve_stage(stage_ref)
    job = EmbeddedJob(root, table, stage.name)
    config_json = cfg.model_dump_json()
    meta = {"stage_ref": stage_ref, "batch_size": batch_size, "max_attempts": max_attempts}
    missing = [n for n in stage.input_schema.names if n not in job.input_schema(rows).names]
    if missing:
        raise ValueError(f"warehouse table {table!r} lacks the columns {missing} that stage {stage.name!r} reads")
    rows = prepare(job, rows, meta)
    handle = EmbeddedHandle(job)

    def drive() -> None:
        try:
            run_passes(job, rows, stage_ref, config_json, batch_size, workers, max_attempts)
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            handle.error = e

    handle._thread = threading.Thread(target=drive, name=f"kiln-warehouse-{stage.name}", daemon=True)
    handle._thread.start()
    return handle
