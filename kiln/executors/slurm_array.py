"""A data stage as a Slurm job array: one array task per input shard, then one merge.

Each task applies the stage to its shard through the same `kiln.stage._apply` every door uses (schema
checks and row accounting included) and leaves its kept / rejected tables as Arrow IPC files (they
read back with the very chunking they were written with). The merge hands those per-shard outputs,
in shard order, to `kiln.stage.write_stage_output`, the writer `run_stage` uses, so the output folder
is byte-identical to running the stage in-process, and as safe to write: the output is checked before
anything is submitted (kiln.outputs.check_output), and the work folder is removed whether or not the
tasks succeed. Global-scope stages (dedup, pack) need every row at once: they run as a single array
task calling `run_stage`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pyarrow as pa

from kiln.config import KilnConfig
from kiln.outputs import check_output
from kiln.progress import log as kiln_log
from kiln.stage import (
    Stage,
    StageOutput,
    Summary,
    _apply,
    get_stage,
    input_shard_paths,
    input_shards,
    prepare_worker,
    read_verified_shard,
    run_stage,
    write_stage_output,
    write_table,
)
from slurm.jobs import Log, report, wait_for
from slurm.launcher import executor_for


# ------------------------------------------------------------------------------------- in the task
def _write_ipc(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with pa.OSFile(str(tmp), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    os.replace(tmp, path)


def _read_ipc(path: Path) -> pa.Table:
    with pa.OSFile(str(path), "rb") as f:
        return pa.ipc.open_file(f).read_all()


def run_shard(stage_name: str, shard: str, part: str, cfg: KilnConfig) -> int:
    """One array task: stage(shard) -> `<part>.kept.arrow` + `<part>.rejected.arrow`; returns rows in.
    The shard is checked against the sha256 its stage recorded (kiln.outputs)."""
    table = read_verified_shard(Path(shard))
    prepare_worker(stage_name, cfg)
    out = _apply(stage_name, table, cfg)
    _write_ipc(out.kept, Path(part + ".kept.arrow"))
    _write_ipc(out.rejected, Path(part + ".rejected.arrow"))
    return table.num_rows


def run_whole_stage(stage_name: str, input_path: str, output: str, cfg: KilnConfig, overwrite: bool = False) -> int:
    """The single task of a global-scope stage."""
    return run_stage(stage_name, input_path, output, cfg, overwrite=overwrite).input_rows


# ------------------------------------------------------------------------------------ on the driver
def shard_sources(stage: Stage, input_path: Path | str, cfg: KilnConfig, work: Path) -> list[Path]:
    """The Parquet file each array task reads: the input's shards, or (ingest) the file listing, split."""
    if stage.list_inputs is not None:
        sources = []
        for i, t in enumerate(input_shards(stage, input_path, cfg)):
            sources.append(work / "inputs" / f"part-{i:05d}.parquet")
            write_table(t, sources[-1])
        return sources
    return [p.resolve() for p in input_shard_paths(stage, Path(input_path))]


def _wait(jobs: list, cfg: KilnConfig, log: Log) -> list:
    states = wait_for(jobs, log, cfg.cluster.poll_s)
    return [report(j, states[j.job_id]).result for j in jobs]  # raises SlurmJobFailed with the log tail


def run_stage_array(
    stage_name: str,
    input_dir: Path | str,
    output_dir: Path | str,
    cfg: KilnConfig,
    max_parallel: int | None = None,
    log: Log = kiln_log.info,
    overwrite: bool = False,
) -> Summary:
    """Run a stage over `input_dir` as a job array on `cfg.cluster`; same OUT layout and bytes as `run_stage`,
    and the same refusals (an output overlapping the input; one holding what kiln did not write, unless `overwrite`).

    On the `local` profile this is `run_stage` itself, so callers (Dagster assets) need not branch.
    """
    if cfg.cluster.kind == "local":  # the embedded tier: in this process (and its pool)
        return run_stage(stage_name, input_dir, output_dir, cfg, overwrite=overwrite)
    check_output(output_dir, input_dir, overwrite)  # before any job: a refusal costs no cluster time
    stage = get_stage(stage_name)
    if stage.resources.cpus > cfg.cluster.array_cpus_per_task:  # the stage's own floor (kiln.stage.StageResources)
        cfg = cfg.model_copy(
            update={"cluster": cfg.cluster.model_copy(update={"array_cpus_per_task": stage.resources.cpus})}
        )
    # the input stays as given: ingest keeps relative uris relative, and tasks share the submit directory
    output_dir = Path(output_dir).resolve()
    executor = executor_for(cfg.cluster, "array", stage_name)
    executor.update_parameters(slurm_array_parallelism=max_parallel or cfg.cluster.max_array_parallel)
    if stage.scope == "global":
        (job,) = executor.map_array(
            run_whole_stage, [stage_name], [str(input_dir)], [str(output_dir)], [cfg], [overwrite]
        )
        log(f"{stage_name}: global stage as slurm job {job.job_id}")
        _wait([job], cfg, log)
        return Summary.read(output_dir)

    work = output_dir.parent / f".{output_dir.name}.array"  # kiln's own scratch: a leftover of an earlier run goes
    shutil.rmtree(work, ignore_errors=True)
    (work / "parts").mkdir(parents=True)
    try:
        sources = shard_sources(stage, input_dir, cfg, work)
        parts = [str(work / "parts" / f"part-{i:05d}") for i in range(len(sources))]
        rows_in: list[int] = []
        if sources:
            n = len(sources)
            jobs = executor.map_array(run_shard, [stage_name] * n, [str(s) for s in sources], parts, [cfg] * n)
            cap = max_parallel or cfg.cluster.max_array_parallel
            log(f"{stage_name}: {n} shards as slurm array {jobs[0].job_id.split('_')[0]} (at most {cap} at once)")
            rows_in = _wait(jobs, cfg, log)
        outs = [StageOutput(_read_ipc(Path(p + ".kept.arrow")), _read_ipc(Path(p + ".rejected.arrow"))) for p in parts]
        return write_stage_output(stage, sum(rows_in), outs, output_dir, cfg, input_path=input_dir, overwrite=overwrite)
    finally:
        shutil.rmtree(work, ignore_errors=True)
