"""`kiln map` and `kiln watch`: a stage over the warehouse queue from the command line, with live progress."""

from __future__ import annotations

import argparse
from pathlib import Path

from kiln.databases import connect as db_connect
from kiln.stage_names import add_stage_argument


def cmd_map(args: argparse.Namespace) -> int:

    from kiln.config import load_config
    from kiln.warehouse.local import local_postgres_dsn
    from kiln.warehouse.run import run_map

    dsn = args.dsn or (local_postgres_dsn() if args.postgres else None)
    s = run_map(
        args.stage,
        Path(args.input),
        Path(args.output),
        load_config(args.overrides),
        dsn,
        args.workers,
        args.table,
        slurm_workers=args.slurm_workers,
        overwrite=args.overwrite,
    )
    print(s.to_json(), end="")
    return 0


def job_tables(stage: str, dsn: str | None) -> list[str]:
    """The input tables that have a job of `stage`: on Postgres from `kiln_jobs`, embedded from the folders."""
    if dsn is None:
        from kiln.warehouse.embedded import default_root

        suffix = f"__{stage}"
        return sorted(p.parent.name[: -len(suffix)] for p in default_root().glob(f"*{suffix}/job.json"))
    from kiln.warehouse import postgres as pg

    with db_connect(dsn) as conn:
        pg.ensure_registry(conn)
        return [
            t
            for (t,) in conn.execute(
                "SELECT input_table FROM kiln_jobs WHERE stage = %s ORDER BY 1", (stage,)
            ).fetchall()
        ]


def cmd_watch(args: argparse.Namespace) -> int:
    import kiln.warehouse as wh
    from kiln.errors import UnknownName

    table = args.table
    if table is None:  # kiln map keys its tables: the one job of this stage, if there is one
        tables = job_tables(args.stage, args.dsn)
        if len(tables) != 1:
            raise UnknownName(
                f"kiln watch {args.stage}: {len(tables)} jobs of this stage ({', '.join(tables) or 'none'}); pick one with --table"
            )
        (table,) = tables
    p = wh.attach(args.stage, table=table, dsn=args.dsn).wait(progress_bar=True)
    print(
        f"{args.stage} on {table}: {p.done}/{p.total} done ({p.kept} kept, {p.rejected} rejected), {p.failed} failed, {p.remaining} remaining"
    )
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    m = subparsers.add_parser("map", help="run a shard-scope stage over the warehouse queue (Postgres or embedded)")
    add_stage_argument(m)
    m.add_argument("--input", required=True)
    m.add_argument("--output", required=True)
    m.add_argument("--dsn", default=None, help="Postgres DSN (default: the embedded warehouse, no server)")
    m.add_argument("--postgres", action="store_true", help="use KILN_PG_DSN, or start the local Postgres")
    m.add_argument(
        "--workers", type=int, default=2, help="local worker processes (more can join: kiln.warehouse.run_worker)"
    )
    m.add_argument(
        "--slurm-workers",
        type=int,
        default=0,
        help="also this many workers as a Slurm job array (Postgres; a cluster=... profile)",
    )
    m.add_argument(
        "--table", default=None, help="warehouse table name (default: one keyed by stage, input version and config)"
    )
    m.add_argument("--overwrite", action="store_true", help="replace an existing output folder kiln did not write")
    m.add_argument("overrides", nargs="*")
    m.set_defaults(fn=cmd_map)

    w = subparsers.add_parser("watch", help="attach to a running map job and show its progress")
    add_stage_argument(w)
    w.add_argument(
        "--table",
        default=None,
        help="the table `kiln map` named in its first line (default: the one job of this stage)",
    )
    w.add_argument("--dsn", default=None)
    w.set_defaults(fn=cmd_watch, overrides=[])
