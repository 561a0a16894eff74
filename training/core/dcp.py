"""Sharded, exact-resume checkpoints with torch.distributed.checkpoint (DCP).

    out/dcp/step-000040/   .metadata + one shard file per rank: model, optimiser, and `extra`:
                           step, data position, loss EMA and every rank's CPU RNG state (as tensors)
    out/dcp/step-000040/train_state.json   the same step / position in words, the mesh it was saved on and
                                           the train set's version (a resume on other data is refused)
    out/dcp/step-000040/checksums-rankNNNNN.json   each rank's files with size and sha256, signed (training/core/manifest.py)

The LR scheduler is a pure function of the step (training.core.schedules.wsd_lr) and a step's noise / timesteps
/ caption dropout a pure function of (seed, step), so step + data position + RNG is the whole run state:
a run killed at step k and resumed draws and computes exactly what the uninterrupted run did.

Saves are asynchronous (`dcp.async_save`: tensors are staged to CPU, the write runs in a thread). When a
save's write finishes, its own background thread hashes the files into the manifests and writes
train_state.json last: a save is complete when train_state.json (and .metadata) exist, and only then are
older ones beyond `keep` deleted. A resume verifies the newest complete checkpoint's manifests (signed by
this user's key, or trusted by `train.dcp.trust_unsigned`) and every file's checksum before DCP reads a
byte, falls back to the one before if it is corrupt, and reads DCP's pickled metadata with a restricted
unpickler (training/core/dcp_safe.py). The model's fused
TP weights are stored in the rank-major layout of the saving run's tp degree (training/core/parallel.py):
resume with the same parallel.tp; exports (model.safetensors) are always in the canonical layout.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from kiln.progress import log
from training.core.data import DataPosition
from training.core.dcp_safe import safe_load
from training.core.manifest import (
    CheckpointCorrupt,
    CheckpointUntrusted,
    read_manifest,
    signing_key,
    verify_files,
    write_manifest,
)

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
        "shard": torch.tensor(run.position.shard),
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


class ResumeMismatch(ValueError):
    """The checkpoint was saved by another kind of run (layout, train set) than the one resuming it."""


@dataclass(frozen=True)
class LoadPolicy:
    """What a resume may accept beyond checkpoints this kiln signed, of this run's train set."""

    trust_unsigned: bool = False  # load checkpoints whose manifests another key signed, or that have none
    allow_train_set_change: bool = False  # continue on another train set than the checkpoint saw


def manifest_name(rank: int) -> str:
    return f"checksums-rank{rank:05d}.json"


def verify_step(path: Path, key: bytes, trust_unsigned: bool = False, rank: int = 0, world: int = 1) -> None:
    """Raise CheckpointUntrusted / CheckpointCorrupt unless the step checkpoint `path` is one kiln wrote and
    intact. Every rank's manifest is read; this rank hashes its share (every `world`-th file)."""
    try:
        saved_world = int(json.loads((path / META).read_text()).get("world_size", 1))
    except (OSError, ValueError) as e:
        raise CheckpointCorrupt(f"{path / META}: unreadable ({e})") from None
    files: dict[str, dict] = {}
    for r in range(saved_world):
        try:
            files |= read_manifest(path / manifest_name(r), key, trust_unsigned)["files"]
        except CheckpointUntrusted:
            if not trust_unsigned:
                raise
            log.warning(
                "%s: no checksums for rank %d's files (trusted by train.dcp.trust_unsigned, not verified)", path, r
            )
    names = sorted(files)
    verify_files(path, {"files": {n: files[n] for n in names[rank::world]}})


class StepWriter(FileSystemWriter):
    """DCP's file writer whose `.metadata` names the step alone. DCP's own records a random save id and the
    folder's path there, so two runs of one config wrote different bytes and DVC could not pin a training
    stage (README, DVC); the rank files never differed."""

    def __init__(self, path: Path):
        super().__init__(str(path))
        self._name = Path(path).name

    def reset(self, checkpoint_id=None) -> None:
        super().reset(checkpoint_id)
        self.save_id = self._name

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=self._name, save_id=self._name)


class Checkpointer:
    """Saves step checkpoints (async when configured), keeps the last `keep`, loads the newest good one.

    A save is marked complete (its checksum manifests, then train_state.json) as soon as its write is on
    disk: in the save's own background thread, not when the next save starts, so a run killed between
    saves resumes from the newest one it wrote. The thread does file work only, no collectives."""

    def __init__(
        self,
        out_dir: Path,
        keep: int = 3,
        async_save: bool = True,
        mesh_facts: dict | None = None,
        aux: dict | None = None,
        train_set_version: str | None = None,
        policy: LoadPolicy = LoadPolicy(),
    ):
        """`aux`: {name: (module, optimiser)} saved and restored with the model (trained parts that are
        not the Generator's, such as the REPA projector). `train_set_version` is recorded with each save
        and must match on resume (unless `policy` allows a change)."""
        self.out_dir, self.keep, self.async_save = Path(out_dir), keep, async_save
        self.mesh_facts = mesh_facts or {}
        self.aux = aux or {}
        self.train_set_version = train_set_version
        self.policy = policy
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._key = self._shared_key()

    def _shared_key(self) -> bytes:
        """Rank 0's signing key on every rank, so a job signs and verifies with one key however many nodes it spans."""
        box = [signing_key() if _rank() == 0 else None]
        if dist.is_initialized() and _world() > 1:
            dist.broadcast_object_list(box, src=0, group=self._cpu_group())
        return box[0]

    def save(self, model, opt, run: RunState) -> Path:
        self.wait()
        path = step_dir(self.out_dir, run.step)
        if (
            _rank() == 0 and path.exists()
        ):  # an earlier attempt at this step (killed mid-save, or corrupt): not a byte of it stays
            shutil.rmtree(path)  # peers write only after rank 0 has planned (and made the folder again)
        state = _state(model, opt, run, self.aux)
        if self.async_save:
            future = dcp.async_save(
                state,
                checkpoint_id=str(path),
                storage_writer=StepWriter(path),
                process_group=self._cpu_group(),
                no_dist=not dist.is_initialized(),
            )
            self._thread = threading.Thread(
                target=self._complete_when_written, args=(future, path, run), name=f"kiln-dcp-{run.step}", daemon=True
            )
            self._thread.start()
        else:
            dcp.save(state, checkpoint_id=str(path), storage_writer=StepWriter(path), no_dist=not dist.is_initialized())
            self._complete(path, run)
        return path

    def _cpu_group(self):
        """A gloo group of the checkpointer's own, made once (in __init__, on every rank): an async save's
        collectives run in its thread while training's run on the default group, and two threads must
        never share one group (gloo then mixes their messages up)."""
        if not dist.is_initialized() or _world() == 1:
            return None
        if not hasattr(self, "_gloo"):
            self._gloo = dist.new_group(backend="gloo")
        return self._gloo

    def _complete_when_written(self, future, path: Path, run: RunState) -> None:
        try:
            future.result()
            self._complete(path, run)
        except BaseException as e:  # re-raised by wait() in the training thread
            self._error = e

    def _complete(self, path: Path, run: RunState) -> None:
        """This rank's manifest; on rank 0, once every rank's is there, its own and train_state.json (the
        completion mark, written last), then the pruning of older checkpoints beyond `keep`."""
        rank, world = _rank(), _world()
        shards = sorted(p.name for p in path.glob(f"__{rank}_*.distcp"))
        if rank != 0:
            write_manifest(path, manifest_name(rank), shards, self._key, {"step": run.step, "rank": rank})
            return
        _await_manifests(path, range(1, world))
        meta = {
            "step": run.step,
            "position": run.position.to_dict(),
            "loss_ema": run.loss_ema,
            "last_loss": run.last_loss,
            "world_size": world,
            "train_set_version": self.train_set_version,
        } | self.mesh_facts
        text = (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode()
        write_manifest(
            path,
            manifest_name(0),
            [*shards, ".metadata"],
            self._key,
            {"step": run.step, "rank": 0},
            pending={META: text},
        )
        tmp = path / f".{META}.tmp"
        tmp.write_bytes(text)
        os.replace(tmp, path / META)
        for old in complete_checkpoints(self.out_dir)[: -self.keep]:
            shutil.rmtree(old)

    def wait(self) -> None:
        """Block until the pending save is complete on every rank (raising its error, if it failed)."""
        if self._thread is None:
            return
        self.close()
        if dist.is_initialized():
            dist.barrier()

    def close(self) -> None:
        """Let the pending save finish (no collectives: also safe on a failing rank); raise its error."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def load_latest(self, model, opt) -> RunState | None:
        """Restore model, optimiser and RNG from the newest complete checkpoint that verifies; None when
        there is none. A corrupt or unsigned newest one is skipped with a warning for the one before it."""
        candidates = complete_checkpoints(self.out_dir)
        if not candidates:
            return None
        problems = []
        for path in reversed(candidates):
            problem = self._check(path)
            if problem is None:
                break
            problems.append(problem)
            log.warning("resume: skipping %s: %s", path.name, problem)
        else:
            hint = (
                ""
                if self.policy.trust_unsigned
                else " (checkpoints from elsewhere: train.dcp.trust_unsigned=true, see docs/training.md)"
            )
            raise CheckpointCorrupt(
                f"no checkpoint in {self.out_dir / DCP_DIR} can be resumed{hint}:\n  " + "\n  ".join(problems)
            )
        if problems and _rank() == 0:
            log.warning("resume: falling back to %s", path.name)
        meta = json.loads((path / META).read_text())
        resharded = self._check_layout(path, meta)
        self._check_train_set(path, meta.get("train_set_version"))
        state = _state(model, opt, RunState(0, DataPosition()), self.aux)
        if resharded:  # another number of ranks: DCP reshards weights and moments; per-rank RNG states do not map
            for key in [k for k in state["extra"] if k.startswith("rng_")]:
                del state["extra"][key]
        safe_load(state, path, no_dist=not dist.is_initialized())
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for name, (module, module_opt) in self.aux.items():
            set_state_dict(
                module,
                module_opt,
                model_state_dict=state[f"aux_{name}_model"],
                optim_state_dict=state[f"aux_{name}_optim"],
            )
        extra = state["extra"]
        if f"rng_cpu_rank{_rank()}" in extra:
            torch.set_rng_state(extra[f"rng_cpu_rank{_rank()}"])
        if f"rng_cuda_rank{_rank()}" in extra:
            torch.cuda.set_rng_state(extra[f"rng_cuda_rank{_rank()}"])

        def opt_float(t):
            v = float(t)
            return None if math.isnan(v) else v

        position = DataPosition(int(extra["epoch"]), int(extra["shard"]), int(extra["batch"]))
        return RunState(int(extra["step"]), position, opt_float(extra["loss_ema"]), opt_float(extra["last_loss"]))

    def _check_layout(self, path: Path, meta: dict) -> bool:
        """Refuse another tensor-parallel degree or optimiser; another number of data-parallel ranks is a
        resharded resume (True): the data stream's position is global (training.core.data), so the run
        continues with the next global batch. Not with an EMA, whose shards are each rank's own."""
        for key, value in self.mesh_facts.items():
            if meta.get(key) == value or (key == "world_size" and "ema" not in self.aux):
                continue
            raise ResumeMismatch(
                f"{path} was saved with {key}={meta.get(key)}, this run has {value}: resume with the same layout"
            )
        resharded = meta.get("world_size") != self.mesh_facts.get("world_size")
        if resharded and _rank() == 0:
            log.warning(
                "resume: %s was saved on %s ranks, this run has %s: resharded by DCP",
                path.name,
                meta.get("world_size"),
                self.mesh_facts.get("world_size"),
            )
        return resharded

    def _check(self, path: Path) -> str | None:
        """Why `path` cannot be resumed (None: it can); every rank gets the same answer."""
        problem = None
        try:
            verify_step(path, self._key, self.policy.trust_unsigned, _rank(), _world())
        except (CheckpointCorrupt, CheckpointUntrusted) as e:
            problem = str(e)
        if dist.is_initialized() and _world() > 1:
            bad = torch.tensor([problem is not None], dtype=torch.int64)
            dist.all_reduce(bad, group=self._cpu_group())
            if bad.item() and problem is None:
                problem = "another rank found a file of it corrupt (see that rank's log)"
        return problem

    def _check_train_set(self, path: Path, saved: str | None) -> None:
        if self.train_set_version is None or saved == self.train_set_version:
            return
        what = (
            f"{path} was trained on train set {saved or 'of unknown version'}, this run reads {self.train_set_version}"
        )
        if not self.policy.allow_train_set_change:
            raise ResumeMismatch(
                f"{what}: resume on the data it was trained on, or set train.dcp.allow_train_set_change=true to continue on this one"
            )
        if _rank() == 0:
            log.warning("resume: %s (allowed by train.dcp.allow_train_set_change)", what)


def _await_manifests(path: Path, ranks, timeout_s: float = 1800.0) -> None:
    """Rank 0 waits (on the file system, no collectives) for the other ranks' manifests of this save."""
    deadline = time.monotonic() + timeout_s
    for r in ranks:
        while not (path / manifest_name(r)).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path}: rank {r} wrote no checksum manifest within {timeout_s:.0f} s")
            time.sleep(0.05)
