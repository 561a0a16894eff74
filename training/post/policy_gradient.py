"""Flow-GRPO's policy-gradient pieces: group-relative advantages, the clipped ratio, and the KL to the reference.

A prompt's G samples form a group; each sample's advantage is its (mixed) reward standardised within the
group, so no value network is needed. The ratio is that of the SDE step's likelihood under the policy being
trained to the one that sampled it (training/post/sde.py); the KL is between the two Gaussian steps of policy and
frozen reference, which share a std, so it is a scaled squared distance of their means.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, eps: float = 1e-4) -> Tensor:
    """GRPO's group-relative advantages: rewards [G groups, K samples] standardised within each group."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


def clipped_policy_loss(logp_new: Tensor, logp_old: Tensor, advantages: Tensor, clip: float) -> tuple[Tensor, Tensor]:
    """PPO's clipped surrogate (as in Flow-GRPO): -mean(min(r A, clip(r, 1-c, 1+c) A)), r = exp(new - old).
    Returns the loss and the share of samples whose ratio was clipped."""
    ratio = torch.exp(logp_new - logp_old)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip, 1 + clip) * advantages
    loss = -torch.minimum(unclipped, clipped).mean()
    return loss, ((ratio - 1).abs() > clip).float().mean()


def gaussian_kl(mean_policy: Tensor, mean_ref: Tensor, std: float) -> Tensor:
    """KL(policy step || reference step) for two Gaussians with the same std, per sample (mean over elements)."""
    return ((mean_policy.float() - mean_ref.float()) ** 2).flatten(1).mean(1) / (2 * std**2)
