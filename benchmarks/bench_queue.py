"""Warehouse queue throughput: completed rows/s with 1, 2, 4, 8 workers on the local Postgres.

Three stages: NOOP (the queue's own cost: claim, fetch, write, commit), FILTERLIKE (a cheap per-row numpy
computation with the cost profile of the CPU filters) and the real `filter` stage (assets/filters.py: open,
decode once, every statistic and hash) over a manifest of the demo corpus's image files. Figures per worker count:
  rows_per_s         steady state, from the queue's own completion timestamps (first to last commit)
  wall_rows_per_s    rows / wall time from starting the workers to the last commit (includes start-up)
  vs_1_worker        rows_per_s / the 1-worker figure of the same stage, measured in this process
plus the embedded path (Parquet + DuckDB, no server) on the same rows as a second reference.
Prints one JSON line.  Usage: python benchmarks/bench_queue.py [--rows 40000] [--batch-size 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("KILN_PROGRESS", "0")

import kiln.warehouse as wh  # noqa: E402
from kiln.config import KilnConfig, load_config  # noqa: E402
from kiln.databases import connect as db_connect
from kiln.warehouse import postgres as pg  # noqa: E402
from kiln.warehouse.local import local_postgres_dsn  # noqa: E402
from kiln.warehouse.probes import FILTERLIKE, NOOP, probe_rows  # noqa: E402

TABLE = "bench_queue"


def run_once(dsn: str, stage, rows, workers: int, batch_size: int, cfg: KilnConfig, table: str = TABLE) -> dict:
    with db_connect(dsn) as conn:
        pg.drop_job(conn, table, stage.name)
    handle = wh.map(stage, rows, dsn=dsn, workers=0, table=table, batch_size=batch_size, cfg=cfg)
    t0 = time.time()
    handle.add_workers(workers)
    final = handle.wait(progress_bar=False, timeout=600)
    assert final.done == rows.num_rows, final
    ((first, last),) = handle.query(
        f'SELECT extract(epoch FROM min(last_tried_at)), extract(epoch FROM max(last_tried_at)) FROM "{handle.job.queue}"'
    )
    first_batch = min(batch_size, rows.num_rows)
    steady = (rows.num_rows - first_batch) / max(float(last) - float(first), 1e-6)
    return {"rows_per_s": round(steady), "wall_rows_per_s": round(rows.num_rows / (float(last) - t0))}


def embedded_once(stage, rows, workers: int, batch_size: int, cfg: KilnConfig) -> float:
    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        wh.map(stage, rows, workers=workers, batch_size=batch_size, cfg=cfg, root=root).wait(progress_bar=False)
        return round(rows.num_rows / (time.perf_counter() - t0))


def demo_manifest(n: int):
    """Ingest of `kiln demo-data --n n`: the filter stage's real input rows. Written once to a fixed folder,
    so the uris (and ids) of the warehouse's input table are the same on every run."""
    from pathlib import Path

    from assets.demo_corpus import write_demo_corpus
    from kiln.stage import read_dataset, run_stage

    cfg = load_config([])
    folder = Path(tempfile.gettempdir()) / f"kiln-bench-queue-demo-{n}"
    if not (folder / "manifest" / "summary.json").exists():
        write_demo_corpus(folder / "raw", n=n, seed=0, size=cfg.data.demo.size)
        run_stage("ingest", folder / "raw" / "images", folder / "manifest", cfg)
    return read_dataset(folder / "manifest" / "kept"), cfg


def scaling(dsn: str, stage, rows, workers: list[int], batch_size: int, cfg: KilnConfig, table: str = TABLE) -> dict:
    run_once(dsn, stage, rows.slice(0, 2 * batch_size), 1, batch_size, cfg, table)  # warm: server, forkserver, table
    figures = {str(w): run_once(dsn, stage, rows, w, batch_size, cfg, table) for w in workers}
    ref = figures[str(workers[0])]["rows_per_s"]
    for f in figures.values():
        f["vs_1_worker"] = round(f["rows_per_s"] / ref, 2)
    return {
        "rows": rows.num_rows,
        "workers": figures,
        "embedded_2_workers_rows_per_s": embedded_once(stage, rows, 2, batch_size, cfg),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=40_000)
    ap.add_argument("--cpu-rows", type=int, default=12_000)
    ap.add_argument("--batch-size", type=int, default=1000)
    ap.add_argument("--workers", type=int, nargs="*", default=[1, 2, 4, 8])
    ap.add_argument("--filter-images", type=int, default=1200, help="demo corpus size for the real filter stage")
    ap.add_argument("--filter-batch-size", type=int, default=100)
    a = ap.parse_args()
    dsn, cfg = local_postgres_dsn(), KilnConfig()
    out: dict = {"bench": "queue", "cpus": os.cpu_count(), "batch_size": a.batch_size}
    for stage, n in ((NOOP, a.rows), (FILTERLIKE, a.cpu_rows)):
        out[stage.name] = scaling(dsn, stage, probe_rows(n), a.workers, a.batch_size, cfg)
    from kiln.stage import get_stage

    manifest, demo_cfg = demo_manifest(a.filter_images)
    out["filter"] = scaling(
        dsn, get_stage("filter"), manifest, a.workers, a.filter_batch_size, demo_cfg, f"{TABLE}_images"
    )
    print(json.dumps(out, sort_keys=True))


if __name__ == "__main__":
    main()
