"""Autoencoder adapters: pixel space is exact; AutoencoderKL by path normalises and caches its latents."""

import numpy as np
import pytest
import torch

from model.autoencoder import KLAutoencoder, LatentCache, PixelAutoencoder
from model.generator import Generator
from model.sampler import sample
from model.testing import micro_model_config, write_tiny_autoencoder_kl, write_tiny_text_encoder


def images(n=3, h=16, w=24, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


def test_pixel_space_round_trips_exactly_through_minus_one_to_one():
    ae = PixelAutoencoder()
    x = ae.encode(images())
    assert x.shape == (3, 3, 16, 24) and x.dtype == torch.float32
    assert x.min() >= -1 and x.max() <= 1
    assert np.array_equal(ae.decode(x).numpy(), images())
    assert ae.decode(torch.full((1, 3, 2, 2), 5.0)).max() == 255  # clamped, not wrapped


def test_pixel_space_refuses_non_uint8_images():
    with pytest.raises(ValueError, match="uint8"):
        PixelAutoencoder().encode(images().astype(np.float32))


@pytest.mark.parametrize("stats", [False, True])
def test_kl_latents_are_normalised_by_the_vae_config(tmp_path, stats):
    ae = KLAutoencoder(write_tiny_autoencoder_kl(tmp_path / "vae", latents_stats=stats))
    assert (ae.latent_channels, ae.downsample) == (4, 2)
    imgs = images()
    z = ae.encode(imgs)
    assert z.shape == (3, 4, 8, 12)
    raw = ae.vae.encode(torch.as_tensor(imgs).permute(0, 3, 1, 2).float() / 127.5 - 1).latent_dist.mode()
    if stats:
        mean = torch.tensor([0.0, 0.1, 0.2, 0.3]).view(1, 4, 1, 1)
        std = torch.tensor([1.0, 1.5, 2.0, 2.5]).view(1, 4, 1, 1)
        expected = (raw - mean) / std
    else:
        expected = (raw - 0.1) * 0.5
    assert torch.allclose(z, expected, atol=1e-5)
    assert torch.equal(ae.encode(imgs), z)  # the posterior mode: deterministic
    decoded = ae.decode(z)
    assert decoded.shape == (3, 16, 24, 3) and decoded.dtype == torch.uint8
    assert torch.equal(decoded, ae.decode(ae.encode(imgs)))


def test_latent_cache_computes_once_and_returns_the_same_latents(tmp_path):
    ae = KLAutoencoder(write_tiny_autoencoder_kl(tmp_path / "vae"))
    cache = LatentCache(tmp_path / "latents", ae)
    imgs = images(4)
    first = cache.encode(imgs)
    assert len(list((tmp_path / "latents").rglob("*.safetensors"))) == 4
    with torch.no_grad():  # a hit must not run the VAE: break it and read again
        for p in ae.vae.parameters():
            p.fill_(float("nan"))
    assert torch.equal(cache.encode(imgs[::-1].copy()), first.flip(0))


def test_a_generator_in_kl_latent_space_trains_saves_and_samples(tmp_path):
    cfg = micro_model_config(
        write_tiny_text_encoder(tmp_path / "bert"),
        autoencoder="kl",
        autoencoder_path=str(write_tiny_autoencoder_kl(tmp_path / "vae")),
        in_channels=4,
    )
    gen = Generator.build(cfg)
    z = gen.autoencoder.encode(images(2, 16, 16))
    v = gen(z, torch.rand(2), gen.encode_text(["a red circle", "a blue square"]))
    assert v.shape == z.shape == (2, 4, 8, 8)
    gen.save_pretrained(tmp_path / "ckpt")
    loaded = Generator.from_pretrained(tmp_path / "ckpt")
    out = sample(loaded, ["a red circle"], 16, 16, steps=2, cfg_scale=2.0, seed=0)
    assert out.shape == (1, 16, 16, 3) and out.dtype == np.uint8
