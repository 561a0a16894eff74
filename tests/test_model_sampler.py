"""Euler + CFG sampling: seeded, batch-independent, and CFG scale 1 is the conditional ODE."""

import numpy as np
import pytest
import torch

from model.flow import euler_timesteps, resolution_shift
from model.generator import Generator
from model.sampler import initial_noise, sample
from model.testing import micro_model_config, write_tiny_text_encoder

PROMPTS = ["a red circle", "a blue square", "two green stars", "a yellow dot on the left"]


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    gen = Generator.build(micro_model_config(write_tiny_text_encoder(tmp_path_factory.mktemp("bert"))))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in gen.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return gen


def test_samples_are_uint8_images_and_deterministic_for_a_seed(gen):
    a = sample(gen, PROMPTS, 16, 24, steps=3, cfg_scale=3.0, seed=7)
    b = sample(gen, PROMPTS, 16, 24, steps=3, cfg_scale=3.0, seed=7)
    assert a.dtype == np.uint8 and a.shape == (4, 16, 24, 3)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, sample(gen, PROMPTS, 16, 24, steps=3, cfg_scale=3.0, seed=8))
    assert len(np.unique(a)) > 10  # not a constant image


def test_batching_does_not_change_the_images(gen):
    whole = sample(gen, PROMPTS, 16, 16, steps=3, cfg_scale=2.0, seed=1, batch_size=16)
    split = sample(gen, PROMPTS, 16, 16, steps=3, cfg_scale=2.0, seed=1, batch_size=3)
    assert np.abs(whole.astype(int) - split.astype(int)).max() <= 1  # float reduction order only


def test_cfg_scale_one_is_the_conditional_euler_ode(gen):
    steps, shift = 4, resolution_shift(64)
    images = sample(gen, PROMPTS[:2], 16, 16, steps=steps, cfg_scale=1.0, seed=3)
    x = initial_noise(2, 3, 16, 16, seed=3)
    text = gen.encode_text(PROMPTS[:2])
    ts = euler_timesteps(steps, shift)
    with torch.no_grad():
        for i in range(steps):  # the ODE written out: x_{t_next} = x_t + (t_next - t) * v(x_t, t)
            x = x + (ts[i + 1] - ts[i]) * gen(x, ts[i].expand(2), text)
    expected = ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    assert np.array_equal(images, expected)
    assert not np.array_equal(images, sample(gen, PROMPTS[:2], 16, 16, steps=steps, cfg_scale=4.0, seed=3))


def test_noise_per_image_depends_on_seed_and_index_only():
    assert torch.equal(initial_noise(4, 3, 8, 8, seed=5)[2], initial_noise(3, 3, 8, 8, seed=5)[2])
    assert not torch.equal(initial_noise(2, 3, 8, 8, seed=5)[0], initial_noise(2, 3, 8, 8, seed=5)[1])


def test_sizes_must_be_patch_multiples(gen):
    with pytest.raises(ValueError, match="multiple"):
        sample(gen, PROMPTS[:1], 15, 16, steps=1, cfg_scale=1.0, seed=0)
