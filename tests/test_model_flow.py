"""The rectified-flow convention: x_t = (1-t) x0 + t eps, t=1 is noise, v = eps - x0."""

import torch

from model.flow import (
    euler_timesteps,
    interpolate,
    resolution_shift,
    sample_logit_normal,
    shift_timesteps,
    velocity_target,
)


def test_interpolation_runs_from_data_at_t0_to_noise_at_t1():
    x0, eps = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    assert torch.equal(interpolate(x0, eps, torch.zeros(3)), x0)
    assert torch.equal(interpolate(x0, eps, torch.ones(3)), eps)
    mid = interpolate(x0, eps, torch.tensor([0.0, 0.5, 1.0]))
    assert torch.allclose(mid[1], 0.5 * (x0[1] + eps[1]))


def test_velocity_target_is_the_time_derivative_of_the_path():
    x0, eps, t, dt = torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.tensor([0.3, 0.7]), 1e-3
    numeric = (interpolate(x0, eps, t + dt) - interpolate(x0, eps, t)) / dt
    assert torch.allclose(numeric, velocity_target(x0, eps), atol=1e-3)


def test_shift_keeps_the_endpoints_and_moves_time_towards_noise():
    t = torch.linspace(0, 1, 11)
    shifted = shift_timesteps(t, 3.0)
    assert shifted[0] == 0 and shifted[-1] == 1
    assert (shifted[1:-1] > t[1:-1]).all()
    assert torch.equal(shift_timesteps(t, 1.0), t)
    assert (shifted.diff() > 0).all()


def test_resolution_shift_passes_through_its_anchors_and_grows_with_tokens():
    assert resolution_shift(256) == 1.0
    assert abs(resolution_shift(4096) - 3.0) < 1e-12
    assert resolution_shift(64) < resolution_shift(256) < resolution_shift(1024) < resolution_shift(4096)
    assert resolution_shift(1) > 0


def test_logit_normal_is_seeded_and_inside_the_open_interval():
    a = sample_logit_normal(10_000, torch.Generator().manual_seed(1))
    b = sample_logit_normal(10_000, torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    assert ((a > 0) & (a < 1)).all()
    assert abs(a.median().item() - 0.5) < 0.02  # sigmoid(N(0, 1)) is symmetric about 1/2
    assert sample_logit_normal(10_000, torch.Generator().manual_seed(1), mean=1.0).median() > 0.7


def test_euler_timesteps_descend_from_noise_to_data():
    ts = euler_timesteps(8, shift=2.0)
    assert ts.shape == (9,) and ts[0] == 1 and ts[-1] == 0 and (ts.diff() < 0).all()
