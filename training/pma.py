"""PMA: the average of the last K checkpoints' weights, written as its own checkpoint folder.

Replaces an EMA (no extra copy of the weights during training, and K / the window can be chosen after
the run). The sources must be the same model (same config.json "model" and "dit"); the average is taken
in fp32 in a fixed order, so the result is deterministic. The folder is a normal Generator checkpoint
(config.json, model.safetensors) plus pma.json naming its sources, readable by the sampler and evaluator.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from model.generator import FORMAT


def last_k(checkpoints: list[Path], k: int) -> list[Path]:
    """The last k of checkpoints ordered by their training step (train_state.json)."""

    def step(d: Path) -> int:
        return json.loads((Path(d) / "train_state.json").read_text())["step"]

    return sorted((Path(c) for c in checkpoints), key=step)[-k:]


def average_checkpoints(sources: list[Path], out_dir: Path) -> Path:
    """Average model.safetensors of `sources` into `out_dir` (config.json copied from the last one)."""
    if not sources:
        raise ValueError("PMA needs at least one checkpoint")
    configs = [json.loads((Path(s) / "config.json").read_text()) for s in sources]
    for s, c in zip(sources, configs):
        if (c["model"], c["dit"]) != (configs[0]["model"], configs[0]["dit"]):
            raise ValueError(f"{s} is another model than {sources[0]}: PMA averages checkpoints of one run")
    total: dict[str, torch.Tensor] = {}
    for s in sources:
        for name, t in load_file(str(Path(s) / "model.safetensors")).items():
            total[name] = total.get(name, 0) + t.double()
    first = load_file(str(Path(sources[0]) / "model.safetensors"))
    avg = {name: (t / len(sources)).to(first[name].dtype).contiguous() for name, t in sorted(total.items())}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(configs[-1], indent=2, sort_keys=True) + "\n")
    save_file(avg, str(out / "model.safetensors"), metadata={"format": FORMAT})
    steps = [json.loads((Path(s) / "train_state.json").read_text())["step"] if (Path(s) / "train_state.json").exists() else None for s in sources]
    (out / "pma.json").write_text(json.dumps({"sources": [str(s) for s in sources], "steps": steps, "k": len(sources)}, indent=2) + "\n")
    return out
