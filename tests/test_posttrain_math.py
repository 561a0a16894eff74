"""Post-training's maths against hand-written references on fixed numbers: the Diffusion-DPO loss and its
winner anchor, the divergence guard, GRPO's advantages, clipped ratio and KL, and the SDE sampler's step
log-probability against a direct Gaussian density."""

from __future__ import annotations

import math

import pytest
import torch

from training.post.policy_gradient import clipped_policy_loss, gaussian_kl, group_advantages
from training.post.preference import DivergenceError, DivergenceGuard, dpo_loss
from training.post.sde import gaussian_logprob, rollout, sde_mean_std, step_logprob


def test_dpo_loss_matches_the_formula_written_out_by_hand():
    e_w, e_l = torch.tensor([0.30, 0.50]), torch.tensor([0.40, 0.20])
    e_w_ref, e_l_ref = torch.tensor([0.35, 0.45]), torch.tensor([0.38, 0.25])
    beta = 10.0
    # pair 0: d_w = -0.05, d_l = 0.02 -> margin = -5 * (-0.07) = 0.35; pair 1: d_w = 0.05, d_l = -0.05 -> -0.5
    expected = (-math.log(1 / (1 + math.exp(-0.35))) - math.log(1 / (1 + math.exp(0.5)))) / 2
    terms = dpo_loss(e_w, e_l, e_w_ref, e_l_ref, beta)
    assert terms.loss.item() == pytest.approx(expected, rel=1e-6)
    assert terms.winner_loglik.tolist() == pytest.approx([0.05, -0.05])
    assert terms.loser_loglik.tolist() == pytest.approx([-0.02, 0.05])
    assert terms.accuracy.item() == 0.5


def test_the_winner_anchor_penalises_only_a_winner_likelihood_below_the_reference():
    e_w, e_l = torch.tensor([0.30, 0.50]), torch.tensor([0.40, 0.20])
    e_w_ref, e_l_ref = torch.tensor([0.35, 0.45]), torch.tensor([0.38, 0.25])
    plain = dpo_loss(e_w, e_l, e_w_ref, e_l_ref, 10.0).loss
    anchored = dpo_loss(e_w, e_l, e_w_ref, e_l_ref, 10.0, winner_anchor=2.0).loss
    assert (anchored - plain).item() == pytest.approx(2.0 * (0.0 + 0.05) / 2)  # relu(-0.05)=0, relu(0.05)=0.05


def test_dpo_gradient_lowers_the_winner_error_and_raises_the_loser_error():
    e_w, e_l = torch.tensor([0.3], requires_grad=True), torch.tensor([0.3], requires_grad=True)
    dpo_loss(e_w, e_l, torch.tensor([0.3]), torch.tensor([0.3]), beta=5.0).loss.backward()
    assert e_w.grad.item() > 0 > e_l.grad.item()  # descent lowers e_w, raises e_l


def test_the_divergence_guard_fires_when_both_likelihoods_fall_below_the_reference_together():
    guard = DivergenceGuard(patience=5, action="warn")
    fired = [guard.update(s, -0.01 * s, -0.02 * s) for s in range(1, 12)]
    assert fired[:4] == [None] * 4 and all(fired[4:]) and guard.fired_at[0] == 5
    healthy = DivergenceGuard(patience=5)
    assert not any(healthy.update(s, 0.01 * s, -0.02 * s) for s in range(1, 30))  # winner up, loser down: DPO working
    stopping = DivergenceGuard(patience=3, action="stop")
    with pytest.raises(DivergenceError, match="both been below the reference"):
        for s in range(1, 10):
            stopping.update(s, -0.1 * s, -0.1 * s)


def test_group_advantages_standardise_rewards_within_each_prompts_group():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 6.0], [5.0, 5.0, 5.0, 5.0]])
    adv = group_advantages(rewards, eps=0.0 + 1e-12)
    mean, std = 3.0, math.sqrt(((1 - 3) ** 2 + (2 - 3) ** 2 + 0 + (6 - 3) ** 2) / 4)
    assert adv[0].tolist() == pytest.approx([(r - mean) / std for r in (1, 2, 3, 6)], rel=1e-6)
    assert adv[1].tolist() == [0.0, 0.0, 0.0, 0.0]  # a group that agrees teaches nothing


def test_the_clipped_ratio_objective_matches_ppo_written_out():
    logp_old = torch.tensor([0.0, 0.0, 0.0])
    logp_new = torch.tensor([math.log(1.5), math.log(0.5), math.log(1.1)])
    adv = torch.tensor([1.0, -1.0, 2.0])
    loss, clipped = clipped_policy_loss(logp_new, logp_old, adv, clip=0.2)
    # r = 1.5, A = 1: min(1.5, 1.2) = 1.2;  r = 0.5, A = -1: min(-0.5, -0.8) = -0.8;  r = 1.1, A = 2: 2.2
    assert loss.item() == pytest.approx(-(1.2 - 0.8 + 2.2) / 3, rel=1e-6)
    assert clipped.item() == pytest.approx(2 / 3)


def test_the_kl_between_two_steps_of_equal_std_is_their_mean_distance_over_twice_the_variance():
    a, b = torch.zeros(2, 4), torch.full((2, 4), 0.3)
    assert gaussian_kl(a, b, std=0.5).tolist() == pytest.approx([0.09 / 0.5] * 2)


def test_an_sde_steps_log_probability_is_the_gaussian_density_computed_directly():
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 2, 4, 4, generator=g), torch.randn(3, 2, 4, 4, generator=g)
    t, t_next, eta = 0.7, 0.6, 0.8
    mean, std = sde_mean_std(x, v, t, t_next, eta, t_cap=0.95)
    sigma = eta * math.sqrt(t / (1 - t))
    assert std == pytest.approx(sigma * math.sqrt(0.1))
    assert torch.allclose(mean, x + (v + sigma**2 / (2 * t) * (x + (1 - t) * v)) * (t_next - t))
    x_next = mean + std * torch.randn(mean.shape, generator=g)
    direct = torch.distributions.Normal(mean, std).log_prob(x_next).flatten(1).mean(1)
    assert torch.allclose(gaussian_logprob(x_next, mean, std), direct, atol=1e-5)


def test_with_eta_zero_the_sde_step_is_the_euler_ode_step():
    x, v = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    mean, std = sde_mean_std(x, v, 0.5, 0.4, 0.0, 0.95)
    assert std == 0.0 and torch.equal(mean, x + (0.4 - 0.5) * v)


def test_a_rollouts_recorded_log_probabilities_are_recomputed_exactly_by_the_same_policy():
    """The GRPO ratio starts at 1: re-scoring a rollout's steps with the policy that sampled them."""
    w = torch.tensor(0.3)

    def velocity(x, t):
        return w * x + t.reshape(-1, 1, 1, 1)

    noise = torch.randn(2, 1, 3, 3, generator=torch.Generator().manual_seed(1))
    traj = rollout(velocity, noise, steps=5, shift=1.0, eta=0.7, generator=torch.Generator().manual_seed(2))
    assert traj.logprobs.shape == (5, 2) and torch.all(traj.logprobs[-1] == 0)  # the last step is deterministic
    for i in range(4):
        lp, _ = step_logprob(velocity, traj, i, eta=0.7)
        assert torch.allclose(lp, traj.logprobs[i], atol=1e-6)
    with pytest.raises(ValueError, match="deterministic"):
        step_logprob(velocity, traj, 4, eta=0.7)
