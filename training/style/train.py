"""Self-supervised style-reference training from a checkpoint (docs/style.md).

The checkpoint gets the reference pathway (`model.reference`: encoder, projector, reference tokens) if it
has none; its new weights are initialised from `style.seed` and written once as `out/start`, so a resumed
run and every rank start from the same model. Each step draws `style.batch_size` pairs (training/style/data.py:
a target, its prompt without the background, and a reference of the same style family or a crop of it) as
a pure function of (seed, step), and takes the flow-matching loss of the target given prompt and reference
at strength 1 (strength 0, i.e. no reference, for a `style.no_reference_prob` share). The whole model
trains. Runs on the post-training runner (training/post/runner.py): one process or FSDP2 (+ TP) ranks,
DCP checkpoints every `style.save_every` steps, and a killed run resumes to the same weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kiln.config import KilnConfig
from kiln.progress import log, progress
from model.flow import interpolate, velocity_target
from training.post.runner import iteration_seed, last_step, open_run
from training.style.data import style_pair

START = "start"


class PromptCache:
    """Text states per prompt, each encoded alone (so a value never depends on which prompts shared its
    batch, and a resumed run reads the same bits): the demo's prompts repeat, and the frozen backbone is
    most of a step's time on a CPU."""

    def __init__(self, gen):
        self.gen, self.states = gen, {}

    def __call__(self, prompts: list[str]):
        from model.text_encoder import TextBatch

        for p in prompts:
            if p not in self.states:
                self.states[p] = self.gen.encode_text([p])
        return TextBatch.cat([self.states[p] for p in prompts])


def start_checkpoint(checkpoint: Path, out: Path, cfg: KilnConfig, fresh: bool = True) -> Path:
    """The checkpoint itself when it has a reference pathway; else `out/start`: the checkpoint with the
    pathway of `cfg.model.reference` added, its new weights drawn from `style.seed`. A resumed run
    (`fresh=False`) keeps the start it began from; a fresh one writes it again (the checkpoint may have changed)."""
    from model.generator import Generator
    from training.core.checkpoint import STATE_FILE

    meta = json.loads((Path(checkpoint) / "config.json").read_text())
    if meta["model"].get("reference", {}).get("enabled"):
        return Path(checkpoint)
    start = Path(out) / START
    if not fresh and (start / "model.safetensors").exists():
        return start
    torch.manual_seed(cfg.style.seed)
    gen = Generator.from_pretrained(checkpoint).with_references(cfg.model.reference)
    tmp = Path(out) / f".{START}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    gen.save_pretrained(tmp)
    if (Path(checkpoint) / STATE_FILE).exists():
        shutil.copy2(Path(checkpoint) / STATE_FILE, tmp / STATE_FILE)
    shutil.rmtree(start, ignore_errors=True)  # only ever written here
    tmp.rename(start)
    return start


def style_train(
    checkpoint: Path,
    out: Path,
    cfg: KilnConfig,
    resume: bool = False,
    stop_at: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Train style references from `checkpoint` into `out` (model.safetensors + config.json with the
    pathway enabled, DCP step checkpoints, style_history.jsonl, style.json). A fresh run into a folder
    with an earlier run's checkpoints is refused unless `overwrite`."""
    from training.core.objective import sample_timesteps
    from training.core.runtime import prepare_output
    from training.evaluation.sampling import checkpoint_resolution, sampling_shift

    style, out = cfg.style, Path(out)
    if not (Path(checkpoint) / "config.json").exists():
        raise FileNotFoundError(f"{checkpoint} is not a checkpoint folder (no config.json)")
    if not overwrite:  # refused before `start` is drawn again; under overwrite open_run replaces the earlier run
        prepare_output(out, resume, overwrite=False)
    out.mkdir(parents=True, exist_ok=True)
    start = start_checkpoint(Path(checkpoint), out, cfg, fresh=not resume)
    B = style.batch_size
    with open_run("style", start, out, cfg, resume, style.lr, step_key="step", overwrite=overwrite) as run:
        mine = run.rows(B, "style.batch_size")
        policy, device = run.policy, run.device
        height, width = checkpoint_resolution(Path(checkpoint), cfg)
        shift = sampling_shift(policy, height, width, cfg.train)
        end = last_step(style.steps, stop_at)
        encode_text = PromptCache(policy)
        policy.train()
        for step in progress(range(run.start, end), desc="style", unit="step", total=end - run.start):
            rng = np.random.default_rng(iteration_seed(style.seed, step, "pairs"))
            pairs = [style_pair(rng, height, width, style.reference, style.crop_min) for _ in range(B)]
            strengths = (rng.random(B) >= style.no_reference_prob).astype(np.float32)
            g = torch.Generator().manual_seed(iteration_seed(style.seed, step, "noise"))
            x0 = policy.autoencoder.encode(np.stack([p.target for p in pairs]))
            eps = torch.randn(x0.shape, generator=g)
            t = sample_timesteps(B, g, cfg.train.timestep_mean, cfg.train.timestep_std, shift, "cpu")
            rows = range(B)[mine]
            x0, eps, t = x0[mine].to(device), eps[mine].to(device), t[mine].to(device)
            text = encode_text([pairs[i].prompt for i in rows])
            refs = policy.encode_references([[pairs[i].reference] for i in rows], [[float(strengths[i])] for i in rows])
            pred = policy(interpolate(x0, eps, t), t, text, refs=refs)
            loss = F.mse_loss(pred.float(), velocity_target(x0, eps).float())
            run.opt.zero_grad(set_to_none=True)
            (loss * run.share(mine, B)).backward()
            grad_norm = run.clip_grads(style.grad_clip)
            if not np.isfinite(grad_norm):
                raise FloatingPointError(f"style step {step}: non-finite gradient norm; lower style.lr")
            run.opt.step()
            done = step + 1
            (loss_sum,) = run.all_sum([loss.item() * len(rows)])
            run.step_done({"step": done, "loss": loss_sum / B, "grad_norm": grad_norm}, done, style.save_every, end)
            if run.ranks.rank == 0 and done % max(1, style.save_every) == 0:
                log.info("style %d: loss %.4f", done, loss_sum / B)
        record = {
            "from": str(checkpoint),
            "steps": end,
            "style": style.model_dump(mode="json"),
            "reference": policy.cfg.reference.model_dump(mode="json"),
        }
        return run.export(start, record)
