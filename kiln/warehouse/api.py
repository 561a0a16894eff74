"""`map(stage, rows)`: run a stage over rows on a warehouse queue and watch it.

With a DSN the rows go into Postgres and N local worker processes (spawned) work the queue; more can
join at any time (`handle.add_workers`, or `run_worker` from a Slurm array). Without one the same
stage runs on the embedded path (Parquet + DuckDB, a process pool). Both give the same results, row
for row, and the same `Progress`; `attach` watches a job from any other process.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pyarrow as pa

from kiln.config import KilnConfig, load_config
from kiln.databases import connect as db_connect
from kiln.progress import log
from kiln.stage import Stage, StageOutput
from kiln.warehouse import postgres as pg
from kiln.warehouse.embedded import EmbeddedHandle, EmbeddedJob, default_root
from kiln.warehouse.embedded import start as start_embedded
from kiln.warehouse.handle import Progress, wait_until
from kiln.warehouse.processes import worker_context
from kiln.warehouse.stages import resolve_stage, stage_ref
from kiln.warehouse.worker import TIMEOUT_EXIT, run_worker


class PostgresHandle:
    """A job on the Postgres queue; owns the local workers it started, if any."""

    def __init__(self, dsn: str, job: pg.Job):
        self.dsn, self.job = dsn, job
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.slurm_jobs: list = []  # submitit jobs of Slurm-array workers this handle submitted
        self._replaced: set[int] = set()  # pids of lost local workers already replaced
        self._claimed_when_replaced = -1  # the queue's attempt count at the last replacement

    @property
    def stage(self) -> str:
        return self.job.stage

    def add_workers(self, n: int, batch_size: int | None = None) -> list[multiprocessing.process.BaseProcess]:
        """Start n more local worker processes on this queue (see `worker_context`)."""
        ctx = worker_context((self.job.stage_ref.split(":")[0],) if ":" in self.job.stage_ref else ())
        new = [
            ctx.Process(
                target=run_worker,
                args=(self.dsn, self.job.stage, self.job.table, batch_size),
                name=f"kiln-worker-{self.job.stage}-{len(self.processes) + i}",
            )
            for i in range(n)
        ]
        for p in new:
            p.start()
        self.processes += new
        return new

    def add_slurm_workers(self, n: int, cfg: KilnConfig, batch_size: int | None = None) -> list:
        """Submit n more workers as a Slurm job array on `cfg.cluster` (kiln/warehouse/slurm_workers.py)."""
        from kiln.warehouse.slurm_workers import submit_queue_workers

        jobs = submit_queue_workers(self.dsn, self.job.stage, self.job.table, n, cfg, batch_size)
        self.slurm_jobs += jobs
        return jobs

    def progress(self) -> Progress:
        with db_connect(self.dsn) as conn:
            c = pg.counts(conn, self.job)
        return Progress(c["total"], c["kept"], c["rejected"], c["failed"], c["pending"], c["rate"])

    def _finished(self, p: Progress) -> bool:  # all done, or nobody of ours left to do it
        if p.pending == 0:
            return True
        self._replace_lost_workers()
        started = self.processes or self.slurm_jobs
        workers_gone = bool(started) and not any(w.is_alive() for w in self.processes) and self._slurm_workers_ended()
        return p.pending == 0 or workers_gone

    def _replace_lost_workers(self) -> None:
        """A local worker killed by a signal (SIGKILL, a segfault) or stopped by its lease watchdog is
        replaced while rows remain, so a poison row costs one worker per attempt, never the job. Only
        while the queue advances: if the previous replacements died before claiming anything, something
        other than a row kills them, and `wait` reports it instead of starting workers forever."""
        lost = [
            w
            for w in self.processes
            if w.exitcode is not None and (w.exitcode < 0 or w.exitcode == TIMEOUT_EXIT) and w.pid not in self._replaced
        ]
        if not lost:
            return
        with db_connect(self.dsn) as conn:
            claimed = pg.attempts_claimed(conn, self.job)
        if claimed == self._claimed_when_replaced:
            return
        self._claimed_when_replaced = claimed
        self._replaced.update(w.pid for w in lost)
        log.warning(
            "%s: %d workers lost (exit codes %s); starting replacements",
            self.stage,
            len(lost),
            [w.exitcode for w in lost],
        )
        self.add_workers(len(lost))

    def _slurm_workers_ended(self) -> bool:
        if not self.slurm_jobs:
            return True
        from slurm.state import query_states

        states = query_states([j.job_id for j in self.slurm_jobs])
        return all(j.job_id in states and states[j.job_id].terminal for j in self.slurm_jobs)

    def wait(self, progress_bar: bool = True, timeout: float | None = None) -> Progress:
        """Until no claimable row is left (or every worker this handle started has exited)."""
        final = wait_until(self.progress, self._finished, self.stage, progress_bar, timeout=timeout)
        for w in self.processes:
            w.join(timeout=30)
        if final.pending and self.processes:  # every worker of ours is gone: settle what they left behind
            with db_connect(self.dsn) as conn:
                pg.release_abandoned(conn, self.job)
                with conn.transaction():
                    pg.reject_exhausted(conn, self.job)
            final = self.progress()
        if final.pending:
            codes = [w.exitcode for w in self.processes] + [j.job_id for j in self.slurm_jobs]
            raise RuntimeError(
                f"{self.stage}: workers exited (codes {codes}) with {final.pending} rows left; add_workers() to finish"
            )
        return final

    def results(self) -> StageOutput:
        with db_connect(self.dsn) as conn:
            return StageOutput(pg.read_table(conn, self.job.kept), pg.read_table(conn, self.job.rejected))

    def state(self) -> dict[str, tuple[int, str | None, str | None]]:
        with db_connect(self.dsn) as conn:
            return pg.attempts(conn, self.job)

    def query(self, sql: str) -> list[tuple]:
        with db_connect(self.dsn) as conn:
            return conn.execute(sql).fetchall()


Handle = PostgresHandle | EmbeddedHandle


def _as_table(rows: pa.Table | list[dict], stage: Stage) -> pa.Table:
    return rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows, schema=stage.input_schema)


def map(
    stage: Stage | str,
    table_or_rows: pa.Table | list[dict] | str,
    dsn: str | None = None,
    workers: int = 2,
    table: str = "images",
    batch_size: int = 256,
    cfg: KilnConfig | None = None,
    max_attempts: int | None = None,
    root: Path | str | None = None,
    lease_s: float | None = None,
) -> Handle:
    """Start `stage` over rows (loaded into warehouse table `table`) or over an existing warehouse table.

    Returns at once; `handle.wait()` blocks with a progress bar, `handle.results()` gives the kept and
    rejected tables sorted by id. Mapping the same rows under the same config again resumes: finished
    rows keep their results (Postgres, and the embedded path under the same `root`). A queue that holds
    results of another config is refused, never reused. `max_attempts` and `lease_s` (seconds a batch
    may run before it counts as hung) default to `cluster.queue_max_attempts` / `cluster.queue_lease_s`.
    """
    ref = stage_ref(stage)
    st = resolve_stage(ref)
    if st.scope != "shard":
        raise ValueError(
            f"stage {st.name!r} is {st.scope}-scoped (needs all rows at once); it cannot run on a row queue"
        )
    cfg = cfg if cfg is not None else load_config()
    max_attempts = max_attempts if max_attempts is not None else cfg.cluster.queue_max_attempts
    lease_s = lease_s if lease_s is not None else cfg.cluster.queue_lease_s
    rows = None if isinstance(table_or_rows, str) else _as_table(table_or_rows, st)
    input_name = table_or_rows if isinstance(table_or_rows, str) else table
    if dsn is None:
        return start_embedded(
            ref, rows, input_name, cfg, Path(root or default_root()), workers, batch_size, max_attempts, lease_s
        )

    job = pg.Job(input_name, st.name, ref, cfg.model_dump(mode="json"), batch_size, max_attempts, lease_s)
    with db_connect(dsn) as conn:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (pg.DDL_LOCK,))
            pg.ensure_registry(conn)
            pg.refuse_other_config(conn, job)
            if rows is not None:
                pg.refuse_other_rows(conn, job, rows.column("id").to_pylist())
        if rows is not None:
            pg.load_rows(conn, input_name, rows)
        have = pg.table_schema(conn, input_name)
        missing = [n for n in st.input_schema.names if n not in have.names]
        if missing:
            raise ValueError(f"warehouse table {input_name!r} lacks the columns {missing} that stage {st.name!r} reads")
        pg.create_job(conn, job, st.output_schema, rows.column("id").to_pylist() if rows is not None else None)
    handle = PostgresHandle(dsn, job)
    handle.add_workers(workers)  # workers=0: only enqueue; run_worker elsewhere does the work
    return handle


def attach(stage: str, table: str = "images", dsn: str | None = None, root: Path | str | None = None) -> Handle:
    """Watch a job started elsewhere (another process, a Slurm array) by stage name."""
    if dsn is None:
        job = EmbeddedJob(Path(root or default_root()), table, stage)
        job.meta()  # fails clearly when there is no such job
        return EmbeddedHandle(job)
    with db_connect(dsn) as conn:
        return PostgresHandle(dsn, pg.read_job(conn, table, stage))
