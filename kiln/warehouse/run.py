"""A stage over the warehouse queue, from an input folder to the usual output folder: what `kiln map`
(kiln.cli.warehouse) and the `queue` executor (kiln.executors) run."""

from __future__ import annotations

import hashlib
from pathlib import Path


def queue_table(stage: str, input_path: Path | str, cfg) -> str:
    """The queue of one stage over one input version under one config: a rerun of the same work finds its
    results, and other work never shares its rows."""
    from kiln.outputs import output_hash

    key = f"{output_hash(input_path)}:{cfg.model_dump_json()}"
    return f"q_{stage}_{hashlib.sha1(key.encode()).hexdigest()[:12]}"


def run_map(
    stage: str,
    input_dir: Path,
    output: Path,
    cfg,
    dsn: str | None,
    workers: int,
    table: str | None = None,
    log=print,
    slurm_workers: int = 0,
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
    log(
        f"{stage}: {rows.num_rows} rows on {'postgres' if dsn else 'the embedded warehouse'} table {table!r}, {workers} workers"
    )
    if slurm_workers:
        handle.add_slurm_workers(slurm_workers, cfg)
    p = handle.wait(progress_bar=True)
    if p.remaining:
        raise RuntimeError(
            f"{stage}: {p.remaining} rows without a result ({p.failed} failed after every attempt); see handle.state()"
        )
    results = handle.results()
    check_rows_out(stage, table, rows, results)
    return write_stage_output(
        st, rows.num_rows, [results], Path(output), cfg, input_path=input_dir, overwrite=overwrite
    )


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
