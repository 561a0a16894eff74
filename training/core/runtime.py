"""What every training entry point sets up before its loop: the process (threads, seeds, device, bf16 autocast),
the per-step RNG, the generator at initialisation, and the output folder (a fresh run never mixes with an
earlier run's checkpoints). The trainer, post-training, sampling and evaluation share it, so none of them
imports another's loop.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kiln.config import ModelConfig, TrainConfig
from kiln.progress import log


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    autocast_dtype: torch.dtype | None  # None: full fp32

    def autocast(self):
        """bf16 compute on a GPU (the weights stay fp32: PRX measured bf16-stored weights costing FID); fp32 on CPU."""
        if self.autocast_dtype is None:
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)


def setup_runtime(cfg: TrainConfig) -> Runtime:
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed % 2**32)
    device = torch.device(cfg.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"train.device={cfg.device} but no CUDA device is available")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    return Runtime(device, torch.bfloat16 if device.type == "cuda" else None)


def step_generator(seed: int, step: int) -> torch.Generator:
    """The RNG of one step, a pure function of (seed, step)."""
    state = np.random.SeedSequence([seed, step]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state) & (2**63 - 1))


def init_generator(model: ModelConfig, seed: int, device: torch.device | str = "cpu"):
    """The Generator at initialisation, seeded: the trainer's starting point and the evaluation's baseline."""
    from model.generator import Generator

    torch.manual_seed(seed)
    return Generator.build(model).to(device)


def earlier_checkpoints(out_dir: Path) -> list[Path]:
    """What an earlier run left in `out_dir` that a fresh run would replace: DCP step folders, an export."""
    out = Path(out_dir)
    found = sorted((out / "dcp").glob("step-*")) if (out / "dcp").is_dir() else []
    return found + ([out / "model.safetensors"] if (out / "model.safetensors").exists() else [])


def prepare_output(out_dir: Path, resume: bool, overwrite: bool, rank: int = 0) -> None:
    """A fresh run into a folder with checkpoints is refused unless `overwrite`: then (and only then) the
    earlier run's step checkpoints and exported files go, so none of them is resumed or mixed in later.
    A folder's other files are never touched. Every rank calls it (rank 0 deletes)."""
    import torch.distributed as dist

    from training.core.checkpoint import EXPORT_FILES, MANIFEST

    out_dir = Path(out_dir)
    if resume and overwrite:
        raise ValueError(
            "resume and overwrite exclude each other: --resume continues the run in the folder, --overwrite replaces it"
        )
    found = [] if resume else earlier_checkpoints(out_dir)
    if found and not overwrite:
        names = ", ".join(str(p.relative_to(out_dir)) for p in found[-3:])
        raise FileExistsError(
            f"{out_dir} holds checkpoints of an earlier run ({names}): pass --resume to continue it, or --overwrite to replace it (train(..., resume=True / overwrite=True))"
        )
    if found and rank == 0:
        log.warning("train: --overwrite: removing the earlier run's checkpoints in %s", out_dir)
        shutil.rmtree(out_dir / "dcp", ignore_errors=True)
        for name in (*EXPORT_FILES, MANIFEST):
            (out_dir / name).unlink(missing_ok=True)
    if dist.is_initialized():
        dist.barrier()


class NonFiniteTraining(RuntimeError):
    """The run diverged (non-finite loss, grad norm or weights): it stops, and nothing is exported."""


def require_finite_weights(gen, device: torch.device, refused: str) -> None:
    """Stop the run (NonFiniteTraining) before `refused` (a save, an export) writes NaN or inf weights anywhere."""
    if nonfinite_weights(gen, device):
        raise NonFiniteTraining(
            f"{refused} refused: the weights hold NaN or inf (the run diverged, or its start did: lower the LR, check the data and the checkpoint)"
        )


def nonfinite_weights(gen, device: torch.device) -> int:
    """How many parameter tensors hold a NaN or inf, summed over ranks (every rank must call it)."""
    import torch.distributed as dist

    bad = sum(not bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()) for p in gen.parameters())
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([bad], dtype=torch.int64, device=device)
        dist.all_reduce(t)
        bad = int(t.item())
    return bad
