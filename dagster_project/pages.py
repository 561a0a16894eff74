"""Asset pages that lead with the answer. Dagster lists metadata in insertion order and shows a markdown value
inline only under 1,000 characters (larger ones, every PNG among them, sit behind "[Show Markdown]"), so:

* a checkpoint's page (`checkpoint_page`, shared by every checkpoint asset) opens with its key figures:
  final loss, the loss curve (an inline SVG sparkline, visible without a click), samples, tokens/s, MFU and
  the train-set version; then the other numbers; the whole config as ONE JSON entry; the path last.
* the evaluation's page (`evaluation_page`) opens with a table of each metric against the untrained
  baseline, each skipped metric with the reason metrics.json records, the per-attribute prompt-following
  bar chart and the history across checkpoints.

Nothing here writes into an asset's folder: those folders are DVC outputs too, and an extra file would
make `dvc status` report them changed. Pictures are drawn in memory, or read from the PNGs the run wrote.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import dagster as dg

from kiln.progress import log
from kiln.viz import markdown_image, svg_sparkline
from training.core.plots import ema

KEY_FIGURES = ("final_loss", "loss_curve", "samples", "tokens_per_s", "mfu", "train_set_version")
ATTRIBUTES = ("color", "shape", "count", "position", "background")
DISTRIBUTION = ("fid", "cmmd", "dino_mmd")


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def flat_numbers(d: dict, prefix: str = "") -> dict:
    """Nested numbers as dotted keys (Dagster plots a number across materializations); the rest is dropped."""
    out: dict = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat_numbers(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = v
    return out


def sparkline_md(values: list[float], what: str) -> dg.MarkdownMetadataValue:
    """An inline curve with its last and best values, under Dagster's 1,000-character inline limit."""
    vals = [v for v in values if v == v]
    if not vals:
        return dg.MetadataValue.md(f"no {what} recorded")
    return dg.MetadataValue.md(
        f"![{what}]({svg_sparkline(vals)})\n\n{len(vals)} steps; last {vals[-1]:.4g}, min {min(vals):.4g}"
    )


def loss_values(out: Path) -> list[float]:
    """The per-step training loss the trainer logged (loss.csv)."""
    path = out / "loss.csv"
    if not path.exists():
        return []
    with path.open(newline="") as fh:
        return [float(r["loss"]) for r in csv.DictReader(fh) if r.get("loss") not in (None, "")]


def history_values(path: Path, key: str) -> list[float]:
    """One column of a post-training history (dpo_history.jsonl, ...), for its curve."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]


def checkpoint_page(
    out: Path,
    headline: dict | None = None,
    samples: str | None = None,
    curve: tuple[Path, str] | None = None,
    details: dict | None = None,
    trained_here: bool | None = None,
) -> dict:
    """The metadata of any checkpoint folder, key figures first.

    headline: what this asset is about, before everything (a post-training gain, a merge's scores).
    samples: a markdown sample grid (checkpoint_samples, or a post-training comparison's "after" grid).
    curve: (history.jsonl, key) for a post-training run, whose folder carries its base's train state:
      then its own curve stands in for the loss curve, and the base's loss and throughput are left out.
    details: asset-specific numbers, after the key figures.
    trained_here: whether the folder's loss and throughput are its own run's (default: when there is no
      `curve`); False for a merge, which trained nothing."""
    out = Path(out)
    state, throughput, seen = (
        _json(out / "train_state.json"),
        _json(out / "throughput.json"),
        _json(out / "train_data.json"),
    )
    own_run = curve is None if trained_here is None else trained_here
    md: dict = dict(headline or {})
    if own_run:
        if state.get("final_loss") is not None:
            md["final_loss"] = float(state["final_loss"])
        md["loss_curve"] = sparkline_md(ema(loss_values(out)), "training loss (EMA)")
    elif curve:
        md[f"{curve[1]}_curve"] = sparkline_md(history_values(*curve), curve[1])
    md["samples"] = (
        dg.MetadataValue.md(samples) if samples else dg.MetadataValue.text("not drawn here: see the `samples` asset")
    )
    if own_run and throughput:
        md["tokens_per_s"] = throughput.get("tokens_per_s")
        mfu = throughput.get("mfu")
        md["mfu"] = (
            mfu
            if mfu is not None
            else dg.MetadataValue.text(
                "unknown: no peak FLOP/s known for this device (a CPU, or a GPU kiln has no figure for)"
            )
        )
    if seen.get("train_set_version"):
        md["train_set_version"] = str(seen["train_set_version"])
    md |= details or {}
    if own_run and (out / "loss.png").exists():
        md["loss_plot"] = dg.MetadataValue.md(markdown_image((out / "loss.png").read_bytes(), "training loss"))
    md |= {
        k: v
        for k, v in flat_numbers({k: v for k, v in state.items() if k not in ("config", "final_loss")}).items()
        if k not in md
    }
    if own_run:
        md |= {f"throughput.{k}": v for k, v in flat_numbers(throughput).items() if k not in ("tokens_per_s", "mfu")}
    if seen:
        md["mix"] = str(seen.get("mix"))
        md["caption_forms_drawn"] = dg.MetadataValue.json(seen.get("caption_forms_drawn", {}))
    if "config" in state:
        md["config"] = dg.MetadataValue.json(state["config"])
    md["path"] = dg.MetadataValue.path(str(out))
    return {k: v for k, v in md.items() if v is not None}


def checkpoint_samples(out: Path, cfg, prompts: int = 4, per_prompt: int = 2) -> str | None:
    """A small labelled sample grid of a checkpoint (the first `prompts` sample prompts, `per_prompt` each, the
    train.sample sampler), drawn in memory in this process; None on a Slurm profile, where the GPU is the job's."""
    if cfg.cluster.kind == "slurm":
        return None
    import torch

    from model.generator import Generator
    from training.core.plots import sample_grid
    from training.evaluation.sampling import (
        checkpoint_resolution,
        generate,
        read_prompts,
        read_sampler_settings,
        sampling_shift,
    )

    sc = cfg.train.sample
    texts = read_prompts(None)[:prompts]
    try:
        gen = Generator.from_pretrained(Path(out)).eval()
        height, width = checkpoint_resolution(Path(out), cfg)
        own = read_sampler_settings(Path(out))
        steps, scale = (own.steps, own.cfg_scale) if own else (sc.steps, sc.cfg_scale)
        shift = own.shift if own and own.shift is not None else sampling_shift(gen, height, width, cfg.train)
        with torch.no_grad():
            images = generate(gen, texts, per_prompt, height, width, steps, scale, sc.seed, shift)
    except Exception as e:  # noqa: BLE001 - a page's picture must not fail the checkpoint it describes
        log.warning("checkpoint page: no samples for %s: %s", out, e)
        return f"not drawn: {type(e).__name__}: {e}"
    return markdown_image(sample_grid(images, texts), "samples")


# ------------------------------------------------------------------------------------------- evaluation
def _fmt(v) -> str:
    return "–" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def skipped_metrics(metrics: dict) -> dict[str, str]:
    """Each distribution metric without a value, with the reason metrics.json records for it."""
    reasons = (metrics.get("distribution_setup") or {}).get("extractors") or {}
    values = metrics.get("distribution") or {}
    return {m: str(reasons.get(m) or "skipped: no value recorded") for m in DISTRIBUTION if values.get(m) is None}


def baseline_table(metrics: dict) -> str:
    """Markdown: each metric for this checkpoint, the untrained baseline and the change (short enough to show inline)."""
    base = metrics.get("baseline")
    pf, bpf = metrics.get("prompt_following") or {}, (base or {}).get("prompt_following") or {}
    rows = [
        (
            "held-out loss ↓",
            (metrics.get("heldout_loss") or {}).get("mean"),
            ((base or {}).get("heldout_loss") or {}).get("mean"),
        )
    ]
    rows += [(f"following: {a}", pf.get(a), bpf.get(a)) for a in ("all", *ATTRIBUTES) if a in pf]
    skipped = skipped_metrics(metrics)
    rows += [
        (m, (metrics.get("distribution") or {}).get(m), ((base or {}).get("distribution") or {}).get(m))
        for m in DISTRIBUTION
        if m not in skipped
    ]
    head = (
        "| metric | checkpoint | untrained | change |\n|---|--:|--:|--:|\n"
        if base
        else "| metric | checkpoint |\n|---|--:|\n"
    )
    body = "".join(
        f"| {name} | {_fmt(v)} | {_fmt(b)} | {_fmt(v - b) if isinstance(v, (int, float)) and isinstance(b, (int, float)) else '–'} |\n"
        if base
        else f"| {name} | {_fmt(v)} |\n"
        for name, v, b in rows
    )
    note = "" if base else "\nno untrained baseline recorded in metrics.json\n"
    return head + body + note + ("\n" if skipped else "") + "".join(f"- {m}: {r}\n" for m, r in skipped.items())


def prompt_following_chart(metrics: dict) -> bytes | None:
    """PNG: prompt-following accuracy per attribute, the checkpoint beside the untrained baseline."""
    from kiln.viz import bar_chart, png_bytes

    pf = metrics.get("prompt_following") or {}
    if not pf:
        return None
    groups = {"checkpoint": {a: pf[a] for a in ("all", *ATTRIBUTES) if a in pf}}
    base = ((metrics.get("baseline") or {}).get("prompt_following")) or {}
    if base:
        groups["untrained"] = {a: base.get(a) for a in groups["checkpoint"]}
    return png_bytes(bar_chart(groups, title="prompt following per attribute", ylabel="accuracy", ylim=(0, 1.05)))


def history_chart(eval_dir: Path) -> bytes | None:
    """PNG: the evaluation across checkpoints (history.png as the evaluation wrote it, else drawn from history.csv)."""
    if (eval_dir / "history.png").exists():
        return (eval_dir / "history.png").read_bytes()
    if not (eval_dir / "history.csv").exists():
        return None
    from kiln.viz import png_bytes
    from training.evaluation.protocol import plot_history, read_history

    rows = read_history(eval_dir / "history.csv")
    return png_bytes(plot_history(rows, None)) if rows else None


def evaluation_page(eval_dir: Path) -> dict:
    """The evaluation's metadata: the table against the untrained baseline, skipped metrics with their reasons,
    the per-attribute chart, the history plot, then every number (for Dagster's plots) and the setups."""
    eval_dir = Path(eval_dir)
    metrics = json.loads((eval_dir / "metrics.json").read_text())
    md: dict = {"vs_untrained_baseline": dg.MetadataValue.md(baseline_table(metrics))}
    if metrics.get("baseline") is None:
        md["baseline"] = dg.MetadataValue.text("no untrained baseline recorded in metrics.json")
    for m, reason in skipped_metrics(metrics).items():
        md[m] = dg.MetadataValue.text(reason)
    if chart := prompt_following_chart(metrics):
        md["prompt_following_chart"] = dg.MetadataValue.md(markdown_image(chart, "prompt following per attribute"))
    if history := history_chart(eval_dir):
        md["history_chart"] = dg.MetadataValue.md(markdown_image(history, "evaluation across checkpoints"))
    if (eval_dir / "eval_samples.png").exists():
        md["eval_samples"] = dg.MetadataValue.md(
            markdown_image((eval_dir / "eval_samples.png").read_bytes(), "evaluation samples")
        )
    numbers = {
        k: metrics[k]
        for k in ("heldout_loss", "prompt_following", "distribution", "baseline", "throughput")
        if metrics.get(k)
    }
    md |= flat_numbers(numbers)
    for k in ("checkpoint", "heldout", "distribution_setup", "prompt_following_setup"):
        if metrics.get(k):
            md[k] = dg.MetadataValue.json(metrics[k])
    md["path"] = dg.MetadataValue.path(str(eval_dir))
    return md
