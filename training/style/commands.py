"""Style training as every door calls it (`kiln style-train`, the `checkpoint_style` node): train the
reference pathway from a checkpoint, then, with `evaluate`, write OUT/style_eval.json."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.config import KilnConfig
from training.style.evaluate import evaluate_style_checkpoint
from training.style.train import style_train

EVAL_FILE = "style_eval.json"


def style_command(
    checkpoint: Path, out: Path, cfg: KilnConfig, resume: bool = False, overwrite: bool = False, evaluate: bool = False
) -> dict:
    done = style_train(Path(checkpoint), Path(out), cfg, resume=resume, overwrite=overwrite)
    if not evaluate:
        return {"checkpoint": str(done)}
    report = evaluate_style_checkpoint(done, cfg)
    (done / EVAL_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return {"checkpoint": str(done), **report}
