"""`checkpoint`, the model the ladder ends in: the PMA of the last rung's last step checkpoints, carrying that
rung's records (held-out ids, the data it saw, its throughput and loss curve) so samples, evaluation and the
Dagster page read one folder."""

from __future__ import annotations

import shutil
from pathlib import Path

from training.core.data import HELDOUT_FILE

RECORDS = (HELDOUT_FILE, "train_data.json", "throughput.json", "loss.csv", "loss.png")


def write_final_checkpoint(last_rung: Path, k: int, out: Path) -> Path:
    from training.core.checkpoint import write_export_manifest
    from training.core.pma import pma_from_run

    out = pma_from_run(Path(last_rung), k, Path(out))
    for name in RECORDS:
        if (Path(last_rung) / name).exists():
            shutil.copyfile(Path(last_rung) / name, out / name)
    write_export_manifest(
        out
    )  # the copied held-out ids and data record are under the folder's checksums (EXPORT_FILES)
    return out


def final_checkpoint(run: Path, out: Path, cfg, k: int | None = None) -> Path:
    """`kiln pma` (the `checkpoint` node, composed with the last rung's config): the PMA of `run`'s last `k`
    step checkpoints, `train.pma_k` by default (at least its final one)."""
    return write_final_checkpoint(Path(run), k or max(cfg.train.pma_k, 1), Path(out))
