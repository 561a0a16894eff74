"""Style evaluation on the demo grammar: transfer accuracy and content leakage per reference strength.

For `style.eval_cases` cases (training/style/data.py: a prompt naming a large shape and no background, a
reference with another shape on its own background) the model samples at every strength of
`style.eval_strengths`, with the same seed at every strength, and training/evaluation/prompt_check.py's rules read
each image: `transfer` (the background is the reference's), `leakage` (the shape is the reference's, not
the prompt's), `content` and `color` (the prompt's shape and colour survive).
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

from kiln.config import KilnConfig


def evaluate_style(
    gen, cfg: KilnConfig, height: int, width: int, strengths: list[float] | None = None, cases: int | None = None
) -> dict:
    """{"strengths": [...], "per_strength": [{strength, transfer, leakage, content, color}], "transfer_monotone",
    "max_leakage", "leakage_bound", "leakage_ok"} for a Generator with a reference pathway."""
    from model.sampler import sample
    from training.evaluation.sampling import sampling_shift
    from training.style.data import style_cases, style_scores

    style = cfg.style
    strengths = list(style.eval_strengths if strengths is None else strengths)
    chosen = style_cases(cases or style.eval_cases, style.seed + 1, height, width)
    shift = sampling_shift(gen, height, width, cfg.train)
    rows = []
    for s in strengths:
        refs = gen.encode_references([[c.reference] for c in chosen], [[s] for _ in chosen])
        images = sample(
            gen,
            [c.prompt for c in chosen],
            height,
            width,
            style.eval_steps,
            style.eval_cfg_scale,
            style.seed,
            shift=shift,
            refs=refs,
        )
        rows.append({"strength": s} | style_scores(images, chosen))
    transfer = [r["transfer"] for r in rows]
    leak = max(r["leakage"] for r in rows)
    return {
        "strengths": strengths,
        "per_strength": rows,
        "transfer_monotone": bool(all(b > a for a, b in pairwise(transfer))),
        "max_leakage": leak,
        "leakage_bound": style.leakage_bound,
        "leakage_ok": bool(leak <= style.leakage_bound),
        "cases": len(chosen),
    }


def evaluate_style_checkpoint(checkpoint: Path, cfg: KilnConfig, **kw) -> dict:
    from model.generator import Generator
    from training.evaluation.sampling import checkpoint_resolution

    gen = Generator.from_pretrained(checkpoint).eval()
    h, w = checkpoint_resolution(Path(checkpoint), cfg)
    return evaluate_style(gen, cfg, h, w, **kw)
