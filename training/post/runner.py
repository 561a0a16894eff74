"""One runner for post-training loops (Diffusion-DPO, Flow-GRPO, TDM distillation): their shared setup and
export, under the trainer's parallelism.

    with open_run("dpo", checkpoint, out, cfg, resume, lr=post.dpo_lr, step_key="step") as run:
        reference = run.frozen(checkpoint)
        for step in range(run.start, end):  ...  run.append(record); run.save(step + 1)
        run.export(checkpoint, record)

  * Ranks as in `kiln train` (training/core/distributed.py): a launcher's environment (torchrun, a Slurm task)
    makes every rank join the job's group and build the ("dp_shard", "tp") mesh of `train.parallel`;
    without one it is a plain single process, no group, no mesh.
  * The policy is loaded from a checkpoint folder and parallelized with the trainer's `parallelize`
    (FSDP2 over dp_shard, TP over tp); frozen copies (a reference, a teacher) the same way, without grads.
  * Further trained copies of the checkpoint (`trained`: TDM's fake score), parallelized like the policy,
    each with an AdamW of its own learning rate; the Checkpointer saves and restores them as its `aux`.
  * AdamW (`weight_decay`, 0 unless given), a DCP Checkpointer (training/core/dcp.py) recording the kind and
    layout, and resume from its newest good step. The history (JSON lines) is appended by rank 0; a resume drops lines past the resumed step.
  * The export is the trainer's: weights gathered to the canonical single-process layout (rank 0 writes
    model.safetensors), train_state.json copied from the start checkpoint, a `<kind>.json` record, and the
    checksums (write_export_manifest) last.

Rank-count invariance: a loop draws each step's randomness for the global batch from `iteration_seed(seed,
it, what)`, a pure function; each data-parallel rank keeps its rows (`run.rows`), and scales its local mean
loss by `run.share` so FSDP's gradient average over dp is the global mean. N ranks then compute what one
process does, to float rounding (tests/test_posttrain_run.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kiln.config import KilnConfig
from kiln.progress import log
from training.core.data import DataPosition
from training.core.dcp import Checkpointer, RunState
from training.core.distributed import Ranks


def iteration_seed(seed: int, it: int, what: str) -> int:
    """The seed of one kind of draw (`what`) at step / iteration `it`: a pure function, so a resumed run and
    any number of ranks draw what one uninterrupted process draws."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{it}:{what}".encode()).digest()[:8], "little") & (2**63 - 1)


def last_step(total: int, stop_at: int | None) -> int:
    """Where this call stops: the run's length, or earlier at `stop_at` (a pre-emption, a test's kill)."""
    return total if stop_at is None else min(total, stop_at)


@dataclass
class PostRun:
    kind: str  # "dpo", "grpo", "tdm": names the history, the record and the checkpoints' kind
    out: Path
    cfg: KilnConfig
    device: torch.device
    mesh: object | None  # the ("dp_shard", "tp") DeviceMesh, or None in one process
    ranks: Ranks
    policy: torch.nn.Module  # the parallelized Generator being trained
    opt: torch.optim.Optimizer
    ckpt: Checkpointer
    start: int  # the step (iteration) this call starts at: 0, or the resumed one
    step_key: str  # the history field holding the step number
    trained: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = field(
        default_factory=dict
    )  # further trained copies, by name

    @property
    def history_path(self) -> Path:
        return self.out / f"{self.kind}_history.jsonl"

    def frozen(self, checkpoint: Path):
        """A frozen copy of a checkpoint (the reference, a teacher), parallelized like the policy; every rank calls it."""
        from model.generator import Generator
        from training.core.parallel import parallelize

        gen = Generator.from_pretrained(checkpoint, device=self.device).eval().requires_grad_(False)
        return parallelize(gen, self.mesh, self.cfg.train.parallel, self.device.type)

    def rows(self, n: int, what: str) -> slice:
        """This rank's contiguous share of `n` global items (`what` names them in the error when too few)."""
        from training.core.data import local_rows

        if n < self.ranks.dp_size:
            raise ValueError(
                f"{self.kind}: {what}={n} cannot be split over {self.ranks.dp_size} data-parallel ranks: use at least {self.ranks.dp_size}, or fewer ranks"
            )
        return local_rows(n, self.ranks.dp_rank, self.ranks.dp_size)

    def share(self, rows: slice, n: int) -> float:
        """The factor turning this rank's mean over `rows` into its part of the global mean of `n` items,
        times dp (FSDP averages gradients over dp): 1.0 in one process."""
        return (rows.stop - rows.start) * self.ranks.dp_size / n

    def all_sum(self, values: list[float]) -> list[float]:
        """Per-rank sums added over the data-parallel ranks (identical on every rank)."""
        from training.core.distributed import all_reduce_sum

        return all_reduce_sum([float(v) for v in values], self.device, self.ranks.dp_size)

    def clip_grads(self, max_norm: float, module: torch.nn.Module | None = None) -> float:
        """The global gradient norm (DTensor-aware, the trainer's) of the policy's (or `module`'s)
        parameters, clipped to `max_norm`."""
        from training.core.distributed import grad_norm_and_clip

        return grad_norm_and_clip([p for p in (module or self.policy).parameters() if p.requires_grad], max_norm)

    def history(self) -> list[dict]:
        path = self.history_path
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def append(self, record: dict) -> None:
        if self.ranks.rank == 0:
            with self.history_path.open("a") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")

    def save(self, step: int) -> None:
        self.ckpt.save(self.policy, self.opt, RunState(step, DataPosition()))

    def step_done(self, record: dict, done: int, save_every: int, end: int) -> None:
        """The end of every loop's step: its history line, and a checkpoint every `save_every` steps and at the end."""
        self.append(record)
        if done % save_every == 0 or done == end:
            self.save(done)

    def export(self, checkpoint: Path, record: dict) -> Path:
        """The single-process checkpoint folder in `out` (what sampling, evaluation and the next stage read):
        weights gathered to the canonical layout, the start's train_state.json, `<kind>.json`, checksums last."""
        from model.generator import Generator
        from training.core.checkpoint import STATE_FILE, write_export_manifest
        from training.core.distributed import full_model_state
        from training.core.runtime import require_finite_weights

        self.ckpt.wait()
        require_finite_weights(
            self.policy, self.device, f"{self.kind}: the export to {self.out}"
        )  # every rank answers: one rank's NaN stops them all
        plain = self.policy
        if self.mesh is not None:
            state = full_model_state(self.policy, self.cfg.train.parallel.tp)  # every rank takes part; rank 0 receives
            if self.ranks.rank == 0:
                plain = Generator.from_pretrained(checkpoint)
                plain.load_state_dict(state, strict=True)
        if self.ranks.rank == 0:
            plain.save_pretrained(self.out)
            state_file = Path(checkpoint) / STATE_FILE
            if (
                state_file.exists()
            ):  # the evaluation and sampler read the bucket and config the checkpoint was trained at
                (self.out / STATE_FILE).write_text(state_file.read_text())
            layout = {"world_size": self.ranks.world, "tp": self.cfg.train.parallel.tp}
            (self.out / f"{self.kind}.json").write_text(
                json.dumps(record | {"parallel": layout}, indent=2, sort_keys=True) + "\n"
            )
            write_export_manifest(self.out)  # last: the folder is complete when its checksums are
        _barrier()
        return self.out


@contextmanager
def open_run(
    kind: str,
    checkpoint: Path,
    out: Path,
    cfg: KilnConfig,
    resume: bool,
    lr: float,
    step_key: str,
    weight_decay: float = 0.0,
    trained: dict[str, float] | None = None,
    overwrite: bool = False,
) -> Iterator[PostRun]:
    """Join the job's ranks, load and parallelize the policy from `checkpoint`, make its optimiser and
    Checkpointer, resume (`resume=True`) from the newest good step in `out/dcp`, and start or trim the
    history. `trained`: {name: lr} of further copies of `checkpoint` trained alongside (`run.trained`),
    checkpointed and resumed with the policy. A fresh run into a folder with an earlier run's checkpoints
    is refused (FileExistsError) unless `overwrite`, as `kiln train` does: its saves would replace them.
    On the way out a pending save is finished and a process group this call made is destroyed."""
    import torch.distributed as dist

    from model.generator import Generator
    from training.core.distributed import build_ranks, init_distributed
    from training.core.parallel import parallelize
    from training.core.runtime import prepare_output, setup_runtime

    post, out, parallel = cfg.post, Path(out), cfg.train.parallel
    runtime = setup_runtime(cfg.train.model_copy(update={"device": post.device, "seed": post.seed}))
    created = init_distributed(runtime.device.type)
    ckpt = None
    try:
        mesh, ranks = build_ranks(parallel.tp, runtime.device.type)
        prepare_output(out, resume, overwrite, ranks.rank)  # before any save could replace an earlier run's steps

        def model_and_opt(rate: float):
            module = parallelize(
                Generator.from_pretrained(checkpoint, device=runtime.device), mesh, parallel, runtime.device.type
            )
            return module, torch.optim.AdamW(
                [p for p in module.parameters() if p.requires_grad], lr=rate, weight_decay=weight_decay
            )

        policy, opt = model_and_opt(lr)
        extra = {name: model_and_opt(rate) for name, rate in (trained or {}).items()}
        ckpt = Checkpointer(
            out,
            keep=2,
            async_save=False,
            mesh_facts={"kind": kind, "tp": parallel.tp, "world_size": ranks.world},
            aux=extra,
        )
        start = (ckpt.load_latest(policy, opt) if resume else None) or RunState(0, DataPosition())
        run = PostRun(kind, out, cfg, runtime.device, mesh, ranks, policy, opt, ckpt, start.step, step_key, extra)
        if ranks.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            _restart_history(run, resume)
            log.info(
                "%s: %d ranks (dp_shard %d x tp %d), steps from %d",
                kind,
                ranks.world,
                ranks.dp_size,
                parallel.tp,
                run.start,
            )
        _barrier()
        yield run
    except BaseException:
        if ckpt is not None:  # let a pending save of an earlier, good step finish, without collectives
            try:
                ckpt.close()
            except Exception as e:  # noqa: BLE001 (whatever it is, the original error matters more)
                log.warning("%s: the pending checkpoint save failed too: %s", kind, e)
        raise
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _restart_history(run: PostRun, resume: bool) -> None:
    """A fresh run starts an empty history; a resumed one keeps the lines up to the step it resumes at
    (a run killed between checkpoints wrote lines that the resumed run writes again)."""
    path = run.history_path
    if not resume:
        path.unlink(missing_ok=True)
    elif path.exists():
        kept = [line for line in path.read_text().splitlines() if json.loads(line)[run.step_key] <= run.start]
        path.write_text("".join(line + "\n" for line in kept))


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
