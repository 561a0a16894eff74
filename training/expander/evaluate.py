"""The expander's evaluation: what its Dagster pages and the benchmark report.

On the held-out prompts made short (the demo: the evaluation's 12 prompts, none RL ever rewarded):
- faithfulness: the mean share of each short prompt's attributes its greedy expansion keeps; on the demo also
  `faithfulness_wide`, the same over 120 more grammar prompts none of RL's (training/expander/rl.py
  `wide_heldout_prompt_set`), since one dropped attribute in twelve prompts moves the mean by ~0.03;
- prompt following: the DiT fed the short prompts vs their expansions, `n_images` each from the same noise,
  scored by the rubric judge on the requirements the short prompt states (what the user asked for);
- diversity: `group` expansions sampled per prompt (temperature 1), each drawn from the prompt's noise; the
  mean cosine distance of their image embeddings (the RL's diversity reward).
Without a DiT checkpoint only faithfulness is reported.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kiln.config import KilnConfig
from training.expander.rewards import faithfulness, make_extractor
from training.expander.rl import ExpansionScorer, heldout_prompt_set, sample_expansions, wide_heldout_prompt_set
from training.expander.sft import expand, load_expander
from training.post.runner import iteration_seed


def evaluate_expander(
    expander: Path,
    checkpoint: Path | None,
    cfg: KilnConfig,
    n_images: int = 2,
    group: int = 4,
    prompts=None,
    wide_n: int = 120,
) -> dict:
    prompts = prompts or heldout_prompt_set(cfg)
    lm, tok, template, max_new = load_expander(expander)
    shorts = [p.short for p in prompts]
    expanded = expand(lm, tok, shorts, template, max_new)
    extractor = make_extractor(cfg.expander)
    faith = [float(faithfulness(extractor, s, [e])[0]) for s, e in zip(shorts, expanded)]
    report: dict = {"prompts": len(prompts), "faithfulness": float(np.mean(faith))}
    misses = [(s, e) for f, s, e in zip(faith, shorts, expanded) if f < 1]
    if wide_n and (wide := [p.short for p in wide_heldout_prompt_set(cfg, wide_n)]):
        wide_exp = expand(lm, tok, wide, template, max_new)
        kept = [float(faithfulness(extractor, s, [e])[0]) for s, e in zip(wide, wide_exp)]
        report |= {"faithfulness_wide": float(np.mean(kept)), "prompts_wide": len(wide)}
        misses += [(s, e) for f, s, e in zip(kept, wide, wide_exp) if f < 1]
    report["examples"] = [{"short": s, "expanded": e} for s, e in list(zip(shorts, expanded))[:4]]
    report["unfaithful"] = [  # what the expander dropped or overrode: the cases to read
        {"short": s, "expanded": e, "lost": [a for a in extractor.attributes(s) if not extractor.survives(a, e)]}
        for s, e in misses[:8]
    ]
    if checkpoint is None:
        return report
    scorer = ExpansionScorer(cfg, checkpoint)
    seed = cfg.expander.seed
    follow = {"short": [], "expanded": []}
    for i, (p, e) in enumerate(zip(prompts, expanded)):
        for k in range(n_images):
            noise = iteration_seed(seed, i, f"eval{k}") % 2**31
            ims = scorer.images([p.short, e], noise)
            scores = scorer.image_reward.score(p.rubric, ims, p.short)
            if not np.isnan(scores).any():
                follow["short"].append(float(scores[0]))
                follow["expanded"].append(float(scores[1]))
    spread = []
    for i, p in enumerate(prompts):
        _, _, texts = sample_expansions(
            lm,
            tok,
            p.short,
            template,
            group,
            1.0,
            max_new,
            iteration_seed(seed, i, "eval_group"),
        )
        spread.append(
            float(scorer.score(p, texts, iteration_seed(seed, i, "eval_noise") % 2**31)[0]["diversity"].mean())
        )
    report |= {
        "following_short": float(np.mean(follow["short"])) if follow["short"] else float("nan"),
        "following_expanded": float(np.mean(follow["expanded"])) if follow["expanded"] else float("nan"),
        "following_images": len(follow["short"]),
        "diversity": float(np.mean(spread)),
    }
    report["following_gain"] = report["following_expanded"] - report["following_short"]
    return report
