"""The data-stage contract: Parquet shards in, kept + rejected Parquet shards out, nothing lost.

A stage is a pure function over one Arrow table. `run_stage` is the thin door around it that every
caller uses (CLI, Dagster, DVC, Slurm array tasks): it reads the input shards, calls the function per
shard (or once over all rows for global stages such as dedup), checks that every input row came out
exactly once, and writes

    OUT/kept/part-00000.parquet ...      rows that go on
    OUT/rejected/part-00000.parquet ...  id, uri, stage, reason, value, detail
    OUT/summary.json                     counts in / kept / rejected / per reason
    OUT/.kiln-output                     the marker: the stage, and the sha256 of every file above

The output is replaced only when kiln wrote all of it, never when it overlaps the input, and atomically
(kiln.outputs, docs/safe-outputs.md); a reader checks each shard against the recorded sha256.
"""

from __future__ import annotations

import importlib
import json
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq

from kiln.config import KilnConfig
from kiln.errors import MissingInput, UnknownName
from kiln.outputs import (
    check_output,
    check_shard_set,
    read_shard,
    recorded_checksums,
    staged_output,
    write_marker,
)
from kiln.progress import log, progress
from kiln.schemas import REJECTED, check_schema
from kiln.stage_names import STAGE_MODULES  # name -> module defining `STAGE`, kept light for the CLI


@dataclass(frozen=True)
class StageOutput:
    kept: pa.Table
    rejected: pa.Table


@dataclass(frozen=True)
class StageResources:
    """What one worker of a stage needs; a Slurm array task asks for at least this."""

    cpus: int = 1
    gpus: int = 0


@dataclass(frozen=True)
class Stage:
    """One row of the stage registry (STAGE_MODULES -> each module's `STAGE`): every executor runs it the same way."""

    name: str
    fn: Callable[[pa.Table, KilnConfig], StageOutput]
    input_schema: pa.Schema
    output_schema: pa.Schema
    scope: Literal["shard", "global"] = "shard"  # global: one call over all rows (dedup, pack)
    id_column: str = "id"
    # Stages that read files rather than Parquet (ingest): input path -> (id, uri) table, sharded by `run_stage`.
    list_inputs: Callable[[str], pa.Table] | None = None
    resources: StageResources = StageResources()
    # Loads what the stage's shards share (a model) once per worker, before the first shard; it must be
    # idempotent (the stage's own loaders are cached per process).
    setup: Callable[[KilnConfig], object] | None = None
    # Writes the kept rows in a format of the stage's own instead of OUT/kept/*.parquet (pack: train-set shards).
    write_kept: Callable[[pa.Table, Path, KilnConfig], None] | None = None


class Rejects:
    """Collects reject rows for one stage; `table()` gives them in the REJECTED schema."""

    def __init__(self, stage: str):
        self.stage = stage
        self.rows: dict[str, list] = {n: [] for n in REJECTED.names}

    def add(self, id: str, uri: str, reason: str, value: float | None = None, detail: str = "") -> None:
        for k, v in zip(REJECTED.names, (id, uri, self.stage, reason, value, detail)):
            self.rows[k].append(v)

    def __len__(self) -> int:
        return len(self.rows["id"])

    def table(self) -> pa.Table:
        return pa.table(self.rows, schema=REJECTED)


def get_stage(name: str) -> Stage:
    if name not in STAGE_MODULES:
        raise UnknownName(f"unknown stage {name!r}; stages: {', '.join(STAGE_MODULES)}")
    return importlib.import_module(STAGE_MODULES[name]).STAGE


class StageInputError(FileNotFoundError):
    """A stage input that is missing or holds no Parquet shards."""


class AccountingError(AssertionError):
    """A stage lost, duplicated or invented rows."""


def check_accounting(stage: str, inputs: pa.Table, out: StageOutput, id_column: str = "id") -> None:
    ins = inputs.column(id_column).to_pylist()
    kept = out.kept.column("id").to_pylist() if out.kept.num_rows else []
    rej = out.rejected.column("id").to_pylist()
    if len(set(ins)) != len(ins):
        raise AccountingError(f"{stage}: input ids are not unique")
    outs = kept + rej
    if len(outs) != len(set(outs)):
        dup = [k for k, n in Counter(outs).items() if n > 1][:5]
        raise AccountingError(f"{stage}: rows came out more than once: {dup}")
    if set(outs) != set(ins):
        lost = sorted(set(ins) - set(outs))[:5]
        new = sorted(set(outs) - set(ins))[:5]
        raise AccountingError(f"{stage}: lost {lost} / invented {new}")


# --------------------------------------------------------------------------------------------- io
def shard_paths(dataset: Path) -> list[Path]:
    return sorted(dataset.glob("part-*.parquet"))


def read_dataset(dataset: Path) -> pa.Table:
    """All shards of one dataset folder (e.g. OUT/kept) as one table, in shard order, each checked against
    the sha256 its stage recorded."""
    paths = shard_paths(dataset)
    if not paths:
        raise MissingInput(
            f"no Parquet shards under {dataset}" + ("" if Path(dataset).exists() else " (no such folder)")
        )
    return pa.concat_tables(read_shards(Path(dataset), paths))


def read_shards(dataset: Path, paths: list[Path]) -> list[pa.Table]:
    """Shards of one dataset folder, verified: a shard whose bytes changed since its stage wrote them, or
    one it never wrote, is a ChecksumError naming the shard (a plain dataset folder has nothing to check)."""
    sums = recorded_checksums(dataset)
    check_shard_set(dataset, paths, sums)
    return [read_shard(p, sums[p.name] if sums else None) for p in paths]


def read_verified_shard(path: Path) -> pa.Table:
    """One shard of a dataset folder, checked as `read_shards` checks it (what a Slurm array task reads)."""
    path = Path(path)
    sums = recorded_checksums(path.parent)
    check_shard_set(path.parent, shard_paths(path.parent), sums)
    return read_shard(path, sums[path.name] if sums else None)


def write_table(table: pa.Table, path: Path) -> None:
    """Deterministic Parquet: same rows and schema give the same bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, compression="zstd", row_group_size=4096, write_statistics=True)


def write_shards(tables: Iterable[pa.Table], folder: Path, schema: pa.Schema) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    n = 0
    for i, t in enumerate(tables):
        write_table(t.cast(schema), folder / f"part-{i:05d}.parquet")
        n += 1
    if n == 0:  # an empty dataset is still a dataset, with its schema
        write_table(schema.empty_table(), folder / "part-00000.parquet")
    return n


def split_rows(table: pa.Table, shard_size: int) -> list[pa.Table]:
    return [table.slice(i, shard_size) for i in range(0, max(table.num_rows, 1), shard_size)] if table.num_rows else []


@dataclass
class Summary:
    stage: str
    input_rows: int = 0
    kept: int = 0
    rejected: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> str:
        d = {**self.__dict__, "by_reason": dict(sorted(self.by_reason.items()))}
        return json.dumps(d, indent=2, sort_keys=True) + "\n"

    @classmethod
    def read(cls, folder: Path) -> Summary:
        return cls(**json.loads((folder / "summary.json").read_text()))


def apply_stage(stage: Stage, rows: pa.Table, cfg: KilnConfig) -> StageOutput:
    """The stage call with its contract checked, the one place it is: schemas in and out, every row out once.

    Every executor calls this: in-process, the process pool, Slurm array tasks and the queue workers."""
    rows = check_schema(rows, stage.input_schema, f"{stage.name} input")
    out = stage.fn(rows, cfg)
    check_accounting(stage.name, rows, out, stage.id_column)
    kept = check_schema(out.kept, stage.output_schema, f"{stage.name} output")
    return StageOutput(kept, check_schema(out.rejected, REJECTED, f"{stage.name} rejects"))


def prepare_worker(stage_name: str, cfg: KilnConfig) -> None:
    """A worker's start: the stage's setup hook, once (a pool's initializer, an array task, a queue worker)."""
    st = get_stage(stage_name)
    if st.setup is not None:
        st.setup(cfg)


def _apply(stage_name: str, shard: pa.Table, cfg: KilnConfig) -> StageOutput:
    """`apply_stage` by stage name: what a worker process or an array task is handed (a name pickles cheaply)."""
    return apply_stage(get_stage(stage_name), shard, cfg)


def run_on_tables(stage: Stage, shards: list[pa.Table], cfg: KilnConfig, workers: int = 1) -> list[StageOutput]:
    """Apply a stage to in-memory shards (shard scope) or to all rows at once (global scope)."""
    if stage.scope == "global":
        whole = pa.concat_tables(shards) if shards else stage.input_schema.empty_table()
        return [_apply(stage.name, whole, cfg)]
    if workers > 1 and len(shards) > 1:
        with ProcessPoolExecutor(workers, initializer=prepare_worker, initargs=(stage.name, cfg)) as pool:
            futs = [pool.submit(_apply, stage.name, s, cfg) for s in shards]
            return [f.result() for f in progress(futs, desc=stage.name, unit="shard")]
    prepare_worker(stage.name, cfg)
    return [_apply(stage.name, s, cfg) for s in progress(shards, desc=stage.name, unit="shard")]


def input_folder(input_path: Path) -> Path:
    """The dataset folder a stage reads: a stage output's `kept/`, or the folder itself (a plain dataset)."""
    return input_path / "kept" if (input_path / "kept").is_dir() else input_path


def input_shard_paths(stage: Stage, input_path: Path) -> list[Path]:
    """The Parquet shards a stage reads; [] for an empty folder (an empty input, which `input_shards` warns of)."""
    if not input_path.exists():
        raise StageInputError(f"{stage.name}: the input {input_path} does not exist")
    src = input_folder(input_path)
    paths = shard_paths(src) if src.is_dir() else []
    if not paths and not (src.is_dir() and not any(src.iterdir())):
        raise StageInputError(f"{stage.name}: no Parquet shards (part-*.parquet) under {src}")
    return paths


def input_shards(stage: Stage, input_path: Path | str, cfg: KilnConfig) -> list[pa.Table]:
    """The input as shards; each shard of a stage output is checked against the sha256 its stage recorded."""
    if stage.list_inputs is not None:  # a uri stays as given: `s3://b/x` is no local Path
        shards = split_rows(stage.list_inputs(str(input_path)), cfg.data.ingest.shard_size)
    else:
        shards = read_shards(input_folder(Path(input_path)), input_shard_paths(stage, Path(input_path)))
    if not sum(s.num_rows for s in shards):
        log.warning("%s: the input %s is empty (0 rows); the output will be empty too", stage.name, input_path)
    return shards


def run_stage(
    name: str,
    input_path: Path | str,
    output: Path | str,
    cfg: KilnConfig,
    workers: int | None = None,
    overwrite: bool = False,
) -> Summary:
    """Run one stage from folder to folder in this process (or a pool of `workers`, default `cluster.workers`);
    the output folder is replaced atomically, and only when that deletes nothing kiln did not write (checked
    before the work, kiln.outputs.check_output). kiln.executors.execute picks this or another executor."""
    stage = get_stage(name)
    check_output(output, input_path, overwrite)
    shards = input_shards(stage, input_path, cfg)
    output = Path(output)
    outs = run_on_tables(stage, shards, cfg, workers=cfg.cluster.workers if workers is None else workers)
    return write_stage_output(
        stage, sum(s.num_rows for s in shards), outs, output, cfg, input_path=input_path, overwrite=overwrite
    )


def write_stage_output(
    stage: Stage,
    input_rows: int,
    outs: list[StageOutput],
    output: Path,
    cfg: KilnConfig,
    input_path: Path | str | None = None,
    overwrite: bool = False,
) -> Summary:
    """Write OUT/kept, OUT/rejected, OUT/summary.json and the marker OUT/.kiln-output from per-shard outputs,
    replacing OUT atomically. Refuses (kiln.outputs.OutputError) an OUT overlapping `input_path`, and one
    holding what kiln did not write unless `overwrite`.

    Shared by `run_stage` and the Slurm array merge (kiln.executors.slurm_array), so both doors write the same bytes.
    """
    name, output = stage.name, Path(output)
    kept_tables = [o.kept for o in outs]
    if stage.scope == "global":  # re-shard global outputs so downstream stages keep their parallelism
        kept_tables = split_rows(outs[0].kept, cfg.data.ingest.shard_size)
    rejected = pa.concat_tables([o.rejected for o in outs]) if outs else REJECTED.empty_table()

    summary = Summary(
        stage=name,
        input_rows=input_rows,
        kept=sum(o.kept.num_rows for o in outs),
        rejected=rejected.num_rows,
        by_reason=dict(Counter(rejected.column("reason").to_pylist())),
    )
    output = output.resolve()  # a symlinked OUT: the folder it points to is replaced, the link stays
    check_output(output, input_path, overwrite)
    with staged_output(output) as tmp:
        if stage.write_kept is not None:
            kept = pa.concat_tables([o.kept for o in outs]) if outs else stage.output_schema.empty_table()
            stage.write_kept(kept, tmp, cfg)
        else:
            write_shards(kept_tables, tmp / "kept", stage.output_schema)
        write_shards(split_rows(rejected, cfg.data.ingest.shard_size), tmp / "rejected", REJECTED)
        (tmp / "summary.json").write_text(summary.to_json())
        write_marker(tmp, name)
    log.info(
        "%s: %d in, %d kept, %d rejected %s",
        name,
        summary.input_rows,
        summary.kept,
        summary.rejected,
        summary.by_reason,
    )
    return summary
