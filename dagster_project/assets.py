"""One Dagster asset per artifact, each a thin wrapper around a stage function in assets/ or training/."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq

from dagster_project.metadata import cluster_grids, dedup_groups_grid, stage_metadata, thumbnails
from dagster_project.pages import checkpoint_page, checkpoint_samples, evaluation_page, flat_numbers
from dagster_project.resources import KilnResource
from kiln.config import load_config
from kiln.executors import execute
from kiln.ladder import FINAL, rungs
from kiln.lineage import (
    MAIN_CHAIN,
    Step,
    asset_code_version,
    data_steps,
    default_config,
    output_hash,
    step_code_version,
    step_config_overrides,
)
from kiln.progress import log as kiln_log
from kiln.viz import markdown_image


@dg.observable_source_asset(
    name="raw_images",
    group_name="curation",
    description="The raw images where they are (`data.source`: the demo corpus, a folder, an object-store prefix, "
    "WebDataset shards, a .txt or Parquet list), observed: listed with each object's size and version into "
    "data/source/listing.parquet. Its data version is the listing's hash, so a new, changed or removed object "
    "marks manifest and everything after it stale.",
    required_resource_keys={"kiln"},
)
def raw_images(context) -> dg.ObserveResult:
    return observe_listing(context.resources.kiln)


def observe_listing(kiln: KilnResource) -> dg.ObserveResult:
    """List the source into data/source and say what was found; the one observation every door makes."""
    from assets.source import write_listing

    out = kiln.path("source")
    report = write_listing(kiln.config(), out, kiln.path("raw"))
    md = {
        "objects": report["objects"],
        "listed_bytes": report["listed_bytes"],
        "with_source_caption": report["with_source_caption"],
        "source": dg.MetadataValue.json({"source": report["source"]}),
        "path": dg.MetadataValue.path(str(out)),
    }
    uris = pq.read_table(out / "listing.parquet", columns=["uri"]).column("uri").to_pylist()
    if grid := thumbnails(uris[:24]):
        md["sample"] = dg.MetadataValue.md(grid)
    return dg.ObserveResult(data_version=dg.DataVersion(report["version"]), metadata=md)


def run_data_stage(stage: str, source: Path, out: Path, cfg, log: Callable[[str], None] | None = None) -> dg.MaterializeResult:
    """One data stage into `out` on the profile's executor (kiln.executors), with its metadata."""
    summary = execute(stage, source, out, cfg, log=log or kiln_log.info)
    md = stage_metadata(summary, out)
    data_version = dg.DataVersion(output_hash(out))
    extra: Callable[[Path], str | None] | None = {"dedup": dedup_groups_grid, "cluster": cluster_grids}.get(stage)
    if extra and (grid := extra(out)):
        md[f"{stage}_groups"] = dg.MetadataValue.md(grid)
    return dg.MaterializeResult(metadata=md, data_version=data_version)


def _stage_asset(st: Step) -> dg.AssetsDefinition:
    @dg.asset(
        name=st.key,
        deps=[st.upstream, *st.extra_deps],
        group_name=st.group,
        kinds={"python", "parquet"},
        code_version=step_code_version(st),
        description=f"`kiln stage {st.stage}` over {st.upstream}: kept rows + rejected rows with reasons.",
    )
    def _asset(context, kiln: KilnResource) -> dg.MaterializeResult:
        # a rung's train set composes the rung's own config: its resolution, its mix, the coverage weights
        cfg = load_config(step_config_overrides(st, kiln.data_dir, kiln.overrides)) if st.rung else kiln.config()
        return run_data_stage(st.stage, kiln.path(st.reads), kiln.path(st.key), cfg, log=context.log.info)

    return _asset


stage_assets = [_stage_asset(st) for st in data_steps()]  # the lineage's steps (kiln.lineage), main chain first


def train_checkpoint(context, data: Path, out: Path, cfg) -> dg.MaterializeResult:
    """The trainer into `out` (a Slurm job on a Slurm profile), with the checkpoint's metadata. The asset owns
    `out`: a re-materialization replaces the earlier run's checkpoints (the job itself resumes, so a requeue continues)."""
    from training.trainer import prepare_output, train

    slurm: dict = {}
    if cfg.cluster.kind == "slurm":
        prepare_output(out, resume=False, overwrite=True)
        slurm = _train_on_slurm(context, data, out, cfg)
    else:
        train(data, out, cfg, overwrite=True)
    return dg.MaterializeResult(metadata=checkpoint_page(out, samples=checkpoint_samples(out, cfg), details=slurm))


def _train_on_slurm(context, data: Path, out: Path, cfg) -> dict:
    """Submit the trainer as a Slurm job and wait; a failed job fails the materialization with its log tail."""
    from slurm.jobs import SlurmJobFailed, submit_and_wait
    from slurm.launcher import train_task

    try:
        report = submit_and_wait(train_task(data, out), cfg, log=context.log.info)
    except SlurmJobFailed as e:
        raise dg.Failure(
            description=f"slurm job {e.report.job_id} {e.report.state}",
            metadata={**e.report.metadata(), "log_tail": dg.MetadataValue.md(f"```\n{e.report.log_tail}\n```")},
        ) from None
    return {**report.metadata(), "log_tail": dg.MetadataValue.md(f"```\n{report.log_tail}\n```")}


@dg.asset(deps=[FINAL], group_name="evaluation", kinds={"pytorch", "image"}, description="A grid of samples per demo prompt from the checkpoint.",
          code_version=asset_code_version(("training.sampling",), ("train.sample",)))
def samples(kiln: KilnResource) -> dg.MaterializeResult:
    from training.sampling import sample_to_dir

    grid = sample_to_dir(kiln.path(FINAL), kiln.path("samples"), kiln.config())
    n = pq.read_metadata(kiln.path("samples") / "samples.parquet").num_rows if (kiln.path("samples") / "samples.parquet").exists() else 0
    return dg.MaterializeResult(metadata={"grid": dg.MetadataValue.md(markdown_image(Path(grid).read_bytes(), "samples")), "images": n, "path": dg.MetadataValue.path(str(grid))})


EVAL_SET = rungs(default_config())[0].train_set  # the first rung's train set: its held-out rows no rung trained on


@dg.asset(deps=[FINAL, EVAL_SET], group_name="evaluation", kinds={"pytorch"}, description=f"Held-out flow loss on {EVAL_SET}'s held-out rows, prompt following vs an untrained model, throughput.",
          code_version=asset_code_version(("training.evaluate",), ("train.eval", "train.sample", "metrics")))
def evaluation(kiln: KilnResource) -> dg.MaterializeResult:
    from training.evaluate import evaluate

    evaluate(kiln.path(FINAL), kiln.path(EVAL_SET), kiln.path("eval"), kiln.config())
    return dg.MaterializeResult(metadata=evaluation_page(kiln.path("eval")))


@dg.asset(deps=["rewritten"], group_name="captions", kinds={"duckdb"}, description="Concept coverage of the captions: per-concept counts, sampling weights that raise rare concepts, a plot.",
          code_version=asset_code_version(("assets.concepts",), ("data.concepts",)))
def coverage(kiln: KilnResource) -> dg.MaterializeResult:
    from assets.concepts import write_coverage

    out = kiln.path("coverage")
    report = write_coverage(kiln.path("rewritten"), out, kiln.config().data.concepts)
    md = {**flat_numbers(report), "path": dg.MetadataValue.path(str(out))}
    if (out / "coverage.png").exists():
        md["coverage_plot"] = dg.MetadataValue.md(markdown_image((out / "coverage.png").read_bytes(), "coverage"))
    return dg.MaterializeResult(metadata=md, data_version=dg.DataVersion(output_hash(out)))


@dg.asset(
    deps=["rewritten", "coverage"], group_name="captions", kinds={"duckdb", "parquet"}, code_version=asset_code_version(("assets.mixes",), ("data.mixes",)),
    description="Pretraining, midtraining and SFT mixes as DuckDB queries over the pool, proportions recorded.",
)
def mixes(kiln: KilnResource) -> dg.MaterializeResult:
    from assets.mixes import write_mixes

    out = kiln.path("mixes")
    meta = write_mixes(kiln.path("rewritten"), out, kiln.config().data.mixes, kiln.path("coverage") / "weights.parquet")
    return dg.MaterializeResult(metadata={"mixes": dg.MetadataValue.json(meta), "path": dg.MetadataValue.path(str(out))}, data_version=dg.DataVersion(output_hash(out)))


_main_steps = {s.key for s in data_steps() if s in MAIN_CHAIN or (s.rung and not s.rung.domain)}
MAIN_DATA_ASSETS = [raw_images, *(a for a in stage_assets if a.key.to_user_string() in _main_steps), coverage, mixes]
_domain_steps = {s.key for s in data_steps() if s.rung and s.rung.domain}
DOMAIN_DATA_ASSETS = [a for a in stage_assets if a.key.to_user_string() in _domain_steps]  # domain SFT train sets (post_training)
EVAL_ASSETS = [samples, evaluation]
BRANCH_ASSETS = [a for a in stage_assets if a.key.to_user_string() not in _main_steps | _domain_steps]


@dg.asset(
    deps=["manifest"], group_name="warehouse", kinds={"postgres", "duckdb"}, code_version=asset_code_version(("assets.filters", "kiln.warehouse.cli"), ("data.filters",)),
    description="The filter stage over the warehouse queue: Postgres when KILN_PG_DSN is set (workers as a Slurm array "
    "on a Slurm profile), else the embedded DuckDB path.",
)
def filtered_queue(context, kiln: KilnResource) -> dg.MaterializeResult:
    import os

    from kiln.warehouse.cli import run_map

    cfg = kiln.config()
    dsn = os.environ.get("KILN_PG_DSN")
    out = kiln.path("filtered_queue")
    on_slurm = dsn is not None and cfg.cluster.kind == "slurm"  # the cluster tier: a Slurm array of queue workers
    workers, slurm_workers = (0, cfg.cluster.max_array_parallel) if on_slurm else (cfg.cluster.workers, 0)
    summary = run_map("filter", kiln.path("manifest"), out, cfg, dsn, workers, None, log=context.log.info, slurm_workers=slurm_workers)  # a table keyed by input and config
    return dg.MaterializeResult(metadata={**stage_metadata(summary, out), "warehouse": "postgres" if dsn else "embedded (duckdb)"})


BRANCH_ASSETS.append(filtered_queue)
