"""`kiln map` and `kiln watch`: a stage over the warehouse queue from the command line, with live progress."""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

from kiln.stage_names import add_stage_argument


def queue_table(stage: str, input_path: Path | str, cfg) -> str:
    """The queue of one stage over one input version under one config: a rerun of the same work finds its
    results, and other work never shares its rows."""
    from kiln.lineage import output_hash

    key = f"{output_hash(input_path)}:{cfg.model_dump_json()}"
    return f"q_{stage}_{hashlib.sha1(key.encode()).hexdigest()[:12]}"


def run_map(
    stage: str, input_dir: Path, output: Path, cfg, dsn: str | None, workers: int, table: str | None = None, log=print, slurm_workers: int = 0,
    overwrite: bool = False,
):
    """Load a stage input folder into the warehouse, work it with `workers` local processes (and
    `slurm_workers` Slurm array tasks, Postgres only), write the usual OUT/kept, OUT/rejected,
    OUT/summary.json (rows sorted by id). Shared by the CLI and Dagster.

    The warehouse table is keyed by stage, input version and config (`queue_table`) unless
    `table` names one: a changed config or input never finds the results of another, and the same run
    again resumes. Every input row must come out kept or rejected exactly once, else this fails.
    """
    import pyarrow as pa

    import kiln.warehouse as wh
    from kiln.outputs import check_output
    from kiln.stage import get_stage, input_shards, write_stage_output

    check_output(output, input_dir, overwrite)  # before any work: never an output over the input or over foreign files
    st = get_stage(stage)
    rows = pa.concat_tables(input_shards(st, Path(input_dir), cfg))
    if slurm_workers and dsn is None:
        raise ValueError("Slurm queue workers need the Postgres warehouse (--dsn or --postgres)")
    table = table or queue_table(stage, input_dir, cfg)
    handle = wh.map(stage, rows, dsn=dsn, workers=workers, table=table, cfg=cfg)
    log(f"{stage}: {rows.num_rows} rows on {'postgres' if dsn else 'the embedded warehouse'} table {table!r}, {workers} workers")
    if slurm_workers:
        handle.add_slurm_workers(slurm_workers, cfg)
    p = handle.wait(progress_bar=True)
    if p.remaining:
        raise RuntimeError(f"{stage}: {p.remaining} rows without a result ({p.failed} failed after every attempt); see handle.state()")
    results = handle.results()
    check_rows_out(stage, table, rows, results)
    return write_stage_output(st, rows.num_rows, [results], Path(output), cfg, input_path=input_dir, overwrite=overwrite)


def check_rows_out(stage: str, table: str, rows, results) -> None:
    """Rows in == kept + rejected out, id for id: a warehouse table that also holds other rows (an earlier
    map into the same name) must fail here, not be written as this input's output."""
    ins = set(rows.column("id").to_pylist())
    outs = results.kept.column("id").to_pylist() + results.rejected.column("id").to_pylist()
    if len(outs) != len(ins) or set(outs) != ins:
        extra, missing = sorted(set(outs) - ins), sorted(ins - set(outs))
        raise RuntimeError(
            f"{stage}: {len(ins)} rows in but {results.kept.num_rows} kept + {results.rejected.num_rows} rejected out "
            f"of warehouse table {table!r} ({len(extra)} not in this input, e.g. {extra[:3]}; {len(missing)} without a "
            f"result, e.g. {missing[:3]}); map into a table of its own (leave --table out: kiln map keys one by input and config)"
        )


def cmd_map(args: argparse.Namespace) -> int:
    import sys

    from kiln.config import load_config
    from kiln.outputs import ChecksumError, OutputError
    from kiln.stage import StageInputError
    from kiln.warehouse.local import local_postgres_dsn

    dsn = args.dsn or (local_postgres_dsn() if args.postgres else None)
    try:
        s = run_map(args.stage, Path(args.input), Path(args.output), load_config(args.overrides), dsn, args.workers, args.table, slurm_workers=args.slurm_workers, overwrite=args.overwrite)
    except (StageInputError, OutputError, ChecksumError) as e:  # a refusal or a bad input: one plain line, as `kiln stage` prints it
        print(f"kiln: {e}", file=sys.stderr)
        return 2
    print(s.to_json(), end="")
    return 0


def job_tables(stage: str, dsn: str | None) -> list[str]:
    """The input tables that have a job of `stage`: on Postgres from `kiln_jobs`, embedded from the folders."""
    if dsn is None:
        from kiln.warehouse.embedded import default_root

        suffix = f"__{stage}"
        return sorted(p.parent.name[: -len(suffix)] for p in default_root().glob(f"*{suffix}/job.json"))
    from kiln.warehouse import postgres as pg

    with pg.connect(dsn) as conn:
        pg.ensure_registry(conn)
        return [t for (t,) in conn.execute("SELECT input_table FROM kiln_jobs WHERE stage = %s ORDER BY 1", (stage,)).fetchall()]


def cmd_watch(args: argparse.Namespace) -> int:
    import kiln.warehouse as wh
    from kiln.errors import UnknownName

    table = args.table
    if table is None:  # kiln map keys its tables: the one job of this stage, if there is one
        tables = job_tables(args.stage, args.dsn)
        if len(tables) != 1:
            raise UnknownName(f"kiln watch {args.stage}: {len(tables)} jobs of this stage ({', '.join(tables) or 'none'}); pick one with --table")
        (table,) = tables
    p = wh.attach(args.stage, table=table, dsn=args.dsn).wait(progress_bar=True)
    print(f"{args.stage} on {table}: {p.done}/{p.total} done ({p.kept} kept, {p.rejected} rejected), {p.failed} failed, {p.remaining} remaining")
    return 0


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    m = subparsers.add_parser("map", help="run a shard-scope stage over the warehouse queue (Postgres or embedded)")
    add_stage_argument(m)
    m.add_argument("--input", required=True)
    m.add_argument("--output", required=True)
    m.add_argument("--dsn", default=None, help="Postgres DSN (default: the embedded warehouse, no server)")
    m.add_argument("--postgres", action="store_true", help="use KILN_PG_DSN, or start the local Postgres")
    m.add_argument("--workers", type=int, default=2, help="local worker processes (more can join: kiln.warehouse.run_worker)")
    m.add_argument("--slurm-workers", type=int, default=0, help="also this many workers as a Slurm job array (Postgres; a cluster=... profile)")
    m.add_argument("--table", default=None, help="warehouse table name (default: one keyed by stage, input version and config)")
    m.add_argument("--overwrite", action="store_true", help="replace an existing output folder kiln did not write")
    m.add_argument("overrides", nargs="*")
    m.set_defaults(fn=cmd_map)

    w = subparsers.add_parser("watch", help="attach to a running map job and show its progress")
    add_stage_argument(w)
    w.add_argument("--table", default=None, help="the table `kiln map` named in its first line (default: the one job of this stage)")
    w.add_argument("--dsn", default=None)
    w.set_defaults(fn=cmd_watch, overrides=[])
