"""Trajectory Distribution Matching (Luo et al., 2025): the loss terms, as pure functions on tensors.

In kiln's flow convention (model/flow.py: x_t = (1 - t) x0 + t eps, v = eps - x0, t = 1 is noise) a velocity
at (x, t) splits into a clean-image and a noise prediction, x0 = x - t v and eps = x + (1 - t) v, and the
Euler step to s is the DDIM step (1 - s) x0 + s eps. The student is a K-step Euler sampler. For a stage i
of its own trajectory (from t_i down to t_{i+1}), TDM takes the student's prediction at x_{t_i} and

  1. moves along the student's step to s (t_{i+1}, or a random point of the stage): x_s = (1 - s) x0 + s eps;
  2. diffuses x_s forward to a time t in [s, t_i] (sampling-steps-aware: each stage is matched only inside
     its own interval) with the flow's forward kernel q(x_t | x_s):
         x_t = a x_s + b z,   a = (1 - t) / (1 - s),   b = sqrt(t^2 - (a s)^2),   z ~ N(0, I);
  3. student: moves its x0 towards the frozen teacher's (CFG-guided) x0 at x_t and away from the fake
     score's, normalised per sample as DMD does;
     fake score: regresses on the student's samples, x_t = (1 - t) x0 + t n with the effective noise
     n = (a s eps + b z) / t, so its flow-matching target is v = n - x0; since n is not standard normal,
     each sample is reweighted by the density ratio exp(-mean(n^2)/2) / exp(-mean(z^2)/2).

docs/distillation.md writes this out and says where kiln departs from the paper's code.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


def per_sample(t: Tensor | float, like: Tensor) -> Tensor:
    """A scalar or [B] time as [B, 1, 1, ...] (or a 0-d tensor), in `like`'s dtype and device."""
    t = torch.as_tensor(t, dtype=like.dtype, device=like.device)
    return t.reshape(-1, *([1] * (like.dim() - 1))) if t.dim() else t


def split_velocity(x: Tensor, v: Tensor, t: Tensor | float) -> tuple[Tensor, Tensor]:
    """(x0, eps) a velocity v at (x, t) implies: x0 = x - t v, eps = x + (1 - t) v."""
    tb = per_sample(t, x)
    return x - tb * v, x + (1 - tb) * v


def guided_velocity(v_cond: Tensor, v_uncond: Tensor, scale: float) -> Tensor:
    """Classifier-free guidance, the sampler's form: v_uncond + scale (v_cond - v_uncond)."""
    return v_uncond + scale * (v_cond - v_uncond)


def step_point(x0: Tensor, eps: Tensor, s: Tensor | float) -> Tensor:
    """The point at time s of the step that predicted (x0, eps): (1 - s) x0 + s eps (the Euler / DDIM step)."""
    sb = per_sample(s, x0)
    return (1 - sb) * x0 + sb * eps


def forward_kernel(s: Tensor | float, t: Tensor | float, like: Tensor) -> tuple[Tensor, Tensor]:
    """(a, b) of q(x_t | x_s) = N(a x_s, b^2 I) for t >= s: a = (1 - t) / (1 - s), b = sqrt(t^2 - (a s)^2)."""
    sb, tb = per_sample(s, like), per_sample(t, like)
    a = (1 - tb) / (1 - sb)
    return a, (tb**2 - (a * sb) ** 2).clamp_min(0).sqrt()


def renoise(x_s: Tensor, s: Tensor | float, t: Tensor | float, z: Tensor) -> Tensor:
    """x_s (a point at time s) diffused forward to time t >= s with the noise z."""
    a, b = forward_kernel(s, t, x_s)
    return a * x_s + b * z


def effective_noise(eps: Tensor, s: Tensor | float, t: Tensor | float, z: Tensor) -> Tensor:
    """n with renoise((1 - s) x0 + s eps, s, t, z) = (1 - t) x0 + t n: n = (a s eps + b z) / t."""
    a, b = forward_kernel(s, t, eps)
    return (a * per_sample(s, eps) * eps + b * z) / per_sample(t, eps)


def importance_weights(noise: Tensor, z: Tensor) -> Tensor:
    """[B]: exp(-mean(noise^2) / 2) / exp(-mean(z^2) / 2), the paper code's (per-element, tempered) ratio of
    the standard normal density at the effective noise to that at the drawn noise."""
    return torch.exp(-0.5 * (noise.float().pow(2).flatten(1).mean(1) - z.float().pow(2).flatten(1).mean(1)))


def fake_score_loss(v_fake: Tensor, x0: Tensor, noise: Tensor, weights: Tensor) -> Tensor:
    """The fake score's flow-matching loss on student samples: mean over the batch of
    weights * mean((v_fake - (noise - x0))^2); x0 and noise are the student's (no grad), v_fake has grad."""
    err = (v_fake.float() - (noise.float() - x0.float())).pow(2).flatten(1).mean(1)
    return (weights.float() * err).mean()


class StudentTerms(NamedTuple):
    loss: Tensor  # what the student's optimiser minimises; its gradient is the TDM direction
    teacher_gap: Tensor  # [B] mean |x0 - x0_teacher|: DMD's normaliser, logged as the distance to the teacher


def distribution_matching_loss(
    x0: Tensor,
    x_t: Tensor,
    t: Tensor | float,
    v_real: Tensor,
    v_fake: Tensor,
    huber_c: float = 0.0,
    floor: float = 1e-8,
) -> StudentTerms:
    """The student's TDM loss. x0: its clean prediction (with grad); v_real (the guided teacher) and v_fake
    at (x_t, t), without grad. With x0_real = x_t - t v_real, x0_fake = x_t - t v_fake and, per sample,
    w = max(mean |x0 - x0_real|, floor), the target is x0 + (x0_real - x0_fake) (detached) and the loss
    mean((x0 - target)^2 / w) (huber_c > 0: (sqrt((x0 - target)^2 + c^2) - c) / w, the paper's recipe)."""
    tb = per_sample(t, x_t)
    x0_real, x0_fake = (x_t - tb * v_real).float(), (x_t - tb * v_fake).float()
    x0 = x0.float()
    gap = (x0 - x0_real).abs().flatten(1).mean(1).detach()
    w = per_sample(gap.clamp_min(floor), x0)
    target = (x0 + (x0_real - x0_fake)).detach()
    diff2 = (x0 - target).pow(2)
    per_elem = (torch.sqrt(diff2 + huber_c**2) - huber_c) if huber_c > 0 else diff2
    return StudentTerms((per_elem / w).mean(), gap)


class StagePoints(NamedTuple):
    t_i: Tensor  # [B] the stage's start: where the student is evaluated
    s: Tensor  # [B] the point along the student's step that is diffused
    t: Tensor  # [B] the time it is diffused to, and where teacher and fake score are asked


def stage_points(
    times: Tensor,
    stage: Tensor,
    u_mid: Tensor,
    u_t: Tensor,
    t_min: float,
    decoupled: bool = True,
    random_mid: bool = False,
) -> StagePoints:
    """The times of one TDM draw. times: the student's K + 1 Euler times from 1 to 0; stage [B] in 0..K-1;
    u_mid, u_t [B] uniform in [0, 1). s = t_{i+1} (random_mid: t_{i+1} + u_mid (t_i - t_{i+1})); t uniform in
    [max(s, t_min), t_i] (decoupled: the stage's own interval; otherwise up to 1), never below s."""
    t_i, t_next = times[stage], times[stage + 1]
    s = t_next + u_mid * (t_i - t_next) if random_mid else t_next
    top = t_i if decoupled else torch.ones_like(t_i)
    low = torch.minimum(s.clamp_min(t_min), top)
    return StagePoints(t_i, s, low + u_t * (top - low))
