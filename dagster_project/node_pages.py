"""Each node's Dagster page, by the `page` its registry row names (kiln.registry.Node.page): what the asset's
materialization shows first. A page reads what the node's command wrote and returned; the post-training pages
also score the checkpoint before and after under the evaluation protocol, with sample grids, which only the
UI shows (nothing here writes into a node's folder: it is a DVC output too).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq

from dagster_project.metadata import cluster_grids, dedup_groups_grid, stage_metadata, thumbnails
from dagster_project.pages import checkpoint_page, checkpoint_samples, evaluation_page, flat_numbers
from kiln.registry import Node
from kiln.viz import markdown_image


@dataclass(frozen=True)
class NodeRun:
    """A finished node: what its page is drawn from."""

    node: Node
    cfg: object  # the KilnConfig it ran with
    result: object  # what its command returned
    out: Path
    inputs: dict[str, Path | list[Path]]  # its command's arguments, as paths under the data root
    eval_set: Path  # the first rung's train set: the held-out rows post-training pages score on


def stage_page(run: NodeRun) -> dict:
    md = stage_metadata(run.result, run.out)
    extra: Callable[[Path], str | None] | None = {"dedup": dedup_groups_grid, "cluster": cluster_grids}.get(
        run.node.positional[0]
    )
    if extra and (grid := extra(run.out)):
        md[f"{run.node.positional[0]}_groups"] = dg.MetadataValue.md(grid)
    return md


def source_page(run: NodeRun) -> dict:
    report = run.result
    md = {
        "objects": report["objects"],
        "listed_bytes": report["listed_bytes"],
        "with_source_caption": report["with_source_caption"],
        "source": dg.MetadataValue.json({"source": report["source"]}),
        "path": dg.MetadataValue.path(str(run.out)),
    }
    uris = pq.read_table(run.out / "listing.parquet", columns=["uri"]).column("uri").to_pylist()
    if grid := thumbnails(uris[:24]):
        md["sample"] = dg.MetadataValue.md(grid)
    return md


def coverage_page(run: NodeRun) -> dict:
    md = {**flat_numbers(run.result), "path": dg.MetadataValue.path(str(run.out))}
    if (run.out / "coverage.png").exists():
        md["coverage_plot"] = dg.MetadataValue.md(markdown_image((run.out / "coverage.png").read_bytes(), "coverage"))
    return md


def mixes_page(run: NodeRun) -> dict:
    return {"mixes": dg.MetadataValue.json(run.result), "path": dg.MetadataValue.path(str(run.out))}


def training_page(run: NodeRun) -> dict:
    """A rung's checkpoint; on a Slurm profile the job's report and log tail beside it."""
    details = {}
    if hasattr(run.result, "metadata"):  # a slurm.jobs.JobReport
        details = {**run.result.metadata(), "log_tail": dg.MetadataValue.md(f"```\n{run.result.log_tail}\n```")}
    return checkpoint_page(run.out, samples=checkpoint_samples(run.out, run.cfg), details=details)


def final_checkpoint_page(run: NodeRun) -> dict:
    info = json.loads((run.out / "pma.json").read_text())
    pma = {
        "pma_k": info["k"],
        "pma_steps": dg.MetadataValue.json(info["steps"]),
        "rung": run.node.rung.name if run.node.rung else None,
    }
    return checkpoint_page(run.out, samples=checkpoint_samples(run.out, run.cfg), details=pma)


def samples_page(run: NodeRun) -> dict:
    table = run.out / "samples.parquet"
    n = pq.read_metadata(table).num_rows if table.exists() else 0
    grid = Path(run.result)
    return {
        "grid": dg.MetadataValue.md(markdown_image(grid.read_bytes(), "samples")),
        "images": n,
        "path": dg.MetadataValue.path(str(grid)),
    }


def evaluation_node_page(run: NodeRun) -> dict:
    return evaluation_page(run.out)


def report_page(run: NodeRun) -> dict:
    return {**{k: v for k, v in run.result.items() if v is not None}, "path": dg.MetadataValue.path(str(run.out))}


def reward_model_page(run: NodeRun) -> dict:
    report = run.result
    md = {"held_out_accuracy": report["held_out_accuracy"]} if report["held_out_accuracy"] is not None else {}
    return {**md, **{k: v for k, v in report.items() if k != "held_out_accuracy" and v is not None}}


# ------------------------------------------------------------------------------------------ post-training
def evaluation_metadata(name: str, row: dict) -> dict:
    """A checkpoint's evaluation row as metadata: prompt following per attribute, held-out loss, distribution
    metrics (or why they are missing) and the sampling cost."""
    md = {f"prompt_following_{name}.{k}": v for k, v in row["prompt_following"].items()}
    md[f"heldout_loss_{name}"] = row["heldout_loss"]
    md |= {f"{m}_{name}": v for m, v in row["distribution"].items() if v is not None}
    md[f"nfe_per_image_{name}"], md[f"seconds_per_image_{name}"] = row["nfe_per_image"], row["seconds_per_image"]
    return md


def compare(before: Path, after: Path, cfg, data_dir: Path) -> dict:
    """Both checkpoints under the evaluation protocol (training.evaluation.evaluate.evaluation_row, held-out rows
    of `data_dir`), with their sample grids and the configured reward mix's means on the evaluation's images;
    the gain in prompt following first."""
    from training.core.plots import sample_grid
    from training.evaluation.evaluate import eval_rubric, evaluation_row
    from training.evaluation.rewards import configured_reward_mix, reward_means

    rows, md = {}, {}
    rubric = eval_rubric(cfg)  # one judge for both
    mix = configured_reward_mix(cfg, judge=rubric[1])
    prompts = [p.prompt for p in rubric[0]]
    for name, ckpt in (("before", before), ("after", after)):
        rows[name], images = evaluation_row(ckpt, data_dir, cfg, rubric)
        md |= evaluation_metadata(name, rows[name])
        md |= {f"reward_mean_{name}.{k}": v for k, v in reward_means(mix, rubric[0], images).items() if v is not None}
        md[f"samples_{name}"] = dg.MetadataValue.md(markdown_image(sample_grid(images, prompts), f"samples {name}"))
    gain = {
        "prompt_following_gain.all": round(
            rows["after"]["prompt_following"]["all"] - rows["before"]["prompt_following"]["all"], 4
        )
    }
    if all(v is None for r in rows.values() for v in r["distribution"].values()):
        md["distribution_metrics"] = (
            "skipped: no extractor is set (metrics.fid_extractor, metrics.clip_extractor, metrics.dino_extractor)"
        )
    return gain | md


def post_page(out: Path, md: dict, curve: tuple[Path, str]) -> dict:
    """A post-training checkpoint's page: the gain and prompt following before/after first, then its own
    training curve and the "after" samples, the rest, the config as one entry."""
    lead = (
        "prompt_following_gain",
        "student_vs_teacher",
        "speedup",
        "prompt_following_after.all",
        "prompt_following_before.all",
    )
    head = {k: v for k, v in md.items() if k.startswith(lead)}
    rest = {k: v for k, v in md.items() if k not in head and k != "samples_after"}
    after = md.get("samples_after")
    return checkpoint_page(
        out, headline=head, samples=after.value if after is not None else None, curve=curve, details=rest
    )


def history_means(path: Path, keys: list[str], last: int = 10) -> dict:
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    tail = rows[-last:]
    return {
        f"last{last}.{k}": round(sum(r[k] for r in tail) / len(tail), 6)
        for k in keys
        if tail and all(k in r for r in tail)
    }


def dpo_page(run: NodeRun) -> dict:
    info = json.loads((run.out / "dpo.json").read_text())
    md = compare(run.inputs["checkpoint"], run.out, run.cfg, run.eval_set)
    md |= history_means(run.out / "dpo_history.jsonl", ["loss", "winner_loglik", "loser_loglik", "accuracy"])
    md["guard_fired_at"] = dg.MetadataValue.json(info["guard_fired_at"])
    return post_page(run.out, md, (run.out / "dpo_history.jsonl", "loss"))


def grpo_page(run: NodeRun) -> dict:
    md = compare(run.inputs["checkpoint"], run.out, run.cfg, run.eval_set)
    md |= history_means(run.out / "grpo_history.jsonl", ["reward", "kl", "clipped"])
    return post_page(run.out, md, (run.out / "grpo_history.jsonl", "reward"))


def student_page(run: NodeRun) -> dict:
    """The student against the teacher at its own steps, and the teacher sampled naively with the student's."""
    from training.evaluation.evaluate import evaluation_row
    from training.evaluation.sampling import read_sampler_settings

    teacher, cfg = run.inputs["checkpoint"], run.cfg
    md = compare(teacher, run.out, cfg, run.eval_set)
    steps = read_sampler_settings(run.out).steps
    naive = cfg.model_copy(
        update={"train": cfg.train.model_copy(update={"eval": cfg.train.eval.model_copy(update={"steps": steps})})}
    )
    row, _ = evaluation_row(teacher, run.eval_set, naive)
    md |= evaluation_metadata(f"teacher_{steps}_steps", row)
    md["student_vs_teacher.all"] = (
        round(md["prompt_following_after.all"] / md["prompt_following_before.all"], 4)
        if md["prompt_following_before.all"]
        else None
    )
    md["speedup_vs_teacher"] = (
        round(md["seconds_per_image_before"] / md["seconds_per_image_after"], 2)
        if md["seconds_per_image_after"]
        else None
    )
    md |= history_means(run.out / "tdm_history.jsonl", ["student_loss", "fake_loss", "teacher_gap"])
    return post_page(
        run.out, {k: v for k, v in md.items() if v is not None}, (run.out / "tdm_history.jsonl", "student_loss")
    )


def score_table(rows: dict[str, dict[str, float]]) -> str:
    """Markdown: one row per checkpoint, one column per domain, plus the mean."""
    domains = sorted({d for r in rows.values() for d in r})
    head = "| checkpoint | " + " | ".join(domains) + " | mean |\n|---|" + "---|" * (len(domains) + 1) + "\n"
    body = "".join(
        f"| {name} | " + " | ".join(f"{r[d]:.3f}" for d in domains) + f" | {sum(r.values()) / len(r):.3f} |\n"
        for name, r in rows.items()
    )
    return head + body


def merged_page(run: NodeRun) -> dict:
    """The table every merge decision rests on: each domain SFT, the base and the merge, scored on every
    domain; then the merge's evaluation row."""
    from training.evaluation.evaluate import evaluation_row

    table, domains = run.result["scores"], [d.name for d in run.cfg.ladder.domains]
    best_single = {d: max(table[name][d] for name in domains) for d in table["merge"]}
    md = {
        **{f"merge.{d}": v for d, v in table["merge"].items()},
        **{
            f"merge_vs_best_single.{d}": round(table["merge"][d] / best_single[d], 4)
            for d in best_single
            if best_single[d]
        },
        "scores": dg.MetadataValue.md(score_table(table)),
    }
    row, _ = evaluation_row(run.out, run.eval_set, run.cfg)  # the merge as a checkpoint: the evaluation every rung gets
    md |= evaluation_metadata("merge", row)
    details = {"candidates": dg.MetadataValue.json(run.result["search"]["candidates"])}
    return checkpoint_page(
        run.out, headline=md, samples=checkpoint_samples(run.out, run.cfg), details=details, trained_here=False
    )


# --------------------------------------------------------------------------------------- expander, style
def expander_page(run: NodeRun) -> dict:
    """The evaluation first (faithfulness, following short -> expanded, diversity), then training means."""
    from training.expander.commands import EVAL_FILE

    report = json.loads((run.out / EVAL_FILE).read_text())
    keys = (
        "faithfulness",
        "faithfulness_wide",
        "following_short",
        "following_expanded",
        "following_gain",
        "diversity",
        "prompts",
        "prompts_wide",
        "following_images",
    )
    md = {k: report[k] for k in keys if k in report}
    md["examples"] = dg.MetadataValue.md(
        "\n".join(f"- `{e['short']}` -> `{e['expanded']}`" for e in report["examples"])
    )
    history = next(iter(sorted(run.out.glob("expander_*_history.jsonl"))), None)
    lines = [json.loads(x) for x in history.read_text().splitlines()] if history else []
    for k in ("loss", "reward_faithfulness", "reward_image", "reward_diversity", "kl"):
        vals = [h[k] for h in lines[-10:] if k in h and h[k] == h[k]]
        if vals:
            md[f"last10.{k}"] = round(sum(vals) / len(vals), 6)
    return {**md, "path": dg.MetadataValue.path(str(run.out))}


def style_page(run: NodeRun) -> dict:
    """Transfer / leakage / content per strength, whether transfer rises monotonically, and leakage against its bound."""
    from training.style.commands import EVAL_FILE

    report = json.loads((run.out / EVAL_FILE).read_text())
    md: dict = {}
    for r in report["per_strength"]:
        for k in ("transfer", "leakage", "content", "color"):
            md[f"{k}@{r['strength']:g}"] = r[k]
    md["transfer_monotone"] = report["transfer_monotone"]
    md["max_leakage"], md["leakage_bound"], md["leakage_ok"] = (
        report["max_leakage"],
        report["leakage_bound"],
        report["leakage_ok"],
    )
    md["eval_cases"] = report["cases"]
    history = [json.loads(x) for x in (run.out / "style_history.jsonl").read_text().splitlines()]
    if history:
        tail = history[-10:]
        md["last10.loss"] = round(sum(h["loss"] for h in tail) / len(tail), 6)
    return checkpoint_page(run.out, headline=md, curve=(run.out / "style_history.jsonl", "loss"))


PAGES: dict[str, Callable[[NodeRun], dict]] = {
    "stage": stage_page,
    "source": source_page,
    "coverage": coverage_page,
    "mixes": mixes_page,
    "checkpoint": training_page,
    "final_checkpoint": final_checkpoint_page,
    "samples": samples_page,
    "evaluation": evaluation_node_page,
    "merged": merged_page,
    "report": report_page,
    "reward_model": reward_model_page,
    "dpo": dpo_page,
    "grpo": grpo_page,
    "student": student_page,
    "expander": expander_page,
    "style": style_page,
}
