"""Diffusion-DPO from a checkpoint on preference pairs (training/post/pairs.py), against a frozen reference.

Each step draws `dpo_batch` pairs, one timestep and one noise per pair shared by winner and loser (a pure
function of seed and step, for the whole batch), and takes the loss of training/post/preference.py on the four
velocity errors. Both implicit likelihood terms are logged every step, winner and loser apart, and the
divergence guard watches them (`guard_action`: warn, or stop with DivergenceError). `winner_anchor` > 0 is
the regularised variant. `source="human"` trains on human labels only (calibration).

Runs in one process or under torchrun / a Slurm job with FSDP2 (+ TP) like `kiln train`
(training/post/runner.py): each data-parallel rank takes its contiguous share of the step's pairs, and the
logged terms are global means, so every rank's guard sees the same numbers and stops with the others.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kiln.config import KilnConfig
from kiln.progress import log, progress
from training.post.pairs import decode_png, read_pairs
from training.post.preference import DivergenceError, DivergenceGuard, dpo_loss, velocity_errors
from training.post.runner import iteration_seed, last_step, open_run
from training.post.sde import conditioned

HISTORY = "dpo_history.jsonl"


def dpo(
    checkpoint: Path,
    pairs: Path,
    out: Path,
    cfg: KilnConfig,
    resume: bool = False,
    stop_at: int | None = None,
    source: str | None = None,
    overwrite: bool = False,
) -> Path:
    from training.core.objective import sample_timesteps
    from training.evaluation.sampling import checkpoint_resolution, sampling_shift

    post = cfg.post
    table = read_pairs(Path(pairs), source)
    if table.num_rows == 0:
        raise ValueError(f"{pairs}: no {'preference' if source is None else source} pairs to train on")
    batch = min(post.dpo_batch, table.num_rows)
    with open_run("dpo", checkpoint, out, cfg, resume, post.dpo_lr, step_key="step", overwrite=overwrite) as run:
        mine = run.rows(batch, "post.dpo_batch (capped at the pairs)")
        policy, reference, device = run.policy, run.frozen(checkpoint), run.device
        ae = policy.autoencoder
        winners = ae.encode(np.stack([decode_png(b) for b in table.column("winner_png").to_pylist()])).to(device)
        losers = ae.encode(np.stack([decode_png(b) for b in table.column("loser_png").to_pylist()])).to(device)
        prompts = table.column("prompt").to_pylist()
        h, w = checkpoint_resolution(Path(checkpoint), cfg)
        shift = sampling_shift(policy, h, w, cfg.train)
        guard = DivergenceGuard(post.guard_patience, post.guard_action)
        for rec in run.history()[-post.guard_patience :]:  # the guard's window continues where the run stopped
            guard.update(rec["step"], rec["winner_loglik"], rec["loser_loglik"])
        end = last_step(post.dpo_steps, stop_at)
        policy.train()
        for step in progress(range(run.start, end), desc="dpo", unit="step", total=end - run.start):
            g = torch.Generator().manual_seed(iteration_seed(post.seed, step, "dpo"))
            idx = torch.randint(0, table.num_rows, (batch,), generator=g)
            eps = torch.randn((batch, *winners.shape[1:]), generator=g)
            t = sample_timesteps(batch, g, cfg.train.timestep_mean, cfg.train.timestep_std, shift, device)
            local = idx[mine]
            x_w, x_l, eps, t = winners[local], losers[local], eps[mine].to(device), t[mine]
            text = policy.encode_text([prompts[i] for i in local.tolist()])
            e_w = velocity_errors(conditioned(policy, text), x_w, eps, t)
            e_l = velocity_errors(conditioned(policy, text), x_l, eps, t)
            with torch.no_grad():
                e_w_ref = velocity_errors(conditioned(reference, text), x_w, eps, t)
                e_l_ref = velocity_errors(conditioned(reference, text), x_l, eps, t)
            terms = dpo_loss(e_w, e_l, e_w_ref, e_l_ref, post.dpo_beta, post.winner_anchor)
            run.opt.zero_grad(set_to_none=True)
            (terms.loss * run.share(mine, batch)).backward()
            grad_norm = run.clip_grads(post.grad_clip)
            if not np.isfinite(grad_norm):
                raise FloatingPointError(f"DPO step {step}: non-finite gradient norm; lower post.dpo_lr")
            run.opt.step()
            done, n = step + 1, len(local)
            sums = run.all_sum(
                [terms.loss.item() * n, terms.winner_loglik.sum(), terms.loser_loglik.sum(), terms.accuracy.item() * n]
            )
            loss, winner, loser, accuracy = (s / batch for s in sums)
            record = {
                "step": done,
                "loss": loss,
                "winner_loglik": winner,
                "loser_loglik": loser,
                "accuracy": accuracy,
                "grad_norm": grad_norm,
            }
            try:
                warning = guard.update(done, winner, loser)
            except DivergenceError as e:
                run.append(record | {"guard": str(e)})
                run.save(done)
                run.ckpt.wait()
                raise
            if warning:
                record["guard"] = warning
                if run.ranks.rank == 0:
                    log.warning("dpo: %s", warning)
            run.step_done(record, done, post.save_every, end)
        record = {
            "from": str(checkpoint),
            "pairs": str(pairs),
            "rows": table.num_rows,
            "source": source,
            "steps": end,
            "guard_fired_at": guard.fired_at,
            "post": post.model_dump(mode="json"),
        }
        return run.export(checkpoint, record)
