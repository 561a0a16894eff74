"""Checkpoint folders: what a later stage, the sampler, the evaluator or a resume reads.

    out/config.json, out/model.safetensors   Generator.save_pretrained (trainable weights only, canonical layout)
    out/train_state.json                     step, data position, final loss, data facts, config dump
    out/checksums.json                       size and sha256 of each file above (and train_data.json), signed
    out/dcp/step-NNNNNN/                     the resumable state (model, optimiser, position, RNG): training/core/dcp.py

Everything in them is deterministic for the same data and config (wall-clock throughput lives in
throughput.json next to them), so a checkpoint is a reproducible asset.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from training.core.data import DataPosition

STATE_FILE = "train_state.json"
MANIFEST = "checksums.json"
EXPORT_FILES = (
    "config.json",
    "model.safetensors",
    STATE_FILE,
    "train_data.json",
    "heldout.json",
    "sampler.json",
)  # what sampling and evaluation read


@dataclass(frozen=True)
class TrainState:
    step: int  # optimiser steps done
    position: DataPosition  # where the data stream continues
    final_loss: float | None  # loss of the last step
    loss_ema: float | None  # smoothed loss at the last step
    bucket: str  # the main training bucket "HxW": the resolution samples and evals use
    rows: int  # training rows (after the hold-out)
    holdout: int  # rows held out for evaluation
    num_params: int
    config: dict = field(default_factory=dict)  # the full KilnConfig that produced it

    def to_json(self) -> str:
        d = asdict(self) | {"position": self.position.to_dict()}
        return json.dumps(d, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "TrainState":
        d = json.loads(text)
        d["position"] = DataPosition.from_dict(d["position"])
        return cls(**d)


def read_train_state(checkpoint: Path) -> TrainState:
    path = Path(checkpoint) / STATE_FILE
    if not path.exists():
        raise FileNotFoundError(f"{checkpoint} has no {STATE_FILE}: not a kiln training checkpoint")
    return TrainState.from_json(path.read_text())


def write_export_manifest(folder: Path) -> Path:
    """Checksums of the exported files present in `folder` (training/core/manifest.py): written last, after them."""
    from training.core.manifest import signing_key, write_manifest

    folder = Path(folder)
    return write_manifest(
        folder, MANIFEST, [f for f in EXPORT_FILES if (folder / f).is_file()], signing_key(), {"kind": "export"}
    )


def verify_export(folder: Path) -> bool:
    """Raise CheckpointCorrupt (naming the file) if an exported file differs from its checksum; False when
    the folder has no manifest (one made by hand or before checksums: safetensors cannot run code)."""
    from training.core.manifest import read_manifest, verify_files

    folder = Path(folder)
    if not (folder / MANIFEST).exists():
        return False
    verify_files(folder, read_manifest(folder / MANIFEST, key=None))
    return True
