"""The expander's two commands as every door calls them (`kiln expander-sft`, `kiln expander-rl`, the
`expander_sft` and `expander_rl` nodes): train, then, with `evaluate`, write OUT/expander_eval.json."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.config import KilnConfig
from training.expander.evaluate import evaluate_expander
from training.expander.rl import train_rl
from training.expander.sft import read_pairs, train_sft

EVAL_FILE = "expander_eval.json"


def _evaluated(out: Path, checkpoint: Path | None, cfg: KilnConfig, evaluate: bool) -> dict:
    if not evaluate:
        return {"expander": str(out)}
    report = evaluate_expander(out, checkpoint, cfg)
    (out / EVAL_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return {"expander": str(out), **{k: v for k, v in report.items() if k != "examples"}}


def expander_sft(
    pairs: Path,
    checkpoint: Path | None,
    out: Path,
    cfg: KilnConfig,
    resume: bool = False,
    overwrite: bool = False,
    evaluate: bool = False,
) -> dict:
    """SFT on the user_prompts output `pairs`; `checkpoint`, the DiT the evaluation draws with."""
    done = train_sft(read_pairs(Path(pairs)), Path(out), cfg, resume=resume, overwrite=overwrite)
    return _evaluated(done, Path(checkpoint) if checkpoint else None, cfg, evaluate)


def expander_rl(
    sft: Path,
    checkpoint: Path | None,
    out: Path,
    cfg: KilnConfig,
    resume: bool = False,
    overwrite: bool = False,
    evaluate: bool = False,
) -> dict:
    """GDPO from the expander-sft output `sft`; `checkpoint`, the DiT that draws the expansions."""
    ckpt = Path(checkpoint) if checkpoint else None
    done = train_rl(Path(sft), ckpt, Path(out), cfg, resume=resume, overwrite=overwrite)
    return _evaluated(done, ckpt, cfg, evaluate)
