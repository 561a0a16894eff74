"""Flow-GRPO: RL of a checkpoint on rubric (and other) rewards, without CFG, against a frozen reference.

Each iteration draws `prompts_per_iter` prompts (a pure function of seed and iteration), samples
`group_size` images per prompt with the SDE sampler (training/sde.py) from the current policy, scores them
with the reward mix, and standardises the rewards within each prompt's group (training/grpo.py). The update
re-scores every stochastic step of the rollouts under the policy with grad: the clipped ratio objective
plus `kl` times the KL of each step to the reference's step. Randomness is a pure function of (seed,
iteration), and DCP checkpoints (training/dcp.py) hold model, optimiser and iteration, so a killed run
resumes to the same weights as an uninterrupted one.

This loop runs in one process (CPU or one GPU); spreading rollouts over ranks under FSDP2 + TP is the
trainer's machinery and is not wired here yet (docs/post-training.md says what is missing).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch

from kiln.config import ConfigError, KilnConfig
from kiln.progress import log, progress
from training.data import DataPosition
from training.dcp import Checkpointer, RunState
from training.grpo import clipped_policy_loss, gaussian_kl, group_advantages
from training.rubric import RubricPrompt, demo_rl_prompts, read_prompt_set
from training.sde import conditioned, rollout, step_logprob

HISTORY = "grpo_history.jsonl"


def iteration_seed(seed: int, iteration: int, what: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{iteration}:{what}".encode()).digest()[:8], "little") & (2**63 - 1)


def rl_prompts(cfg: KilnConfig) -> list[RubricPrompt]:
    """The prompt set RL draws from: `post.prompts`, else the demo grammar's prompts outside the evaluation's."""
    return read_prompt_set(Path(cfg.post.prompts)) if cfg.post.prompts else demo_rl_prompts(256, cfg.post.seed)


def check_post_config(cfg: KilnConfig) -> None:
    from training.rewards import post_problems

    if problems := post_problems(cfg.post):
        raise ConfigError("post-training cannot run:\n" + "\n".join(f"  {k}: {why}" for k, why in problems))


def grpo(checkpoint: Path, out: Path, cfg: KilnConfig, resume: bool = False, stop_at: int | None = None, mix=None) -> Path:
    """RL from `checkpoint` into `out` (model.safetensors + config.json, DCP step checkpoints, history).
    `mix`: a training.rewards.RewardMix to use instead of the configured `post.rewards`."""
    from model.generator import Generator
    from training.rewards import make_reward_mix
    from training.sampling import checkpoint_resolution, sampling_shift

    check_post_config(cfg)
    post, out = cfg.post, Path(out)
    device = torch.device(post.device)
    policy = Generator.from_pretrained(checkpoint, device=device)
    reference = Generator.from_pretrained(checkpoint, device=device).eval().requires_grad_(False)
    height, width = (post.resolution, post.resolution) if post.resolution else checkpoint_resolution(Path(checkpoint), cfg)
    shift = sampling_shift(policy, height, width, cfg.train)
    ds = policy.autoencoder.downsample
    prompts = rl_prompts(cfg)
    mix = mix or make_reward_mix(post)
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=post.lr, betas=(0.9, 0.999), weight_decay=0.0)
    ckpt = Checkpointer(out, keep=2, async_save=False, mesh_facts={"kind": "grpo"})
    run = (ckpt.load_latest(policy, opt) if resume else None) or RunState(0, DataPosition())
    out.mkdir(parents=True, exist_ok=True)
    history = out / HISTORY
    if not resume and history.exists():
        history.unlink()
    end = min(post.iterations, stop_at) if stop_at is not None else post.iterations
    G, P = post.group_size, post.prompts_per_iter
    for it in progress(range(run.step, end), desc="grpo", unit="iter", total=end - run.step):
        t0 = time.perf_counter()
        pick = np.random.default_rng(iteration_seed(post.seed, it, "prompts")).choice(len(prompts), size=min(P, len(prompts)), replace=False)
        chosen = [prompts[i] for i in pick]
        text = policy.encode_text([p.prompt for p in chosen for _ in range(G)])
        noise = torch.randn(len(chosen) * G, policy.autoencoder.latent_channels, height // ds, width // ds, generator=torch.Generator().manual_seed(iteration_seed(post.seed, it, "noise"))).to(device)
        policy.eval()
        traj = rollout(conditioned(policy, text), noise, post.sample_steps, shift, post.eta, torch.Generator().manual_seed(iteration_seed(post.seed, it, "sde")))
        images = policy.autoencoder.decode(traj.final).cpu().numpy().reshape(len(chosen), G, height, width, 3)
        scores, parts = zip(*(mix.score(p, ims) for p, ims in zip(chosen, images, strict=True)), strict=True)
        rewards = torch.tensor(np.nan_to_num(np.stack(scores), nan=0.0), dtype=torch.float32)
        adv = group_advantages(rewards).flatten().to(device)
        policy.train()
        trained_steps = [i for i, s in enumerate(traj.stds) if s > 0]
        stats = {"loss": 0.0, "kl": 0.0, "clipped": 0.0}
        for _ in range(post.inner_epochs):
            opt.zero_grad(set_to_none=True)
            for i in trained_steps:
                lp, mean = step_logprob(conditioned(policy, text), traj, i, post.eta)
                with torch.no_grad():
                    _, ref_mean = step_logprob(conditioned(reference, text), traj, i, post.eta)
                pg, clipped = clipped_policy_loss(lp, traj.logprobs[i].to(device), adv, post.clip)
                kl = gaussian_kl(mean, ref_mean, traj.stds[i]).mean()
                loss = (pg + post.kl * kl) / len(trained_steps)
                loss.backward()
                stats["loss"] += loss.item()
                stats["kl"] += kl.item() / len(trained_steps)
                stats["clipped"] += clipped.item() / len(trained_steps)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, post.grad_clip))
            if not np.isfinite(grad_norm):
                raise FloatingPointError(f"GRPO iteration {it}: non-finite gradient norm; lower post.lr")
            opt.step()
        record = {
            "iteration": it + 1,
            "reward": float(rewards.mean()),
            **{f"reward_{name}": float(np.nanmean([p[name] for p in parts])) for name in parts[0]},
            "loss": stats["loss"] / post.inner_epochs,
            "kl": stats["kl"] / post.inner_epochs,
            "clipped": stats["clipped"] / post.inner_epochs,
            "grad_norm": grad_norm,
            "seconds": round(time.perf_counter() - t0, 3),
        }
        with history.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        done = it + 1
        if done % post.save_every == 0 or done == end:
            ckpt.save(policy, opt, RunState(done, DataPosition()))
        log.info("grpo %d: reward %.3f kl %.4f clipped %.2f", done, record["reward"], record["kl"], record["clipped"])
    ckpt.wait()
    policy.save_pretrained(out)
    state = Path(checkpoint) / "train_state.json"
    if state.exists():  # the evaluation and sampler read the bucket and config the checkpoint was trained at
        (out / "train_state.json").write_text(state.read_text())
    (out / "grpo.json").write_text(json.dumps({"from": str(checkpoint), "iterations": end, "post": post.model_dump(mode="json"), "prompts": len(prompts)}, indent=2, sort_keys=True) + "\n")
    return out
