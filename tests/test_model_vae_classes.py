"""The report's autoencoders by path: each diffusers class loads through its own adapter and gives the latents
its own diffusers pipeline trains on (checked against the pipeline's code, with statistics far from identity);
a class kiln does not handle is refused by name, never loaded as another; the identity follows the weights."""

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from model.autoencoder import (
    Flux2Autoencoder,
    KLAutoencoder,
    QwenImageAutoencoder,
    load_vae,
    patchify2x2,
    unpatchify2x2,
)
from model.testing import write_tiny_autoencoder_flux2, write_tiny_autoencoder_kl, write_tiny_autoencoder_qwenimage


def images(n=2, h=16, w=24, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


def pixels(imgs):
    return torch.as_tensor(imgs).permute(0, 3, 1, 2).float() / 127.5 - 1


@pytest.mark.parametrize(
    "write", [write_tiny_autoencoder_kl, write_tiny_autoencoder_flux2, write_tiny_autoencoder_qwenimage]
)
def test_the_token_side_read_from_config_json_is_the_loaded_vaes(tmp_path, write):
    """What the pack stage cuts buckets by (config.json alone) is what the loaded VAE's latents shrink by."""
    from model.autoencoder import token_side

    vae = write(tmp_path / "vae")
    z = load_vae(vae).encode(images(h=16, w=32))
    assert token_side("kl", str(vae), 3) == 16 // z.shape[-2] * 3 == 32 // z.shape[-1] * 3


def test_a_flux2_folder_loads_as_flux2_and_matches_its_pipelines_latents(tmp_path):
    from diffusers import Flux2Pipeline

    ae = load_vae(write_tiny_autoencoder_flux2(tmp_path / "vae"))
    assert isinstance(ae, Flux2Autoencoder)
    assert (ae.latent_channels, ae.downsample) == (16, 4)  # 4 channels patchified 2x2, on a VAE that halves
    z = ae.encode(images())
    pipe = SimpleNamespace(vae=ae.vae, _patchify_latents=Flux2Pipeline._patchify_latents)
    with torch.no_grad():
        expected = Flux2Pipeline._encode_vae_image(pipe, pixels(images()), generator=None)
    assert z.shape == (2, 16, 4, 6) and torch.allclose(z, expected, atol=1e-5)
    assert torch.equal(ae.encode(images()), z)  # the posterior mode: deterministic
    with torch.no_grad():
        raw = ae.vae.decode(Flux2Pipeline._unpatchify_latents(expected * ae.std + ae.mean)).sample
    assert torch.equal(ae.decode(z), ((raw.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1))


def test_a_qwen_image_folder_gives_four_dimensional_latents_its_pipeline_gives_in_five(tmp_path):
    from diffusers import QwenImageEditPipeline

    ae = load_vae(write_tiny_autoencoder_qwenimage(tmp_path / "vae"))
    assert isinstance(ae, QwenImageAutoencoder) and (ae.latent_channels, ae.downsample) == (4, 2)
    z = ae.encode(images())
    pipe = SimpleNamespace(vae=ae.vae, latent_channels=4)
    with torch.no_grad():
        expected = QwenImageEditPipeline._encode_vae_image(pipe, pixels(images()).unsqueeze(2), generator=None)
    assert z.shape == (2, 4, 8, 12) and torch.allclose(z, expected[:, :, 0], atol=1e-5)
    assert ae.decode(z).shape == (2, 16, 24, 3)


def test_an_autoencoder_kl_folder_keeps_its_adapter(tmp_path):
    assert type(load_vae(write_tiny_autoencoder_kl(tmp_path / "vae"))) is KLAutoencoder


def test_patchify_puts_each_2x2_cell_in_consecutive_channels_and_inverts():
    z = torch.randn(2, 3, 6, 8)
    p = patchify2x2(z)
    for dy in (0, 1):
        for dx in (0, 1):
            assert torch.equal(p[:, 2 * dy + dx :: 4], z[:, :, dy::2, dx::2])
    assert torch.equal(unpatchify2x2(p), z)


@pytest.mark.parametrize("name", ["AutoencoderKLQwenImage21", "AutoencoderDC", None])
def test_a_class_kiln_does_not_handle_is_refused_by_name_before_loading(tmp_path, name):
    folder = write_tiny_autoencoder_kl(tmp_path / "vae")
    config = json.loads((folder / "config.json").read_text())
    config.pop("_class_name")
    if name:
        config["_class_name"] = name
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"_class_name is {name!r}"):
        load_vae(folder)


def test_a_folder_without_a_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_vae(tmp_path)


def test_the_identity_follows_the_weights_and_statistics_not_the_folder(tmp_path):
    first = write_tiny_autoencoder_flux2(tmp_path / "a")
    moved = shutil.copytree(first, tmp_path / "elsewhere")
    assert load_vae(first).identity() == load_vae(moved).identity()
    other = load_vae(first)
    with torch.no_grad():
        other.vae.bn.running_var.mul_(1.01)  # only a batch-norm statistic differs
    other._identity = None
    assert other.identity() != load_vae(first).identity()
    assert load_vae(write_tiny_autoencoder_flux2(tmp_path / "b", seed=1)).identity() != load_vae(first).identity()


@pytest.mark.parametrize(
    ("write", "channels"),
    [(write_tiny_autoencoder_kl, 4), (write_tiny_autoencoder_flux2, 16), (write_tiny_autoencoder_qwenimage, 4)],
)
def test_the_dits_input_channels_follow_the_vae_when_unset(tmp_path, text_encoder_dir, write, channels):
    from model.generator import Generator, resolve_dit_config
    from model.testing import micro_model_config

    vae = write(tmp_path / "vae")
    cfg = micro_model_config(text_encoder_dir, autoencoder="kl", autoencoder_path=str(vae))
    assert resolve_dit_config(cfg).in_channels == channels == Generator.build(cfg).dit_cfg.in_channels
    with pytest.raises(ValueError, match="latent channels"):  # a value set by hand must agree
        Generator.build(
            micro_model_config(text_encoder_dir, autoencoder="kl", autoencoder_path=str(vae), in_channels=channels + 1)
        )
