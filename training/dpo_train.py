"""Diffusion-DPO from a checkpoint on preference pairs (training/pairs.py), against a frozen reference.

Each step draws `dpo_batch` pairs, one timestep and one noise per pair shared by winner and loser (a pure
function of seed and step), and takes the loss of training/preference.py on the four velocity errors. Both
implicit likelihood terms are logged every step, winner and loser apart, and the divergence guard watches
them (`guard_action`: warn, or stop with DivergenceError). `winner_anchor` > 0 is the regularised variant.
`source="human"` trains on human labels only (calibration). One process; DCP resume as in GRPO.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from kiln.config import KilnConfig
from kiln.progress import log, progress
from training.data import DataPosition
from training.dcp import Checkpointer, RunState
from training.pairs import decode_png, read_pairs
from training.preference import DivergenceError, DivergenceGuard, dpo_loss, velocity_errors
from training.sde import conditioned

HISTORY = "dpo_history.jsonl"


def _seed(seed: int, step: int) -> int:
    return int.from_bytes(hashlib.sha256(f"dpo:{seed}:{step}".encode()).digest()[:8], "little") & (2**63 - 1)


def dpo(checkpoint: Path, pairs: Path, out: Path, cfg: KilnConfig, resume: bool = False, stop_at: int | None = None, source: str | None = None) -> Path:
    from model.generator import Generator
    from training.objective import sample_timesteps
    from training.sampling import checkpoint_resolution, sampling_shift

    post, out = cfg.post, Path(out)
    table = read_pairs(Path(pairs), source)
    if table.num_rows == 0:
        raise ValueError(f"{pairs}: no {'preference' if source is None else source} pairs to train on")
    device = torch.device(post.device)
    policy = Generator.from_pretrained(checkpoint, device=device)
    reference = Generator.from_pretrained(checkpoint, device=device).eval().requires_grad_(False)
    ae = policy.autoencoder
    winners = ae.encode(np.stack([decode_png(b) for b in table.column("winner_png").to_pylist()])).to(device)
    losers = ae.encode(np.stack([decode_png(b) for b in table.column("loser_png").to_pylist()])).to(device)
    prompts = table.column("prompt").to_pylist()
    h, w = checkpoint_resolution(Path(checkpoint), cfg)
    shift = sampling_shift(policy, h, w, cfg.train)
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=post.dpo_lr, weight_decay=0.0)
    ckpt = Checkpointer(out, keep=2, async_save=False, mesh_facts={"kind": "dpo"})
    run = (ckpt.load_latest(policy, opt) if resume else None) or RunState(0, DataPosition())
    out.mkdir(parents=True, exist_ok=True)
    history = out / HISTORY
    if not resume and history.exists():
        history.unlink()
    guard = DivergenceGuard(post.guard_patience, post.guard_action)
    if resume and history.exists():  # the guard's window continues where the run stopped
        for rec in [json.loads(x) for x in history.read_text().splitlines()][-post.guard_patience :]:
            guard.update(rec["step"], rec["winner_loglik"], rec["loser_loglik"])
    end = min(post.dpo_steps, stop_at) if stop_at is not None else post.dpo_steps
    policy.train()
    for step in progress(range(run.step, end), desc="dpo", unit="step", total=end - run.step):
        g = torch.Generator().manual_seed(_seed(post.seed, step))
        idx = torch.randint(0, table.num_rows, (min(post.dpo_batch, table.num_rows),), generator=g)
        x_w, x_l = winners[idx], losers[idx]
        eps = torch.randn(x_w.shape, generator=g).to(device)
        t = sample_timesteps(len(idx), g, cfg.train.timestep_mean, cfg.train.timestep_std, shift, device)
        text = policy.encode_text([prompts[i] for i in idx.tolist()])
        e_w = velocity_errors(conditioned(policy, text), x_w, eps, t)
        e_l = velocity_errors(conditioned(policy, text), x_l, eps, t)
        with torch.no_grad():
            e_w_ref = velocity_errors(conditioned(reference, text), x_w, eps, t)
            e_l_ref = velocity_errors(conditioned(reference, text), x_l, eps, t)
        terms = dpo_loss(e_w, e_l, e_w_ref, e_l_ref, post.dpo_beta, post.winner_anchor)
        opt.zero_grad(set_to_none=True)
        terms.loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, post.grad_clip))
        if not np.isfinite(grad_norm):
            raise FloatingPointError(f"DPO step {step}: non-finite gradient norm; lower post.dpo_lr")
        opt.step()
        done = step + 1
        record = {"step": done, "loss": terms.loss.item(), "winner_loglik": float(terms.winner_loglik.mean()), "loser_loglik": float(terms.loser_loglik.mean()),
                  "accuracy": terms.accuracy.item(), "grad_norm": grad_norm}  # fmt: skip
        try:
            warning = guard.update(done, record["winner_loglik"], record["loser_loglik"])
        except DivergenceError as e:
            record["guard"] = str(e)
            _append(history, record)
            ckpt.save(policy, opt, RunState(done, DataPosition()))
            ckpt.wait()
            raise
        if warning:
            record["guard"] = warning
            log.warning("dpo: %s", warning)
        _append(history, record)
        if done % post.save_every == 0 or done == end:
            ckpt.save(policy, opt, RunState(done, DataPosition()))
    ckpt.wait()
    policy.save_pretrained(out)
    state = Path(checkpoint) / "train_state.json"
    if state.exists():
        (out / "train_state.json").write_text(state.read_text())
    (out / "dpo.json").write_text(json.dumps({"from": str(checkpoint), "pairs": str(pairs), "rows": table.num_rows, "source": source, "steps": end,
                                              "guard_fired_at": guard.fired_at, "post": post.model_dump(mode="json")}, indent=2, sort_keys=True) + "\n")  # fmt: skip
    return out


def _append(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
