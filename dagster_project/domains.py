"""Domain SFT and merging as assets (the Krea 2 order: SFT -> domain SFTs -> one merged generalist).

`checkpoint_<domain>` is the trainer on `train_set_<domain>` (the domain's mix) from `checkpoint`, one per
`ladder.domains` entry; `checkpoint_merged` merges them against `checkpoint` as the base (training/merge.py,
`post.merge`), searching the candidate weights for the best mean domain score. Its page leads with the
table every merge decision rests on: each domain SFT, the base and the merge, scored on every domain, then the
merge's evaluation row (prompt following per attribute, held-out loss, distribution metrics, NFEs, seconds).
Post-training (preference pairs, DPO) then starts from the merge (kiln.ladder.post_base).
"""

from __future__ import annotations

import dagster as dg

from dagster_project.assets import EVAL_SET
from dagster_project.ladder import checkpoint_asset
from dagster_project.pages import checkpoint_page, checkpoint_samples
from dagster_project.resources import KilnResource
from kiln.ladder import FINAL, MERGED, domain_rungs
from kiln.lineage import code_files, code_version, default_config

DOMAINS = domain_rungs(default_config())


def score_table(rows: dict[str, dict[str, float]]) -> str:
    """Markdown: one row per checkpoint, one column per domain, plus the mean."""
    domains = sorted({d for r in rows.values() for d in r})
    head = "| checkpoint | " + " | ".join(domains) + " | mean |\n|---|" + "---|" * (len(domains) + 1) + "\n"
    body = "".join(f"| {name} | " + " | ".join(f"{r[d]:.3f}" for d in domains) + f" | {sum(r.values()) / len(r):.3f} |\n" for name, r in rows.items())
    return head + body


def _merged_asset() -> dg.AssetsDefinition:
    @dg.asset(
        name=MERGED,
        deps=[FINAL, *(r.checkpoint for r in DOMAINS)],
        group_name="post_training",
        kinds={"pytorch", "safetensors"},
        code_version=code_version(tuple(sorted({*code_files("training.merge"), *code_files("training.domains")}))),
        description=f"The merge of {', '.join(r.checkpoint for r in DOMAINS)} against `checkpoint` (post.merge: method, weights, density, "
        "and a search over candidate weights); per-domain scores of every domain SFT, the base and the merge first.",
    )
    def checkpoint_merged(kiln: KilnResource) -> dg.MaterializeResult:
        from dagster_project.post_training import evaluation_metadata
        from training.domains import merge_domains
        from training.evaluate import evaluation_row

        out = kiln.path(MERGED)
        report = merge_domains(kiln.path(FINAL), {r.name: kiln.path(r.checkpoint) for r in DOMAINS}, out, kiln.config())
        table = report["scores"]
        best_single = {d: max(table[r.name][d] for r in DOMAINS) for d in table["merge"]}
        md = {
            **{f"merge.{d}": v for d, v in table["merge"].items()},
            **{f"merge_vs_best_single.{d}": round(table["merge"][d] / best_single[d], 4) for d in best_single if best_single[d]},
            "scores": dg.MetadataValue.md(score_table(table)),
        }
        row, _ = evaluation_row(out, kiln.path(EVAL_SET), kiln.config())  # the merge as a checkpoint: the evaluation every rung gets
        md |= evaluation_metadata("merge", row)
        details = {"candidates": dg.MetadataValue.json(report["search"]["candidates"])}
        samples = checkpoint_samples(out, kiln.config())
        return dg.MaterializeResult(metadata=checkpoint_page(out, headline=md, samples=samples, details=details, trained_here=False))

    return checkpoint_merged


domain_assets = [*(checkpoint_asset(r) for r in DOMAINS), *([_merged_asset()] if DOMAINS else [])]
