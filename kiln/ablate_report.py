"""The comparison an ablation ends in: per variant, each metric's mean over seeds, its spread across seeds
(std, min, max) and its delta to the baseline's mean; as Markdown, Parquet and a PNG (matplotlib, offline).

The per-run records are written too (runs.parquet), so a reader can recompute any summary."""

from __future__ import annotations

import math
from pathlib import Path


def summarize(records: list[dict], metrics: list[str], baseline: str) -> list[dict]:
    """One row per variant, in first-seen order: n_seeds, overrides, and <metric>_{mean,std,min,max,delta}."""
    variants = list(dict.fromkeys(r["variant"] for r in records))
    rows = []
    for v in variants:
        runs = [r for r in records if r["variant"] == v]
        row = {"variant": v, "baseline": v == baseline, "n_seeds": len(runs), "overrides": runs[0]["overrides"]}
        for m in metrics:
            vals = [r[m] for r in runs if r.get(m) is not None and math.isfinite(r[m])]
            mean = sum(vals) / len(vals) if vals else None
            std = (
                math.sqrt(sum((x - mean) ** 2 for x in vals) / (len(vals) - 1))
                if len(vals) > 1
                else 0.0
                if vals
                else None
            )
            row |= {
                f"{m}_mean": mean,
                f"{m}_std": std,
                f"{m}_min": min(vals, default=None),
                f"{m}_max": max(vals, default=None),
            }
        rows.append(row)
    base = next(r for r in rows if r["variant"] == baseline)
    for row in rows:
        for m in metrics:
            a, b = row[f"{m}_mean"], base[f"{m}_mean"]
            row[f"{m}_delta"] = None if a is None or b is None else a - b
    return rows


def _num(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "–"
    return f"{x:+.4g}" if signed else f"{x:.4g}"


def markdown(rows: list[dict], metrics: list[str], title: str, description: str = "") -> str:
    """Each cell: mean ± std [min, max] (Δ to baseline); the baseline's row is marked."""
    lines = [f"# Ablation: {title}", ""]
    if description:
        lines += [description.strip(), ""]
    n = max((r["n_seeds"] for r in rows), default=0)
    lines += [f"Mean over {n} seed(s) ± sample std [min, max] across seeds; (Δ) to the baseline's mean.", ""]
    lines.append("| variant | seeds | " + " | ".join(metrics) + " |")
    lines.append("|---|---|" + "---|" * len(metrics))
    for r in rows:
        cells = []
        for m in metrics:
            cell = f"{_num(r[f'{m}_mean'])} ± {_num(r[f'{m}_std'])} [{_num(r[f'{m}_min'])}, {_num(r[f'{m}_max'])}]"
            if not r["baseline"]:
                cell += f" ({_num(r[f'{m}_delta'], signed=True)})"
            cells.append(cell)
        name = f"**{r['variant']}** (baseline)" if r["baseline"] else r["variant"]
        lines.append(f"| {name} | {r['n_seeds']} | " + " | ".join(cells) + " |")
    lines += ["", "Overrides:", ""] + [f"- `{r['variant']}`: `{r['overrides']}`" for r in rows]
    return "\n".join(lines) + "\n"


def plot(records: list[dict], rows: list[dict], metrics: list[str], path: Path, title: str) -> Path:
    """One panel per metric: the mean per variant as a bar, min-max as an error bar, each seed as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(len(metrics), 3)
    nrows = math.ceil(len(metrics) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    names = [r["variant"] for r in rows]
    for ax, m in zip(axes.flat, metrics, strict=False):
        means = [r[f"{m}_mean"] if r[f"{m}_mean"] is not None else math.nan for r in rows]
        lo = [mu - (r[f"{m}_min"] if r[f"{m}_min"] is not None else mu) for mu, r in zip(means, rows, strict=True)]
        hi = [(r[f"{m}_max"] if r[f"{m}_max"] is not None else mu) - mu for mu, r in zip(means, rows, strict=True)]
        colors = ["#555555" if r["baseline"] else "#3b7dd8" for r in rows]
        ax.bar(range(len(rows)), means, yerr=[lo, hi], color=colors, capsize=4, alpha=0.8)
        for i, v in enumerate(names):
            ys = [rec[m] for rec in records if rec["variant"] == v and rec.get(m) is not None]
            ax.scatter([i] * len(ys), ys, color="black", s=10, zorder=3)
        ax.set_xticks(range(len(rows)), names, rotation=20, ha="right", fontsize=8)
        ax.set_title(m, fontsize=9)
    for ax in list(axes.flat)[len(metrics) :]:
        ax.axis("off")
    fig.suptitle(f"{title} (grey: baseline; bar: mean, whisker: min-max, dots: seeds)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(
    records: list[dict], metrics: list[str], baseline: str, out: Path, title: str, description: str = ""
) -> dict[str, Path]:
    """comparison.md, comparison.parquet, runs.parquet and comparison.png under out."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    rows = summarize(records, metrics, baseline)
    paths = {
        "markdown": out / "comparison.md",
        "table": out / "comparison.parquet",
        "runs": out / "runs.parquet",
        "plot": out / "comparison.png",
    }
    paths["markdown"].write_text(markdown(rows, metrics, title, description))
    pq.write_table(pa.Table.from_pylist(rows), paths["table"])
    pq.write_table(pa.Table.from_pylist(records), paths["runs"])
    plot(records, rows, metrics, paths["plot"], title)
    return paths
