"""One Dagster asset per artifact, each a thin wrapper around a stage function in assets/ or training/."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq

from dagster_project.metadata import cluster_grids, dedup_groups_grid, stage_metadata, thumbnails
from dagster_project.resources import KilnResource
from slurm.arrays import run_stage_array
from kiln.viz import markdown_image

@dataclass(frozen=True)
class StageAsset:
    """One `kiln stage` run as an asset: its key, stage, upstream asset and great-expectations suite."""

    key: str
    stage: str
    upstream: str
    group: str
    suite: str
    upstream_dir: str | None = None  # default: the upstream asset's own folder


MAIN_STAGES = [
    StageAsset("manifest", "ingest", "raw_images", "curation", "manifest", upstream_dir="raw/images"),
    StageAsset("filtered", "filter", "manifest", "curation", "filtered"),
    StageAsset("deduped", "dedup", "filtered", "curation", "deduped"),
    StageAsset("captioned", "caption", "deduped", "captions", "captioned"),
    StageAsset("train_set", "pack", "captioned", "training", "train_set"),
]
# The caption branch of issue 5: OCR-grounded captions and their rewrites (not in `kiln run`'s default job:
# OCR costs about a second per image on CPU).
CAPTION_BRANCH = [
    StageAsset("ocr", "ocr", "deduped", "captions_ocr", "ocred"),
    StageAsset("text_filtered", "text_filter", "ocr", "captions_ocr", "ocred"),
    StageAsset("captioned_ocr", "caption_ocr", "text_filtered", "captions_ocr", "ocr_captioned"),
    StageAsset("rewritten", "rewrite", "captioned_ocr", "captions_ocr", "rewritten"),
    StageAsset("prompt_pairs", "prompt_pairs", "rewritten", "captions_ocr", "prompt_pairs"),
]
# The model-based curation branch of issue 4 (embeddings, classifiers, SAE tags, clusters with human review,
# semantic dedup); its output has the deduped schema, so `caption` can read it.
CURATION_MODELS = [
    StageAsset("embedded", "embed", "deduped", "curation_models", "embedded"),
    StageAsset("classified", "classify", "embedded", "curation_models", "embedded"),
    StageAsset("saed", "sae", "classified", "curation_models", "embedded"),
    StageAsset("clustered", "cluster", "saed", "curation_models", "clustered"),
    StageAsset("semdeduped", "semdedup", "clustered", "curation_models", "deduped"),
]
DATA_STAGES = MAIN_STAGES + CAPTION_BRANCH + CURATION_MODELS


@dg.asset(group_name="curation", kinds={"python", "image"}, description="The raw image pool: the procedural demo corpus with its ground-truth sidecar.")
def raw_images(kiln: KilnResource) -> dg.MaterializeResult:
    from assets.demo_corpus import write_demo_corpus

    demo = kiln.config().data.demo
    out = kiln.path("raw")
    truth = write_demo_corpus(out, n=demo.n, seed=demo.seed, size=demo.size)
    cats = truth.group_by("category").aggregate([("file", "count")]).sort_by([("file_count", "descending")])
    md = {
        "files": truth.num_rows,
        "categories": dg.MetadataValue.table(
            records=[dg.TableRecord({"category": c, "files": n}) for c, n in zip(cats.column("category").to_pylist(), cats.column("file_count").to_pylist())],
            schema=dg.TableSchema(columns=[dg.TableColumn("category", "string"), dg.TableColumn("files", "int")]),
        ),
        "path": dg.MetadataValue.path(str(out)),
    }
    grid = thumbnails([str(out / "images" / f) for f in truth.column("file").to_pylist()[:24]])
    if grid:
        md["sample"] = dg.MetadataValue.md(grid)
    return dg.MaterializeResult(metadata=md)


def run_data_stage(stage: str, source: Path, out: Path, cfg, log: Callable[[str], None] | None = None) -> dg.MaterializeResult:
    """One data stage into `out`, with its metadata: in-process on the local profile, one Slurm array task
    per shard on a Slurm profile."""
    summary = run_stage_array(stage, source, out, cfg, log=log)
    md = stage_metadata(summary, out)
    extra: Callable[[Path], str | None] | None = {"dedup": dedup_groups_grid, "cluster": cluster_grids}.get(stage)
    if extra and (grid := extra(out)):
        md[f"{stage}_groups"] = dg.MetadataValue.md(grid)
    return dg.MaterializeResult(metadata=md)


def _stage_asset(sa: StageAsset) -> dg.AssetsDefinition:
    key, stage, upstream = sa.key, sa.stage, sa.upstream

    @dg.asset(name=key, deps=[upstream], group_name=sa.group, kinds={"python", "parquet"}, description=f"`kiln stage {stage}` over {upstream}: kept rows + rejected rows with reasons.")
    def _asset(context, kiln: KilnResource) -> dg.MaterializeResult:
        return run_data_stage(stage, kiln.path(sa.upstream_dir or upstream), kiln.path(key), kiln.config(), log=context.log.info)

    return _asset


stage_assets = [_stage_asset(sa) for sa in DATA_STAGES]


@dg.asset(deps=["train_set"], group_name="training", kinds={"pytorch", "safetensors"}, description="The pretrained DiT: safetensors weights + config, with its loss curve.")
def checkpoint(context, kiln: KilnResource) -> dg.MaterializeResult:
    return train_checkpoint(context, kiln.path("train_set"), kiln.path("checkpoint"), kiln.config())


def train_checkpoint(context, data: Path, out: Path, cfg) -> dg.MaterializeResult:
    """The trainer into `out` (a Slurm job on a Slurm profile), with the checkpoint's metadata."""
    md: dict = {"path": dg.MetadataValue.path(str(out))}
    if cfg.cluster.kind == "slurm":
        md.update(_train_on_slurm(context, data, out, cfg))
    else:
        from training.trainer import train

        train(data, out, cfg)
    md.update(_scalars(json.loads((out / "train_state.json").read_text())))
    throughput = out / "throughput.json"  # samples/s, tokens/s, TFLOP/s per device, MFU (on known GPUs), spike counts
    if throughput.exists():
        md.update(_scalars(json.loads(throughput.read_text()), "throughput."))
    loss_png = out / "loss.png"
    if loss_png.exists():
        md["loss_curve"] = dg.MetadataValue.md(markdown_image(loss_png.read_bytes(), "loss"))
    return dg.MaterializeResult(metadata=md)


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


@dg.asset(deps=["checkpoint"], group_name="evaluation", kinds={"pytorch", "image"}, description="A grid of samples per demo prompt from the checkpoint.")
def samples(kiln: KilnResource) -> dg.MaterializeResult:
    from training.sampling import sample_to_dir

    grid = sample_to_dir(kiln.path("checkpoint"), kiln.path("samples"), kiln.config())
    n = pq.read_metadata(kiln.path("samples") / "samples.parquet").num_rows if (kiln.path("samples") / "samples.parquet").exists() else 0
    return dg.MaterializeResult(metadata={"grid": dg.MetadataValue.md(markdown_image(Path(grid).read_bytes(), "samples")), "images": n, "path": dg.MetadataValue.path(str(grid))})


@dg.asset(deps=["checkpoint", "train_set"], group_name="evaluation", kinds={"pytorch"}, description="First evaluation: held-out flow loss, prompt following vs an untrained model, throughput.")
def evaluation(kiln: KilnResource) -> dg.MaterializeResult:
    from training.evaluate import evaluate

    metrics = evaluate(kiln.path("checkpoint"), kiln.path("train_set"), kiln.path("eval"), kiln.config())
    return dg.MaterializeResult(metadata={**_scalars(metrics), "path": dg.MetadataValue.path(str(kiln.path("eval")))})


def _scalars(d: dict, prefix: str = "") -> dict:
    """Flatten nested numbers into Dagster metadata (plottable across materializations)."""
    out: dict = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, bool) or not isinstance(v, (int, float, dict)):
            continue
        if isinstance(v, dict):
            out.update(_scalars(v, f"{name}."))
        else:
            out[name] = v
    return out


@dg.asset(deps=["rewritten"], group_name="captions_ocr", kinds={"duckdb"}, description="Concept coverage of the captions: per-concept counts, sampling weights that raise rare concepts, a plot.")
def coverage(kiln: KilnResource) -> dg.MaterializeResult:
    from assets.concepts import write_coverage

    out = kiln.path("coverage")
    report = write_coverage(kiln.path("rewritten"), out, kiln.config().data.concepts)
    md = {**_scalars(report), "path": dg.MetadataValue.path(str(out))}
    if (out / "coverage.png").exists():
        md["coverage_plot"] = dg.MetadataValue.md(markdown_image((out / "coverage.png").read_bytes(), "coverage"))
    return dg.MaterializeResult(metadata=md)


@dg.asset(deps=["rewritten", "coverage"], group_name="captions_ocr", kinds={"duckdb", "parquet"}, description="Pretraining, midtraining and SFT mixes as DuckDB queries over the pool, proportions recorded.")
def mixes(kiln: KilnResource) -> dg.MaterializeResult:
    from assets.mixes import write_mixes

    out = kiln.path("mixes")
    meta = write_mixes(kiln.path("rewritten"), out, kiln.config().data.mixes, kiln.path("coverage") / "weights.parquet")
    return dg.MaterializeResult(metadata={"mixes": dg.MetadataValue.json(meta), "path": dg.MetadataValue.path(str(out))})


MAIN_ASSETS = [raw_images, *stage_assets[: len(MAIN_STAGES)], checkpoint, samples, evaluation]
all_assets = [*MAIN_ASSETS, *stage_assets[len(MAIN_STAGES) :], coverage, mixes]


@dg.asset(deps=["manifest"], group_name="warehouse", kinds={"postgres", "duckdb"}, description="The filter stage over the warehouse queue: Postgres when KILN_PG_DSN is set (workers as a Slurm array on a Slurm profile), else the embedded DuckDB path.")
def filtered_queue(context, kiln: KilnResource) -> dg.MaterializeResult:
    import os

    from kiln.warehouse.cli import run_map

    cfg = kiln.config()
    dsn = os.environ.get("KILN_PG_DSN")
    out = kiln.path("filtered_queue")
    on_slurm = dsn is not None and cfg.cluster.kind == "slurm"  # the cluster tier: a Slurm array of queue workers
    workers, slurm_workers = (0, cfg.cluster.max_array_parallel) if on_slurm else (cfg.cluster.workers, 0)
    summary = run_map("filter", kiln.path("manifest"), out, cfg, dsn, workers, "manifest", log=context.log.info, slurm_workers=slurm_workers)
    return dg.MaterializeResult(metadata={**stage_metadata(summary, out), "warehouse": "postgres" if dsn else "embedded (duckdb)"})


all_assets.append(filtered_queue)
