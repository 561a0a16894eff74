"""Domain SFT rungs (`ladder.domains`): each domain's prompt set and score.

A domain's score is the mean requirement score of the rubric (training/evaluation/rubric.py) over its prompts, sampled
with the evaluation's protocol (train.eval: steps, seed, samples per prompt; train.sample.cfg_scale). The
merge search (training/post/merge.py) keeps the merge with the best mean over domains, and the merge asset
reports every domain SFT and the merge on every domain, so "the merge keeps each domain" is a number.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kiln.config import DomainRungConfig, KilnConfig
from kiln.errors import UserError
from training.evaluation.rubric import RubricPrompt


def domain_prompts(domain: DomainRungConfig, cfg: KilnConfig) -> list[RubricPrompt]:
    """`eval_prompts` (rubric JSONL), else the demo stand-in: `eval_n` grammar prompts of `demo_family`
    outside the evaluation's prompt combinations, drawn with the evaluation's seed."""
    from training.evaluation.rubric import demo_rl_prompts, read_prompt_set

    if domain.eval_prompts:
        return read_prompt_set(Path(domain.eval_prompts))
    if domain.demo_family is None:
        raise ValueError(f"domain {domain.name!r} has neither eval_prompts nor demo_family: nothing to score it on")
    return demo_rl_prompts(domain.eval_n, cfg.train.eval.seed + 1, family=domain.demo_family)


def score_prompts(
    gen, prompts: list[RubricPrompt], judge, cfg: KilnConfig, height: int, width: int
) -> tuple[float, dict[str, float]]:
    """(mean requirement score, per-attribute accuracy) of `gen` on `prompts` under the evaluation protocol."""
    from training.evaluation.rubric import rubric_scores
    from training.evaluation.sampling import generate, sampling_shift

    ec = cfg.train.eval
    images = generate(
        gen,
        [p.prompt for p in prompts],
        ec.n_per_prompt,
        height,
        width,
        ec.steps,
        cfg.train.sample.cfg_scale,
        ec.seed,
        sampling_shift(gen, height, width, cfg.train),
    )
    per_image, summary = rubric_scores(judge, prompts, images)
    return round(float(np.mean(per_image)), 4), summary


def domain_scores(checkpoint: Path, cfg: KilnConfig) -> dict[str, float]:
    """Per domain of `ladder.domains`, the checkpoint's score on that domain's prompts."""
    from model.generator import Generator
    from training.evaluation.rewards import make_judge
    from training.evaluation.sampling import checkpoint_resolution

    gen = Generator.from_pretrained(checkpoint).eval()
    height, width = checkpoint_resolution(Path(checkpoint), cfg)
    judge = make_judge(cfg.post)
    return {
        d.name: score_prompts(gen, domain_prompts(d, cfg), judge, cfg, height, width)[0] for d in cfg.ladder.domains
    }


def merge_domains(base: Path, sources: dict[str, Path], out: Path, cfg: KilnConfig) -> dict:
    """The merge of the domain SFT checkpoints `sources` (domain name -> folder) against `base`: the merge
    search of `post.merge` scored per domain (training/post/merge.py), with the base's records (held-out ids,
    train state) copied, and `domain_scores.json`: every domain SFT, the base and the kept merge on every
    domain. Returns {"scores": that table, "search": the search report}."""
    import json
    import shutil

    from training.core.checkpoint import write_export_manifest
    from training.core.final_checkpoint import RECORDS
    from training.post.merge import merge_search

    base, out = Path(base), Path(out)
    search = merge_search(list(sources.values()), base, out, cfg.post.merge, score=lambda p: domain_scores(p, cfg))
    for name in (*RECORDS, "train_state.json"):  # the merge has the base's lineage: its held-out rows, its bucket
        if (base / name).exists():
            shutil.copyfile(base / name, out / name)
    table = {name: domain_scores(path, cfg) for name, path in sources.items()}
    table["base"] = domain_scores(base, cfg)
    table["merge"] = search["candidates"][search["kept"]]["scores"]
    (out / "domain_scores.json").write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    write_export_manifest(
        out
    )  # the copied held-out ids and train state are under the folder's checksums (EXPORT_FILES)
    return {"scores": table, "search": search}


def merge_domain_checkpoints(base: Path, sources: list[Path], out: Path, cfg: KilnConfig) -> dict:
    """`kiln merge-domains` (the `checkpoint_merged` node): `sources` in the order of `ladder.domains`."""
    names = [d.name for d in cfg.ladder.domains]
    if len(names) != len(sources):
        raise UserError(
            f"merge-domains: {len(sources)} --source for the {len(names)} domains of ladder.domains ({', '.join(names) or 'none'})"
        )
    return merge_domains(Path(base), dict(zip(names, map(Path, sources), strict=True)), Path(out), cfg)
