"""The sampler as a stochastic process with per-step log-probabilities: what Flow-GRPO's policy gradient needs.

The Euler ODE step (model/sampler.py) is deterministic, so it has no likelihood. Flow-GRPO (Liu et al.,
2025) replaces it by the SDE with the same marginals as the flow x_t = (1 - t) x0 + t eps:

    dx = [v + sigma_t^2 / (2 t) * (x + (1 - t) v)] dt + sigma_t dw,     sigma_t = eta * sqrt(t / (1 - t))

Discretised from t to t_next < t (dt = t_next - t < 0), one step is Gaussian:

    x_next ~ N(mean, std^2),  mean = x + [v + sigma_t^2 / (2 t) * (x + (1 - t) v)] dt,  std = sigma_t sqrt(-dt)

so its log-density under the policy is exact and cheap. At t = 1, sigma_t is infinite; as Flow-GRPO does,
t in sigma_t is capped at the first step below 1. `eta = 0` gives back the Euler ODE step exactly.
Log-probabilities are means over a sample's elements (Flow-GRPO's convention), so a ratio exp(new - old) is
on the same scale at any resolution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from model.flow import euler_timesteps


def conditioned(gen, text):
    """The velocity field v(x, t) of a Generator under one batch of text (no CFG): what rollouts integrate."""
    return lambda x, t: gen(x, t, text)


def _b(t: Tensor | float, like: Tensor) -> Tensor:
    t = torch.as_tensor(t, dtype=like.dtype, device=like.device)
    return t.reshape(-1, *([1] * (like.dim() - 1))) if t.dim() else t


def sde_mean_std(x: Tensor, v: Tensor, t: float, t_next: float, eta: float, t_cap: float) -> tuple[Tensor, float]:
    """The Gaussian of one SDE step from t to t_next: its mean [like x] and its std (a scalar)."""
    dt = t_next - t
    if eta == 0.0:
        return x + dt * v, 0.0
    tc = min(t, t_cap)
    sigma = eta * math.sqrt(tc / (1.0 - tc))
    mean = x + (v + sigma**2 / (2.0 * t) * (x + (1.0 - t) * v)) * dt
    return mean, sigma * math.sqrt(-dt)


def gaussian_logprob(x_next: Tensor, mean: Tensor, std: float) -> Tensor:
    """log N(x_next; mean, std^2), averaged over each sample's elements: [B]."""
    lp = -((x_next.float() - mean.float()) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return lp.flatten(1).mean(1)


@dataclass
class Trajectory:
    """One batch's SDE rollout: the states x_0..x_T (x_0 is the noise, x_T the sample), the times, and the
    log-probability of each step under the policy that sampled it ([T, B])."""

    states: list[Tensor]
    times: Tensor
    logprobs: Tensor
    means: list[Tensor]
    stds: list[float]

    @property
    def final(self) -> Tensor:
        return self.states[-1]


def sde_timesteps(steps: int, shift: float) -> Tensor:
    return euler_timesteps(steps, shift)


@torch.no_grad()
def rollout(
    velocity,
    noise: Tensor,
    steps: int,
    shift: float,
    eta: float,
    generator: torch.Generator,
    rows: slice | None = None,
    batch: int | None = None,
) -> Trajectory:
    """Sample with the SDE from `noise` (t = 1) to t = 0; `velocity(x, t)` is the policy's v (no CFG in RL).

    The last step (to t = 0) is taken deterministically, as Flow-GRPO does: its noise would be left in the
    image. Steps with std 0 get log-probability 0 and are excluded from the policy gradient.
    `noise` may be `rows` of a global batch of `batch` samples (a data-parallel rank's share): each step's
    noise is then drawn for the whole batch and these rows kept, so the rank draws what one process does."""
    ts = sde_timesteps(steps, shift)
    t_cap = float(ts[1])
    x = noise
    states, means, stds, lps = [x], [], [], []
    for i in range(steps):
        t, t_next = float(ts[i]), float(ts[i + 1])
        v = velocity(x, torch.full((x.shape[0],), t, device=x.device))
        mean, std = sde_mean_std(x, v, t, t_next, eta if i < steps - 1 else 0.0, t_cap)
        if std > 0:
            shape = mean.shape if rows is None else (batch, *mean.shape[1:])
            draw = torch.randn(shape, generator=generator, device=generator.device)
            x = mean + std * (draw if rows is None else draw[rows]).to(mean.device, mean.dtype)
            lps.append(gaussian_logprob(x, mean, std))
        else:
            x = mean
            lps.append(torch.zeros(x.shape[0], device=x.device))
        states.append(x)
        means.append(mean)
        stds.append(std)
    return Trajectory(states, ts, torch.stack(lps), means, stds)


def step_logprob(velocity, traj: Trajectory, i: int, eta: float) -> tuple[Tensor, Tensor]:
    """Under `velocity` (the policy being trained, with grad), the log-probability of the rollout's step i
    (x_i -> x_{i+1}) and the step's mean: a ratio against the rollout's logprobs[i] is the GRPO ratio."""
    t, t_next = float(traj.times[i]), float(traj.times[i + 1])
    x = traj.states[i]
    v = velocity(x, torch.full((x.shape[0],), t, device=x.device))
    last = i == len(traj.times) - 2  # the rollout's last step is deterministic
    mean, std = sde_mean_std(x, v, t, t_next, 0.0 if last else eta, float(traj.times[1]))
    if std == 0:
        raise ValueError(f"step {i} is deterministic (std 0): it has no log-probability")
    return gaussian_logprob(traj.states[i + 1], mean, std), mean
