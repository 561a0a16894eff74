"""How the warehouse starts local worker processes."""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os


def worker_context(preload: tuple[str, ...] = ()) -> multiprocessing.context.BaseContext:
    """How local workers start: never plain fork (the caller may hold threads, locks, CUDA).

    "forkserver" where the platform has it: a fresh interpreter (started like spawn) that has already
    imported the worker module forks each worker, so a worker starts in milliseconds instead of paying
    about a second of imports (pyarrow, pydantic, psycopg) per process. "spawn" elsewhere, or when
    KILN_WORKER_START=spawn.
    """
    method = os.environ.get("KILN_WORKER_START", "forkserver")
    if method not in multiprocessing.get_all_start_methods():
        method = "spawn"
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        # "__main__" (the default preload) lets each forked worker skip re-importing the caller's script;
        # pyarrow imports pandas lazily on its first Python -> Arrow conversion (about a second), so
        # the server imports it once instead of every worker.
        ctx.set_forkserver_preload(["__main__", "pandas", "kiln.warehouse.worker", *preload])
    return ctx
