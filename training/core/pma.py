"""PMA: the average of the last K checkpoints' weights, written as its own checkpoint folder (or, with
train.final_weights=pma, as the run's own export; training/core/ema.py is the EMA alternative).

Replaces an EMA (no extra copy of the weights during training, and K / the window can be chosen after
the run). The sources must be the same model (same config.json "model" and "dit"); the average is taken
in fp32 in a fixed order, so the result is deterministic. The folder is a normal Generator checkpoint
(config.json, model.safetensors) plus pma.json naming its sources, readable by the sampler and evaluator.
Sources are checked against their checksums before they are read (training/core/manifest.py): a DCP step
checkpoint must be one this user's kiln signed (or `trust_unsigned`), an export with a checksums.json
must match it; the PMA folder gets a checksums.json of its own.
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
    from training.core.checkpoint import verify_export, write_export_manifest

    for s in sources:
        verify_export(Path(s))
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
    steps = [
        json.loads((Path(s) / "train_state.json").read_text())["step"]
        if (Path(s) / "train_state.json").exists()
        else None
        for s in sources
    ]
    (out / "pma.json").write_text(
        json.dumps({"sources": [str(s) for s in sources], "steps": steps, "k": len(sources)}, indent=2) + "\n"
    )
    write_export_manifest(out)
    return out


def dcp_step_weights(step_dir: Path, gen, trust_unsigned: bool = False) -> dict[str, torch.Tensor]:
    """The model weights of one DCP step checkpoint (training/core/dcp.py), in the canonical single-process layout.

    `gen` is a plain Generator of the run's config (e.g. `Generator.from_pretrained(run_dir)`); the step's
    train_state.json says which tp layout its fused weights were saved in. The step's checksums are
    verified first (CheckpointCorrupt / CheckpointUntrusted name the file)."""
    from training.core.dcp import verify_step
    from training.core.dcp_safe import safe_load
    from training.core.manifest import signing_key
    from training.core.parallel import canonical_state_dict

    verify_step(Path(step_dir), signing_key(), trust_unsigned)
    tp = int(json.loads((Path(step_dir) / "train_state.json").read_text()).get("tp", 1))
    state = {"model": {k: v.detach().clone() for k, v in gen.state_dict().items()}}
    safe_load(state, step_dir, no_dist=True)  # only the model: optimiser and RNG stay on disk
    return canonical_state_dict(state["model"], gen, tp)


def average_steps(steps: list[Path], gen, trust_unsigned: bool = False) -> dict[str, torch.Tensor]:
    """The fp64-accumulated mean of the DCP step checkpoints' model weights, in `gen`'s dtypes, in order."""
    total: dict[str, torch.Tensor] = {}
    for step in steps:
        for name, t in dcp_step_weights(step, gen, trust_unsigned).items():
            total[name] = total.get(name, 0) + t.double()
    reference = gen.state_dict()
    return {name: (t / len(steps)).to(reference[name].dtype) for name, t in total.items()}


def write_pma_record(out: Path, steps: list[Path], k: int) -> None:
    """pma.json: the step checkpoints averaged, their steps, and the k asked for."""
    numbers = [json.loads((s / "train_state.json").read_text())["step"] for s in steps]
    (out / "pma.json").write_text(
        json.dumps({"sources": [str(s) for s in steps], "steps": numbers, "k": len(steps), "asked_k": k}, indent=2)
        + "\n"
    )


def pma_from_run(run_dir: Path, k: int, out_dir: Path, trust_unsigned: bool = False) -> Path:
    """PMA over a training run's last `k` DCP step checkpoints (fewer if the run kept fewer): a checkpoint
    folder with the run's config and train state and `pma.json` naming the steps averaged."""
    from model.generator import Generator
    from training.core.checkpoint import STATE_FILE, verify_export, write_export_manifest
    from training.core.dcp import complete_checkpoints

    steps = complete_checkpoints(Path(run_dir))[-k:]
    if not steps:
        raise ValueError(f"{run_dir} has no complete DCP step checkpoint to average (train.dcp.every > 0 keeps them)")
    verify_export(Path(run_dir))
    gen = Generator.from_pretrained(run_dir)
    gen.load_state_dict(average_steps(steps, gen, trust_unsigned), strict=True)
    out = Path(out_dir)
    gen.save_pretrained(out)
    (out / STATE_FILE).write_text((Path(run_dir) / STATE_FILE).read_text())
    write_pma_record(out, steps, k)
    write_export_manifest(out)
    return out


def export_pma(run_dir: Path, k: int, trust_unsigned: bool = False) -> None:
    """train.final_weights=pma: replace the run's just-exported model.safetensors (before its checksums are
    written) by the PMA of its last `k` step checkpoints, and record them in pma.json. The trainer's own step
    checkpoints: the ones this run wrote and signed a moment ago."""
    from model.generator import Generator
    from training.core.dcp import complete_checkpoints

    steps = complete_checkpoints(Path(run_dir))[-k:]
    gen = Generator.from_pretrained(run_dir)
    gen.load_state_dict(average_steps(steps, gen, trust_unsigned), strict=True)
    gen.save_pretrained(run_dir)
    write_pma_record(Path(run_dir), steps, k)
