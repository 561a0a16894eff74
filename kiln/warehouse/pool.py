"""Worker processes for the embedded queue that outlive the batches that kill them.

A `concurrent.futures` process pool breaks for good when one worker dies (BrokenProcessPool), and it
cannot stop a task that hangs. Here each worker is a process with its own pipe: the driver hands it one
batch at a time and waits on the pipes and the process sentinels together. A worker that dies while it
holds a batch gives `Lost(worker_crash)`, one that runs past the lease is killed and gives
`Lost(timeout)`; either way a fresh process takes its place and the other batches go on.
"""

from __future__ import annotations

import signal
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from multiprocessing.connection import Connection, wait
from typing import Self

import pyarrow as pa

from kiln.config import KilnConfig
from kiln.reasons import Reason
from kiln.warehouse.batch import BatchResult, process_batch
from kiln.warehouse.processes import worker_context
from kiln.warehouse.stages import resolve_stage


@dataclass(frozen=True)
class Lost:
    """A batch whose attempt ended without results: its process died, or was stopped past the lease."""

    failure: str  # Reason.WORKER_CRASH or Reason.TIMEOUT
    error: str


@lru_cache(maxsize=8)
def _stage_and_config(stage_ref: str, config_json: str):
    return resolve_stage(stage_ref), KilnConfig.model_validate_json(config_json)


def run_batch(stage_ref: str, config_json: str, rows: pa.Table) -> BatchResult:
    """One batch; the stage and config are resolved (and the stage set up) once per process."""
    stage, cfg = _stage_and_config(stage_ref, config_json)
    return process_batch(stage, rows, cfg)


READY = "ready"


class WorkerError(RuntimeError):
    """The worker itself failed (the stage would not load or set up): a fault of the run, not of a row."""


def serve(conn: Connection, stage_ref: str, config_json: str) -> None:
    """A worker process: batches in, results out, until the driver sends None."""
    try:
        stage, cfg = _stage_and_config(stage_ref, config_json)
        if stage.setup is not None:
            stage.setup(cfg)
        conn.send(READY)  # the lease of a batch starts here, not while the stage's models load
        while (rows := conn.recv()) is not None:
            conn.send(run_batch(stage_ref, config_json, rows))  # a row's own error is in the result
    except Exception as e:  # noqa: BLE001 - handed to the driver, which stops the run with it
        conn.send(WorkerError(f"{stage_ref} worker: {type(e).__name__}: {e}"))


def exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class _Worker:
    def __init__(self, ctx, stage_ref: str, config_json: str):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=serve, args=(child, stage_ref, config_json), name="kiln-embedded-worker", daemon=True
        )
        self.process.start()
        child.close()
        self.job: tuple[object, float] | None = None  # (key, deadline) of the batch it holds

    def stop(self, kill: bool = False) -> None:
        if kill:
            self.process.kill()
        else:
            try:
                self.conn.send(None)
            except OSError:
                pass
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


class BatchPool:
    """Up to `workers` processes running `stage_ref` over batches; `run` yields each batch's outcome.

    A batch goes only to a worker that has said it is ready (stage imported and set up), so the lease
    times the batch alone. A worker that dies before it is ready is a fault of the run, not of a row.
    """

    def __init__(self, workers: int, stage_ref: str, config_json: str, lease_s: float):
        module = (stage_ref.split(":")[0],) if ":" in stage_ref else ()
        self.ctx = worker_context(("kiln.warehouse.pool", *module))
        self.size, self.stage_ref, self.config_json, self.lease_s = max(workers, 1), stage_ref, config_json, lease_s
        self.starting: list[_Worker] = []
        self.idle: list[_Worker] = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        for w in self.starting + self.idle:
            w.stop()
        self.starting, self.idle = [], []

    def run(self, batches: Iterable[tuple[object, pa.Table]]) -> Iterator[tuple[object, BatchResult | Lost]]:
        """(key, rows) in, (key, BatchResult or Lost) out, in completion order."""
        todo = deque(batches)
        busy: list[_Worker] = []
        try:
            while todo or busy:
                while todo and self.idle:
                    key, rows = todo.popleft()
                    w = self.idle.pop()
                    w.conn.send(rows)
                    w.job = (key, time.monotonic() + self.lease_s)
                    busy.append(w)
                for _ in range(min(len(todo), self.size - len(busy)) - len(self.starting)):
                    self.starting.append(_Worker(self.ctx, self.stage_ref, self.config_json))
                deadline = min((w.job[1] for w in busy), default=None)
                watched = busy + self.starting
                timeout = None if deadline is None else max(deadline - time.monotonic(), 0)
                wait([w.conn for w in watched] + [w.process.sentinel for w in watched], timeout=timeout)
                self._check_starting()
                for w in list(busy):
                    outcome = self._outcome(w)
                    if outcome is None:
                        continue
                    if isinstance(outcome, WorkerError):
                        raise outcome
                    busy.remove(w)
                    key, _ = w.job
                    w.job = None
                    if isinstance(outcome, Lost):
                        w.stop(kill=True)
                    else:
                        self.idle.append(w)
                    yield key, outcome
        finally:
            for w in busy:  # the caller stopped early (an error): nothing may outlive the run
                w.stop(kill=True)

    def _check_starting(self) -> None:
        for w in list(self.starting):
            if w.conn.poll():
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):
                    msg = None
                if msg == READY:
                    self.starting.remove(w)
                    self.idle.append(w)
                    continue
                if isinstance(msg, WorkerError):
                    raise msg
            if not w.process.is_alive():
                w.process.join()
                raise WorkerError(
                    f"{self.stage_ref} worker died while starting ({exit_description(w.process.exitcode)})"
                )

    def _outcome(self, w: _Worker) -> BatchResult | Lost | WorkerError | None:
        """The batch's result, or why it has none, or None while it is still running within its lease."""
        if w.conn.poll():
            try:
                return w.conn.recv()
            except (EOFError, OSError):
                pass  # the pipe closed: the process is gone, see below
        if not w.process.is_alive() or w.conn.closed:
            w.process.join()
            return Lost(
                Reason.WORKER_CRASH.value,
                f"worker_crash: the worker process died ({exit_description(w.process.exitcode)}) while it ran this row's batch",
            )
        if time.monotonic() >= w.job[1]:
            return Lost(
                Reason.TIMEOUT.value,
                f"timeout: this row's batch ran past its lease of {self.lease_s:g} s; its worker was stopped",
            )
        return None
