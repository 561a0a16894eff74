"""Preference losses for flow models: Diffusion-DPO, its winner-anchored variant, and a guard against the
known failure where winner and loser likelihoods both fall.

Diffusion-DPO (Wallace et al., 2023) on a rectified flow: with e = ||v_target - v_pred||^2 (per sample mean)
at a shared (t, noise) for winner w and loser l, under the policy and a frozen reference,

    d_w = e_w - e_w_ref,   d_l = e_l - e_l_ref,   loss = -log sigmoid(-beta / 2 * (d_w - d_l))

-d_w and -d_l are the implicit log-likelihood ratios of winner and loser against the reference (an ELBO
difference up to the timestep weight). DPO only pushes their difference apart, so both can fall together:
the model drifts from the reference and grows high-frequency artifacts (the Krea 2 report's observation, and
what STPO guards against; STPO's exact form is not public). `winner_anchor > 0` adds
`winner_anchor * relu(d_w)`: a penalty whenever the winner's likelihood falls below the reference's, the same
idea as DPO-Positive (Pal et al., 2024), named here for what it does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class DPOTerms:
    loss: Tensor  # scalar
    winner_loglik: Tensor  # [B] -d_w: > 0 when the policy fits the winner better than the reference
    loser_loglik: Tensor  # [B] -d_l
    accuracy: Tensor  # scalar: share of pairs whose implicit reward ranks the winner first


def dpo_loss(
    e_w: Tensor, e_l: Tensor, e_w_ref: Tensor, e_l_ref: Tensor, beta: float, winner_anchor: float = 0.0
) -> DPOTerms:
    """Diffusion-DPO on per-sample velocity errors [B] (policy and reference, winner and loser)."""
    d_w, d_l = e_w - e_w_ref, e_l - e_l_ref
    margin = -0.5 * beta * (d_w - d_l)
    loss = -F.logsigmoid(margin).mean()
    if winner_anchor > 0:
        loss = loss + winner_anchor * F.relu(d_w).mean()
    return DPOTerms(loss, -d_w.detach(), -d_l.detach(), (margin.detach() > 0).float().mean())


@dataclass
class DivergenceGuard:
    """Fires when, for `patience` consecutive steps, both implicit log-likelihoods (batch means) are below the
    reference's and the winner's has fallen over the window: DPO is pushing both down together.

    `action`: `warn` returns the message and keeps going; `stop` raises DivergenceError."""

    patience: int = 20
    action: str = "warn"
    _w: deque = field(default_factory=deque)
    _l: deque = field(default_factory=deque)
    fired_at: list[int] = field(default_factory=list)

    def update(self, step: int, winner_loglik: float, loser_loglik: float) -> str | None:
        self._w.append(winner_loglik)
        self._l.append(loser_loglik)
        while len(self._w) > self.patience:
            self._w.popleft()
            self._l.popleft()
        if len(self._w) < self.patience:
            return None
        both_below = all(w < 0 for w in self._w) and all(x < 0 for x in self._l)
        if not (both_below and self._w[-1] < self._w[0] and self._l[-1] < self._l[0]):
            return None
        self.fired_at.append(step)
        msg = (
            f"step {step}: winner and loser likelihoods have both been below the reference's for {self.patience} steps "
            f"and falling (winner {self._w[0]:.4g} -> {self._w[-1]:.4g}, loser {self._l[0]:.4g} -> {self._l[-1]:.4g}): "
            "raise beta, add a winner anchor, or lower the LR"
        )
        if self.action == "stop":
            raise DivergenceError(msg)
        return msg


class DivergenceError(RuntimeError):
    """The divergence guard stopped a preference run."""


def velocity_errors(velocity, x0: Tensor, eps: Tensor, t: Tensor) -> Tensor:
    """Per-sample ||v_target - v(x_t, t)||^2 (mean over elements) at shared noise and time: [B]."""
    from model.flow import interpolate, velocity_target

    pred = velocity(interpolate(x0, eps, t), t)
    return ((pred.float() - velocity_target(x0, eps).float()) ** 2).flatten(1).mean(1)
