"""TDM's loss terms (training/post/tdm.py) against formulas written out by hand on fixed small tensors.

Convention (model/flow.py): x_t = (1 - t) x0 + t eps, v = eps - x0, t = 1 is noise. Every tensor here is
[B=2, 1, 1, 2] so each number can be checked on paper."""

from __future__ import annotations

import math

import pytest
import torch

from training.post.tdm import (
    distribution_matching_loss,
    effective_noise,
    fake_score_loss,
    guided_velocity,
    importance_weights,
    renoise,
    split_velocity,
    stage_points,
    step_point,
)


def t2(rows) -> torch.Tensor:
    """[[a, b], [c, d]] as a [2, 1, 1, 2] batch of two tiny 'images'."""
    return torch.tensor(rows, dtype=torch.float32).reshape(2, 1, 1, 2)


X = t2([[0.5, -1.0], [2.0, 0.0]])
V = t2([[1.0, 2.0], [-1.0, 0.5]])
T = torch.tensor([0.25, 0.75])


def test_a_velocity_splits_into_the_clean_image_and_the_noise_it_implies():
    x0, eps = split_velocity(X, V, T)
    # row 0 (t = 0.25): x0 = x - 0.25 v, eps = x + 0.75 v; row 1 (t = 0.75): x0 = x - 0.75 v, eps = x + 0.25 v
    assert x0.flatten().tolist() == pytest.approx([0.25, -1.5, 2.75, -0.375])
    assert eps.flatten().tolist() == pytest.approx([1.25, 0.5, 1.75, 0.125])
    assert torch.allclose((1 - T.view(2, 1, 1, 1)) * x0 + T.view(2, 1, 1, 1) * eps, X)  # they interpolate back to x
    assert torch.allclose(eps - x0, V)


def test_the_step_point_is_the_euler_step_of_the_velocity():
    x0, eps = split_velocity(X, V, T)
    s = torch.tensor([0.0, 0.5])
    assert torch.allclose(step_point(x0, eps, s), X + (s - T).view(2, 1, 1, 1) * V)


def test_guidance_is_the_samplers_form():
    cond, uncond = t2([[1.0, 0.0], [2.0, 2.0]]), t2([[0.0, 1.0], [1.0, 3.0]])
    assert guided_velocity(cond, uncond, 3.0).flatten().tolist() == pytest.approx(
        [3.0, -2.0, 4.0, 0.0]
    )  # u + 3 (c - u)
    assert torch.equal(guided_velocity(cond, uncond, 1.0), cond)


def test_renoise_is_the_flows_forward_kernel_from_s_to_t():
    x_s, z = t2([[1.0, -2.0], [0.5, 0.5]]), t2([[0.3, -0.1], [1.0, -1.0]])
    s, t = torch.tensor([0.2, 0.0]), torch.tensor([0.6, 0.5])
    # row 0: a = 0.4 / 0.8 = 0.5, b = sqrt(0.36 - (0.5 * 0.2)^2) = sqrt(0.35); row 1 (s = 0): a = 0.5, b = 0.5
    b0 = math.sqrt(0.35)
    expected = [0.5 * 1.0 + b0 * 0.3, 0.5 * -2.0 + b0 * -0.1, 0.5 * 0.5 + 0.5 * 1.0, 0.5 * 0.5 + 0.5 * -1.0]
    assert renoise(x_s, s, t, z).flatten().tolist() == pytest.approx(expected, rel=1e-6)
    assert torch.allclose(renoise(x_s, s, s, z), x_s)  # t = s: no noise added


def test_the_kernel_keeps_the_flows_marginals():
    """x_s = (1 - s) x0 + s eps diffused to t has the variance t^2 around (1 - t) x0 that x_t must have."""
    g = torch.Generator().manual_seed(0)
    x0, eps, z = torch.full((200_000,), 0.7), torch.randn(200_000, generator=g), torch.randn(200_000, generator=g)
    x_t = renoise((1 - 0.3) * x0 + 0.3 * eps, 0.3, 0.8, z)
    assert float(x_t.mean()) == pytest.approx(0.2 * 0.7, abs=5e-3)
    assert float(x_t.std()) == pytest.approx(0.8, abs=5e-3)


def test_the_effective_noise_writes_the_diffused_step_point_as_a_flow_sample_of_the_students_x0():
    x0, eps = split_velocity(X, V, T)
    s, t, z = torch.tensor([0.1, 0.5]), torch.tensor([0.2, 0.7]), t2([[0.5, 1.0], [-1.0, 0.2]])
    n = effective_noise(eps, s, t, z)
    # by hand, row 0: a = 0.8 / 0.9, b = sqrt(0.04 - (a 0.1)^2); n = (a 0.1 eps + b z) / 0.2
    a = 0.8 / 0.9
    b = math.sqrt(0.04 - (a * 0.1) ** 2)
    assert n[0].flatten().tolist() == pytest.approx(
        [(a * 0.1 * 1.25 + b * 0.5) / 0.2, (a * 0.1 * 0.5 + b * 1.0) / 0.2], rel=1e-6
    )
    x_t = renoise(step_point(x0, eps, s), s, t, z)
    tb = t.view(2, 1, 1, 1)
    assert torch.allclose(x_t, (1 - tb) * x0 + tb * n, atol=1e-6)


def test_importance_weights_are_the_tempered_normal_density_ratio_per_sample():
    n, z = t2([[1.0, 2.0], [0.0, 0.0]]), t2([[0.0, 1.0], [1.0, 1.0]])
    # row 0: mean(n^2) = 2.5, mean(z^2) = 0.5 -> exp(-1.25) / exp(-0.25); row 1: exp(0) / exp(-0.5)
    expected = [math.exp(-1.25) / math.exp(-0.25), 1.0 / math.exp(-0.5)]
    assert importance_weights(n, z).tolist() == pytest.approx(expected, rel=1e-6)


def test_the_fake_score_loss_is_importance_weighted_flow_matching_on_student_samples():
    v_fake, x0, n = t2([[1.0, 0.0], [0.5, 0.5]]), t2([[0.0, 1.0], [1.0, 0.0]]), t2([[2.0, 1.0], [0.0, 1.0]])
    w = torch.tensor([0.5, 2.0])
    # target v = n - x0: row 0 [2, 0] -> err mean((1-2)^2, 0^2) = 0.5; row 1 [-1, 1] -> mean(1.5^2, 0.5^2) = 1.25
    expected = (0.5 * 0.5 + 2.0 * 1.25) / 2
    assert fake_score_loss(v_fake, x0, n, w).item() == pytest.approx(expected, rel=1e-6)


def test_the_student_loss_and_its_gradient_follow_the_normalised_teacher_minus_fake_direction():
    x0 = t2([[1.0, 0.0], [0.0, 2.0]]).requires_grad_(True)
    x_t, t = t2([[0.5, 0.5], [1.0, 1.0]]), torch.tensor([0.5, 0.25])
    v_real, v_fake = t2([[0.0, 1.0], [2.0, 0.0]]), t2([[1.0, 1.0], [0.0, 0.0]])
    # x0_real = x_t - t v_real: row 0 [0.5, 0.0], row 1 [0.5, 1.0]; x0_fake: row 0 [0.0, 0.0], row 1 [1.0, 1.0]
    # w = mean|x0 - x0_real|: row 0 (0.5 + 0) / 2 = 0.25, row 1 (0.5 + 1) / 2 = 0.75
    # x0 - target = -(x0_real - x0_fake): row 0 [-0.5, 0], row 1 [0.5, 0]
    loss_expected = ((0.25 / 0.25 + 0.0) + (0.25 / 0.75 + 0.0)) / 4
    terms = distribution_matching_loss(x0, x_t, t, v_real, v_fake)
    assert terms.loss.item() == pytest.approx(loss_expected, rel=1e-6)
    assert terms.teacher_gap.tolist() == pytest.approx([0.25, 0.75])
    terms.loss.backward()
    # d/dx0 = 2 (x0 - target) / w / N, N = 4 elements: descent moves x0 along x0_real - x0_fake (DMD's direction)
    assert x0.grad.flatten().tolist() == pytest.approx([2 * -0.5 / 0.25 / 4, 0.0, 2 * 0.5 / 0.75 / 4, 0.0], rel=1e-6)


def test_the_pseudo_huber_student_loss_is_the_papers_recipe():
    x0 = t2([[1.0, 0.0], [0.0, 2.0]])
    x_t, t = t2([[0.5, 0.5], [1.0, 1.0]]), torch.tensor([0.5, 0.25])
    v_real, v_fake = t2([[0.0, 1.0], [2.0, 0.0]]), t2([[1.0, 1.0], [0.0, 0.0]])
    c = 0.1
    h = math.sqrt(0.25 + c * c) - c  # the two elements with |x0 - target| = 0.5; the others give sqrt(c^2) - c = 0
    assert distribution_matching_loss(x0, x_t, t, v_real, v_fake, huber_c=c).loss.item() == pytest.approx(
        (h / 0.25 + h / 0.75) / 4, rel=1e-6
    )


def test_stage_points_place_each_draw_inside_its_own_stage():
    times = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0], dtype=torch.float64)  # a 4-step student
    stage = torch.tensor([0, 2, 3, 3])
    u_mid, u_t = torch.full((4,), 0.5, dtype=torch.float64), torch.tensor([0.0, 0.5, 1.0, 0.0], dtype=torch.float64)
    pts = stage_points(times, stage, u_mid, u_t, t_min=0.02)
    assert pts.t_i.tolist() == [1.0, 0.5, 0.25, 0.25]
    assert pts.s.tolist() == [0.75, 0.25, 0.0, 0.0]  # the end of the student's step
    assert pts.t.tolist() == pytest.approx([0.75, 0.375, 0.25, 0.02])  # t in [max(s, t_min), t_i]: never below t_min
    mid = stage_points(times, stage, u_mid, u_t, t_min=0.02, random_mid=True)
    assert mid.s.tolist() == pytest.approx([0.875, 0.375, 0.125, 0.125])  # s = t_{i+1} + u_mid (t_i - t_{i+1})
    coupled = stage_points(times, stage, u_mid, u_t, t_min=0.02, decoupled=False)
    assert coupled.t.tolist() == pytest.approx([0.75, 0.625, 1.0, 0.02])  # t in [max(s, t_min), 1]
