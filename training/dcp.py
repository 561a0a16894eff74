"""Sharded, exact-resume checkpoints with torch.distributed.checkpoint (DCP).

    out/dcp/step-000040/   .metadata + one shard file per rank: model, optimiser, and `extra`:
                           step, data position, loss EMA and every rank's CPU RNG state (as tensors)
    out/dcp/step-000040/train_state.json   the same step / position in words, the mesh it was saved on

The LR scheduler is a pure function of the step (training.schedules.wsd_lr) and a step's noise / timesteps
/ caption dropout a pure function of (seed, step), so step + data position + RNG is the whole run state:
a run killed at step k and resumed draws and computes exactly what the uninterrupted run did.

Saves are asynchronous (`dcp.async_save`: tensors are staged to CPU, the write runs in a thread); a save is
complete when its .metadata exists, and only then are older ones beyond `keep` deleted. The model's fused
TP weights are stored in the rank-major layout of the saving run's tp degree (training/parallel.py):
resume with the same parallel.tp; exports (model.safetensors) are always in the canonical layout.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from training.data import DataPosition

DCP_DIR = "dcp"
META = "train_state.json"


@dataclass(frozen=True)
class RunState:
    step: int
    position: DataPosition
    loss_ema: float | None = None
    last_loss: float | None = None


def step_dir(out_dir: Path, step: int) -> Path:
    return Path(out_dir) / DCP_DIR / f"step-{step:06d}"


def complete_checkpoints(out_dir: Path) -> list[Path]:
    """Finished step checkpoints (with DCP's .metadata and our train_state.json), oldest first."""
    root = Path(out_dir) / DCP_DIR
    if not root.exists():
        return []
    return sorted(d for d in root.glob("step-*") if (d / ".metadata").exists() and (d / META).exists())


def latest_checkpoint(out_dir: Path) -> Path | None:
    done = complete_checkpoints(out_dir)
    return done[-1] if done else None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _state(model, opt, run: RunState, aux: dict | None = None) -> dict:
    model_sd, optim_sd = get_state_dict(model, opt)
    extra = {
        "step": torch.tensor(run.step),
        "epoch": torch.tensor(run.position.epoch),
        "batch": torch.tensor(run.position.batch),
        "loss_ema": torch.tensor(float("nan") if run.loss_ema is None else run.loss_ema, dtype=torch.float64),
        "last_loss": torch.tensor(float("nan") if run.last_loss is None else run.last_loss, dtype=torch.float64),
        f"rng_cpu_rank{_rank()}": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        extra[f"rng_cuda_rank{_rank()}"] = torch.cuda.get_rng_state()
    state = {"model": model_sd, "optim": optim_sd, "extra": extra}
    for name, (module, module_opt) in (aux or {}).items():  # e.g. the REPA projector and its optimiser
        state[f"aux_{name}_model"], state[f"aux_{name}_optim"] = get_state_dict(module, module_opt)
    return state


class Checkpointer:
    """Saves step checkpoints (async when configured), keeps the last `keep`, loads the latest."""

    def __init__(self, out_dir: Path, keep: int = 3, async_save: bool = True, mesh_facts: dict | None = None, aux: dict | None = None):
        """`aux`: {name: (module, optimiser)} saved and restored with the model (trained parts that are
        not the Generator's, such as the REPA projector)."""
        self.out_dir, self.keep, self.async_save = Path(out_dir), keep, async_save
        self.mesh_facts = mesh_facts or {}
        self.aux = aux or {}
        self._pending = None  # (future, directory, run state)

    def save(self, model, opt, run: RunState) -> Path:
        self.wait()
        path = step_dir(self.out_dir, run.step)
        state = _state(model, opt, run, self.aux)
        if self.async_save:
            self._pending = (dcp.async_save(state, checkpoint_id=str(path), process_group=self._cpu_group(), no_dist=not dist.is_initialized()), path, run)
        else:
            dcp.save(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
            self._finish(path, run)
        return path

    def _cpu_group(self):
        """Async saves coordinate over a CPU (gloo) group; made once when the job's backend is NCCL."""
        if not dist.is_initialized() or dist.get_backend() == "gloo":
            return None
        if not hasattr(self, "_gloo"):
            self._gloo = dist.new_group(backend="gloo")
        return self._gloo

    def wait(self) -> None:
        """Block until the pending async save is on disk, then record it and prune old ones."""
        if self._pending is None:
            return
        future, path, run = self._pending
        future.result()
        self._pending = None
        self._finish(path, run)

    def _finish(self, path: Path, run: RunState) -> None:
        if dist.is_initialized():
            dist.barrier()
        if _rank() == 0:
            meta = {"step": run.step, "position": run.position.to_dict(), "loss_ema": run.loss_ema, "last_loss": run.last_loss, "world_size": _world()} | self.mesh_facts
            (path / META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
            for old in complete_checkpoints(self.out_dir)[: -self.keep]:
                shutil.rmtree(old)
        if dist.is_initialized():
            dist.barrier()

    def load_latest(self, model, opt) -> RunState | None:
        """Restore model, optimiser and RNG from the newest complete checkpoint; None when there is none."""
        path = latest_checkpoint(self.out_dir)
        if path is None:
            return None
        meta = json.loads((path / META).read_text())
        for key, value in self.mesh_facts.items():
            if meta.get(key) != value:
                raise ValueError(f"{path} was saved with {key}={meta.get(key)}, this run has {value}: resume with the same layout")
        state = _state(model, opt, RunState(0, DataPosition()), self.aux)
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for name, (module, module_opt) in self.aux.items():
            set_state_dict(module, module_opt, model_state_dict=state[f"aux_{name}_model"], optim_state_dict=state[f"aux_{name}_optim"])
        extra = state["extra"]
        torch.set_rng_state(extra[f"rng_cpu_rank{_rank()}"])
        if f"rng_cuda_rank{_rank()}" in extra:
            torch.cuda.set_rng_state(extra[f"rng_cuda_rank{_rank()}"])

        def opt_float(t):
            v = float(t)
            return None if math.isnan(v) else v

        position = DataPosition(int(extra["epoch"]), int(extra["batch"]))
        return RunState(int(extra["step"]), position, opt_float(extra["loss_ema"]), opt_float(extra["last_loss"]))
