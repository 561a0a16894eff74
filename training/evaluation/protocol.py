"""The evaluation protocol of a checkpoint: what is generated, what it is compared with, and the record.

prompts     a fixed prompt set (the demo prompts, or `metrics.prompts_file`), hashed into the results
reference   a fixed real image set per dataset version: the main bucket's rows with the smallest
            sha1(id) (the trainer's held-out rows come first), and the version is the sha256 of the
            pack output's Parquet files, which kiln.stage.write_table makes byte-deterministic
generation  batched, fixed seed (`metrics.seed`), steps and CFG scale recorded with the results
metrics     FID / CMMD / DINO-MMD for each extractor configured; an unconfigured one is reported as
            skipped, never as a number
history     one row per checkpoint step (quality next to training throughput), upserted into a CSV
            kept across checkpoints and plotted
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from kiln.config import KilnConfig, MetricsConfig
from training.core.data import dataset_version, decode_pixels, holdout_ids, read_train_rows, train_index
from training.evaluation.extractors import FeatureExtractor, load_extractor
from training.evaluation.metrics import cmmd, dino_mmd, fid

METRIC_OF = {
    "fid": ("backbone", "fid_extractor"),
    "cmmd": ("clip", "clip_extractor"),
    "dino_mmd": ("dino", "dino_extractor"),
}
HISTORY_COLUMNS = (
    "step",
    "heldout_loss",
    "prompt_following",
    "color",
    "shape",
    "count",
    "position",
    "background",
    "fid",
    "cmmd",
    "dino_mmd",
    "baseline_prompt_following",
)  # quality only: wall-clock throughput stays in each checkpoint's throughput.json, so the history is reproducible


@dataclass(frozen=True)
class Setup:
    """Everything that fixes the numbers: two evaluations with equal setups are comparable."""

    prompts: int
    prompts_sha256: str
    n_per_prompt: int
    steps: int
    cfg_scale: float
    seed: int
    height: int
    width: int
    dataset_version: str
    reference_images: int
    extractors: dict[str, str]  # metric -> model type (or "skipped: ...")


def prompt_set(metrics_cfg: MetricsConfig) -> list[str]:
    from training.evaluation.sampling import read_prompts

    return read_prompts(metrics_cfg.prompts_file)


def digest(texts: list[str]) -> str:
    return hashlib.sha256("\n".join(texts).encode()).hexdigest()


def reference_ids(data_dir: Path | str, n: int, height: int, width: int) -> set[str]:
    """Up to `n` rows of the (height x width) bucket, smallest sha1(id) first (streamed over the shards' indexes)."""
    bucket = f"{height}x{width}"
    in_bucket = (
        i
        for _, index in train_index(data_dir, ("id", "bucket"))
        for i, b in zip(index["id"], index["bucket"])
        if b == bucket
    )
    return holdout_ids(in_bucket, n)


def reference_rows(data_dir: Path | str, n: int, height: int, width: int) -> pa.Table:
    """The rows of `reference_ids`, their images decoded, sorted by sha1(id)."""
    rows = read_train_rows(data_dir, reference_ids(data_dir, n, height, width))
    if rows.num_rows == 0:
        return rows
    rank = [hashlib.sha1(i.encode()).hexdigest() for i in rows.column("id").to_pylist()]
    return rows.take(np.argsort(rank, kind="stable"))


def reference_images(data_dir: Path, n: int, height: int, width: int) -> np.ndarray:
    rows = reference_rows(data_dir, n, height, width)
    if rows.num_rows < 2:
        raise ValueError(f"{data_dir}: fewer than 2 rows in bucket {height}x{width}; no reference set")
    return decode_pixels(rows)


def load_extractors(metrics_cfg: MetricsConfig, device: str = "cpu") -> dict[str, FeatureExtractor]:
    """metric name -> extractor, for the configured paths only."""
    out = {}
    for metric, (kind, field) in METRIC_OF.items():
        path = getattr(metrics_cfg, field)
        if path is not None:
            out[metric] = load_extractor(kind, path, device)  # type: ignore[arg-type]
    return out


def describe_extractors(extractors: dict[str, FeatureExtractor]) -> dict[str, str]:
    return {
        m: (extractors[m].model_type if m in extractors else f"skipped: metrics.{METRIC_OF[m][1]} is not set")
        for m in METRIC_OF
    }


def distribution_metrics(
    generated: np.ndarray, reference: np.ndarray, extractors: dict[str, FeatureExtractor], batch_size: int = 32
) -> dict[str, float | None]:
    """FID / CMMD / DINO-MMD of uint8 [N, H, W, 3] generated vs reference images; None where skipped."""
    fns = {"fid": fid, "cmmd": cmmd, "dino_mmd": dino_mmd}
    out: dict[str, float | None] = {}
    for metric in METRIC_OF:
        if metric not in extractors:
            out[metric] = None
            continue
        ex = extractors[metric]
        out[metric] = round(fns[metric](ex(generated, batch_size), ex(reference, batch_size)), 6)
    return out


def generate_set(gen, prompts: list[str], cfg: KilnConfig, height: int, width: int) -> np.ndarray:
    """uint8 [P, N, H, W, 3]: the protocol's fixed-seed batch."""
    from training.evaluation.sampling import generate, sampling_shift

    m = cfg.metrics
    return generate(
        gen,
        prompts,
        m.n_per_prompt,
        height,
        width,
        cfg.train.eval.steps,
        cfg.train.sample.cfg_scale,
        m.seed,
        sampling_shift(gen, height, width, cfg.train),
    )


def setup_for(
    cfg: KilnConfig,
    prompts: list[str],
    version: str,
    n_reference: int,
    height: int,
    width: int,
    extractors: dict[str, FeatureExtractor],
) -> Setup:
    m = cfg.metrics
    return Setup(
        len(prompts),
        digest(prompts),
        m.n_per_prompt,
        cfg.train.eval.steps,
        cfg.train.sample.cfg_scale,
        m.seed,
        height,
        width,
        version,
        n_reference,
        describe_extractors(extractors),
    )


def evaluate_distribution(
    gens: dict[str, object], cfg: KilnConfig, data_dir: Path, height: int, width: int, device: str = "cpu"
) -> tuple[dict[str, dict], dict]:
    """Distribution metrics of each named generator (e.g. trained, untrained) under one protocol.

    Returns ({name: {fid, cmmd, dino_mmd}}, setup as a dict). Without any extractor configured
    nothing is generated: every metric is None and the setup says which path to set.
    """
    import torch

    prompts = prompt_set(cfg.metrics)
    extractors = load_extractors(cfg.metrics, device)
    version = dataset_version(Path(data_dir))
    if not extractors:
        return {name: {m: None for m in METRIC_OF} for name in gens}, asdict(
            setup_for(cfg, prompts, version, 0, height, width, extractors)
        )
    reference = reference_images(Path(data_dir), cfg.metrics.reference_images, height, width)
    setup = setup_for(cfg, prompts, version, reference.shape[0], height, width, extractors)
    scores = {}
    for name, gen in gens.items():
        with torch.no_grad():
            images = generate_set(gen, prompts, cfg, height, width)
        scores[name] = distribution_metrics(
            images.reshape(-1, height, width, 3), reference, extractors, cfg.metrics.batch_size
        )
    return scores, asdict(setup)


# --------------------------------------------------------------------------------------------- history
def history_row(metrics: dict) -> dict[str, float | int | None]:
    """The flat record of one evaluation (training.evaluation.evaluate's metrics.json) for the history CSV."""
    pf = metrics.get("prompt_following", {})
    dist = metrics.get("distribution", {})
    row = {
        "step": metrics["checkpoint"]["step"],
        "heldout_loss": metrics.get("heldout_loss", {}).get("mean"),
        "prompt_following": pf.get("all"),
        **{a: pf.get(a) for a in ("color", "shape", "count", "position", "background")},
        **{m: dist.get(m) for m in METRIC_OF},
        "baseline_prompt_following": metrics.get("baseline", {}).get("prompt_following", {}).get("all"),
    }
    return {k: row[k] for k in HISTORY_COLUMNS}


def _parse(v: str) -> float | int | None:
    if v == "":
        return None
    f = float(v)
    return int(f) if f.is_integer() and "." not in v and "e" not in v.lower() else f


def read_history(path: Path) -> list[dict]:
    if not Path(path).exists():
        return []
    with Path(path).open(newline="") as fh:
        return [{k: _parse(row.get(k, "")) for k in HISTORY_COLUMNS} for row in csv.DictReader(fh)]


def upsert(history: list[dict], row: dict) -> list[dict]:
    """One row per step (a re-evaluated step replaces its row), sorted by step."""
    kept = [r for r in history if r["step"] != row["step"]]
    return sorted([*kept, row], key=lambda r: r["step"])


def history_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(HISTORY_COLUMNS), lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else r[k]) for k in HISTORY_COLUMNS})
    return buf.getvalue()


def plot_history(rows: list[dict], path: Path | None):
    """The evaluation against the checkpoint step, one panel per quantity (held-out loss, prompt following
    beside the untrained baseline and per attribute, each distribution metric computed), each on its own scale."""
    from kiln.viz import panel_plot

    def col(k: str) -> list:
        return [r.get(k) for r in rows]

    panels = {
        "held-out loss": {"heldout_loss": col("heldout_loss")},
        "prompt following": {
            k: col(k)
            for k in (
                "prompt_following",
                "baseline_prompt_following",
                "color",
                "shape",
                "count",
                "position",
                "background",
            )
            if any(v is not None for v in col(k))
        },
    }
    panels |= {m: {m: col(m)} for m in METRIC_OF if any(v is not None for v in col(m))}
    return panel_plot(
        {name: series for name, series in panels.items() if series},
        x=col("step"),
        title="evaluation across checkpoints",
        path=path,
    )


def headline(metrics: dict) -> dict:
    """The few numbers to read first (out/headline.json, what `dvc metrics show` prints): a subset of
    metrics.json under the same keys, so `heldout_loss.mean` means the same in both files."""
    base = metrics.get("baseline") or {}
    out = {
        "checkpoint": {"step": metrics["checkpoint"]["step"], "final_loss": metrics["checkpoint"].get("final_loss")},
        "heldout_loss": {"mean": (metrics.get("heldout_loss") or {}).get("mean")},
        "prompt_following": dict(metrics.get("prompt_following") or {}),
        "baseline": {
            "heldout_loss": {"mean": (base.get("heldout_loss") or {}).get("mean")},
            "prompt_following": {"all": (base.get("prompt_following") or {}).get("all")},
        },
    }
    if computed := {m: v for m, v in (metrics.get("distribution") or {}).items() if isinstance(v, (int, float))}:
        out["distribution"] = computed  # a skipped metric is left out here; metrics.json says why
    return out


def plot_prompt_following(metrics: dict, path: Path | None):
    """Prompt-following accuracy per attribute, the checkpoint beside its untrained baseline."""
    from kiln.viz import bar_chart

    pf = metrics.get("prompt_following") or {}
    groups = {"checkpoint": dict(pf)}
    if base := (metrics.get("baseline") or {}).get("prompt_following"):
        groups["untrained"] = {a: base.get(a) for a in pf}
    im = bar_chart(groups, title="prompt following per attribute", ylabel="accuracy", ylim=(0, 1.05))
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        im.save(path, format="PNG")
    return im


def record(metrics: dict, out: Path, cfg: KilnConfig) -> list[dict]:
    """Upsert this evaluation into the kept history (metrics.history) and write its copy
    out/history.csv, the pictures (history.png, prompt_following.png) and out/headline.json; return the rows."""
    out = Path(out)
    kept = Path(cfg.metrics.history) if cfg.metrics.history else None
    rows = upsert(read_history(kept if kept else out / "history.csv"), history_row(metrics))
    text = history_csv(rows)
    for path in ([kept] if kept else []) + [out / "history.csv"]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    plot_history(rows, out / "history.png")
    plot_prompt_following(metrics, out / "prompt_following.png")
    (out / "headline.json").write_text(json.dumps(headline(metrics), indent=2, sort_keys=True) + "\n")
    return rows
