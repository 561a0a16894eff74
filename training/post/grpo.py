"""Flow-GRPO: RL of a checkpoint on rubric (and other) rewards, without CFG, against a frozen reference.

Each iteration draws `prompts_per_iter` prompts (a pure function of seed and iteration), samples
`group_size` images per prompt with the SDE sampler (training/post/sde.py) from the current policy, scores them
with the reward mix, and standardises the rewards within each prompt's group (training/post/policy_gradient.py). The update
re-scores every stochastic step of the rollouts under the policy with grad: the clipped ratio objective
plus `kl` times the KL of each step to the reference's step. Randomness is a pure function of (seed,
iteration), and DCP checkpoints (training/core/dcp.py) hold model, optimiser and iteration, so a killed run
resumes to the same weights as an uninterrupted one.

Runs in one process or under torchrun / a Slurm job with FSDP2 (+ TP) like `kiln train`
(training/post/runner.py). Each data-parallel rank takes a contiguous share of the iteration's prompts
with their whole groups, so group advantages are computed where the group's rewards are, with no exchange;
the initial and SDE noise are drawn for the whole iteration and each rank keeps its samples' rows, and the
logged rewards and losses are global means. So N ranks compute what one process does (to float rounding),
and `prompts_per_iter` must be at least the number of data-parallel ranks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kiln.config import ConfigError, KilnConfig
from kiln.progress import log, progress
from training.evaluation.rubric import RubricPrompt, demo_rl_prompts, read_prompt_set
from training.post.policy_gradient import clipped_policy_loss, gaussian_kl, group_advantages
from training.post.runner import iteration_seed, last_step, open_run
from training.post.sde import conditioned, rollout, step_logprob

HISTORY = "grpo_history.jsonl"


def rl_prompts(cfg: KilnConfig) -> list[RubricPrompt]:
    """The prompt set RL draws from: `post.prompts`, else the demo grammar's prompts outside the evaluation's."""
    return read_prompt_set(Path(cfg.post.prompts)) if cfg.post.prompts else demo_rl_prompts(256, cfg.post.seed)


def check_post_config(cfg: KilnConfig) -> None:
    from training.evaluation.rewards import post_problems

    if problems := post_problems(cfg.post):
        raise ConfigError("post-training cannot run:\n" + "\n".join(f"  {k}: {why}" for k, why in problems))


def grpo(
    checkpoint: Path,
    out: Path,
    cfg: KilnConfig,
    resume: bool = False,
    stop_at: int | None = None,
    mix=None,
    overwrite: bool = False,
) -> Path:
    """RL from `checkpoint` into `out` (model.safetensors + config.json, DCP step checkpoints, history).
    `mix`: a training.evaluation.rewards.RewardMix to use instead of the configured `post.rewards`."""
    from training.evaluation.rewards import configured_reward_mix
    from training.evaluation.sampling import checkpoint_resolution, sampling_shift

    check_post_config(cfg)
    post = cfg.post
    prompts = rl_prompts(cfg)
    G, P = post.group_size, min(post.prompts_per_iter, len(prompts))
    with open_run("grpo", checkpoint, out, cfg, resume, post.lr, step_key="iteration", overwrite=overwrite) as run:
        mine = run.rows(P, "post.prompts_per_iter")  # this rank's prompts, each with its whole group
        samples = slice(mine.start * G, mine.stop * G)  # and their rows of the iteration's P * G samples
        policy, reference, device = run.policy, run.frozen(checkpoint), run.device
        height, width = (
            (post.resolution, post.resolution) if post.resolution else checkpoint_resolution(Path(checkpoint), cfg)
        )
        shift = sampling_shift(policy, height, width, cfg.train)
        ds = policy.autoencoder.downsample
        mix = mix or configured_reward_mix(cfg)
        end = last_step(post.iterations, stop_at)
        for it in progress(range(run.start, end), desc="grpo", unit="iter", total=end - run.start):
            pick = np.random.default_rng(iteration_seed(post.seed, it, "prompts")).choice(
                len(prompts), size=P, replace=False
            )
            chosen = [prompts[i] for i in pick[mine]]
            text = policy.encode_text([p.prompt for p in chosen for _ in range(G)])
            shape = (P * G, policy.autoencoder.latent_channels, height // ds, width // ds)
            noise = torch.randn(shape, generator=torch.Generator().manual_seed(iteration_seed(post.seed, it, "noise")))[
                samples
            ].to(device)
            policy.eval()
            sde = torch.Generator().manual_seed(iteration_seed(post.seed, it, "sde"))
            traj = rollout(
                conditioned(policy, text), noise, post.sample_steps, shift, post.eta, sde, rows=samples, batch=P * G
            )
            images = policy.autoencoder.decode(traj.final).cpu().numpy().reshape(len(chosen), G, height, width, 3)
            scores, parts = zip(*(mix.score(p, ims) for p, ims in zip(chosen, images, strict=True)), strict=True)
            rewards = torch.tensor(np.nan_to_num(np.stack(scores), nan=0.0), dtype=torch.float32)
            adv = group_advantages(rewards).flatten().to(device)
            policy.train()
            trained_steps = [i for i, s in enumerate(traj.stds) if s > 0]
            n, weight = len(chosen) * G, run.share(samples, P * G)
            local = {"loss": 0.0, "kl": 0.0, "clipped": 0.0}  # sums over this rank's samples
            for _ in range(post.inner_epochs):
                run.opt.zero_grad(set_to_none=True)
                for i in trained_steps:
                    lp, mean = step_logprob(conditioned(policy, text), traj, i, post.eta)
                    with torch.no_grad():
                        _, ref_mean = step_logprob(conditioned(reference, text), traj, i, post.eta)
                    pg, clipped = clipped_policy_loss(lp, traj.logprobs[i].to(device), adv, post.clip)
                    kl = gaussian_kl(mean, ref_mean, traj.stds[i]).mean()
                    loss = (pg + post.kl * kl) / len(trained_steps)
                    (loss * weight).backward()
                    local["loss"] += loss.item() * n
                    local["kl"] += kl.item() * n / len(trained_steps)
                    local["clipped"] += clipped.item() * n / len(trained_steps)
                grad_norm = run.clip_grads(post.grad_clip)
                if not np.isfinite(grad_norm):
                    raise FloatingPointError(f"GRPO iteration {it}: non-finite gradient norm; lower post.lr")
                run.opt.step()
            names = list(parts[0])
            by_name = [np.stack([p[name] for p in parts]) for name in names]
            sums = run.all_sum(
                [
                    local["loss"],
                    local["kl"],
                    local["clipped"],
                    rewards.sum(),
                    *(np.nansum(v) for v in by_name),
                    *(np.sum(~np.isnan(v)) for v in by_name),
                ]
            )
            loss_sum, kl_sum, clipped_sum, reward_sum = sums[:4]
            name_sums, name_counts = sums[4 : 4 + len(names)], sums[4 + len(names) :]
            record = {
                "iteration": it + 1,
                "reward": reward_sum / (P * G),
                **{
                    f"reward_{name}": s / c if c else float("nan")
                    for name, s, c in zip(names, name_sums, name_counts, strict=True)
                },
                "loss": loss_sum / (P * G) / post.inner_epochs,
                "kl": kl_sum / (P * G) / post.inner_epochs,
                "clipped": clipped_sum / (P * G) / post.inner_epochs,
                "grad_norm": grad_norm,
            }
            done = it + 1
            run.step_done(record, done, post.save_every, end)
            if run.ranks.rank == 0:
                log.info(
                    "grpo %d: reward %.3f kl %.4f clipped %.2f", done, record["reward"], record["kl"], record["clipped"]
                )
        return run.export(
            checkpoint,
            {"from": str(checkpoint), "iterations": end, "post": post.model_dump(mode="json"), "prompts": len(prompts)},
        )
