"""A latent train set (data.pack.latents_from): the model autoencoder's latent of every fitted image, stored beside
it, checked first on the held-out rows, and read by the trainer instead of running the VAE at each step."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from kiln.config import ConfigError, load_config
from kiln.stage import run_stage, write_table
from kiln.trainshards import Shard, decode_image, decode_latent, read_manifest
from model.autoencoder import KLAutoencoder
from model.testing import micro_model_config, write_tiny_autoencoder_kl

SIZES = [(64, 64)] * 8 + [(128, 64)] * 4 + [(64, 128)] * 4


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory) -> Path:
    """REWRITTEN rows over 16 smooth test images (a colour ramp each), as the pack stage reads them."""
    from test_pack import rewritten_table

    root = tmp_path_factory.mktemp("latents")
    rng = np.random.default_rng(3)
    paths = []
    for i, (w, h) in enumerate(SIZES):
        yy, xx = np.mgrid[0:h, 0:w] / max(w, h)
        ramp = np.stack([xx, yy, 1 - xx], axis=-1) * rng.uniform(0.5, 1.0, 3)
        paths.append(root / "img" / f"{i:03d}.png")
        paths[-1].parent.mkdir(exist_ok=True)
        Image.fromarray((ramp * 255).astype(np.uint8)).save(paths[-1])
    write_table(rewritten_table(paths), root / "rewritten" / "part-00000.parquet")
    return root / "rewritten"


@pytest.fixture(scope="module")
def vae(tmp_path_factory) -> Path:
    return write_tiny_autoencoder_kl(tmp_path_factory.mktemp("vae") / "vae")


def pack_config(vae: Path, *extra: str):
    return load_config(
        [
            "data.pack.resolution=32",
            "data.pack.batch_size=4",
            "cluster.workers=1",
            "model.autoencoder=kl",
            f"model.autoencoder_path={vae}",
            "model.in_channels=4",
            f"data.pack.latents_from={vae}",
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def latent_set(rewritten, vae, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "train_set"
    run_stage(
        "pack", rewritten, out, pack_config(vae, "data.pack.min_psnr=0", "data.pack.psnr_rows=5")
    )  # random weights pass only at 0 dB
    return out


def test_every_sample_carries_its_images_latent_as_the_autoencoder_encodes_it(latent_set, vae):
    manifest, ae = read_manifest(latent_set), KLAutoencoder(vae)
    assert manifest.latents is not None
    assert (manifest.latents.autoencoder, manifest.latents.channels, manifest.latents.downsample) == (
        ae.identity(),
        4,
        2,
    )
    assert manifest.latents.dtype == "float16" and manifest.latents.psnr_rows == 5
    for info in manifest.shards:
        shard = Shard(str(latent_set), info)
        rows = range(shard.rows)
        for (meta, image), (_, latent) in zip(shard.read(rows), shard.read(rows, "latent"), strict=True):
            pixels = decode_image(image)
            expected = ae.encode(pixels[None])[0].numpy()
            assert pixels.shape[:2] == (meta["height"], meta["width"])
            np.testing.assert_allclose(decode_latent(latent), expected, rtol=2e-3, atol=2e-3)  # float16 storage


def test_an_autoencoder_that_cannot_reconstruct_the_held_out_rows_is_refused_before_any_work(
    rewritten, vae, tmp_path, monkeypatch
):
    encoded, real = [], KLAutoencoder.encode
    monkeypatch.setattr(KLAutoencoder, "encode", lambda ae, images: encoded.extend(images) or real(ae, images))
    out = tmp_path / "train_set"
    with pytest.raises(ValueError, match=r"4 held-out rows at .* dB PSNR, below data.pack.min_psnr=25"):
        run_stage("pack", rewritten, out, pack_config(vae, "data.pack.psnr_rows=4"))  # random weights, the default
    assert len(encoded) == 4 and not out.exists()  # the held-out rows alone were encoded: nothing else was done


def test_the_psnr_recorded_is_the_stored_latents_mean_over_the_held_out_rows(latent_set, vae):
    from assets.pack_latents import mean_psnr
    from kiln.trainshards import holdout_ids

    ae = KLAutoencoder(vae)
    shards = [Shard(str(latent_set), info) for info in read_manifest(latent_set).shards]
    held = holdout_ids((i for shard in shards for i in shard.column("id")), 5)
    originals, decoded = [], []
    for shard in shards:
        rows = [r for r, i in enumerate(shard.column("id")) if i in held]
        for (_, image), (_, latent) in zip(shard.read(rows), shard.read(rows, "latent")):
            originals.append(decode_image(image))
            decoded.append(ae.decode(torch.from_numpy(decode_latent(latent))[None])[0].numpy())
    assert read_manifest(latent_set).latents.psnr_db == pytest.approx(mean_psnr(originals, decoded), abs=1e-3)


def test_latents_of_another_autoencoder_than_the_models_fail_at_config_validation(vae, tmp_path):
    with pytest.raises(ConfigError, match="the model's is model.autoencoder=pixel"):
        load_config([f"data.pack.latents_from={vae}"])
    other = ["model.autoencoder=kl", f"model.autoencoder_path={tmp_path}", f"data.pack.latents_from={vae}"]
    with pytest.raises(ConfigError, match="the trainer would refuse the train set"):
        load_config(other)
    assert load_config([*other[:2], f"data.pack.latents_from={tmp_path}/"]).data.pack.latents_from


def test_the_trainer_trains_on_the_stored_latents_and_refuses_another_autoencoders(
    latent_set, vae, text_encoder_dir, tmp_path
):
    from training.core.data import TrainSet, bucket_size
    from training.core.trainer import train
    from training.testing import tiny_config

    batch = next(TrainSet.from_dir(latent_set, 4).stream(0))
    assert batch.pixels is None and batch.latents.shape[1:] == (4, *(s // 2 for s in bucket_size(batch.bucket)))

    def cfg(autoencoder: Path):
        model = micro_model_config(text_encoder_dir, autoencoder="kl", autoencoder_path=str(autoencoder), in_channels=4)
        return tiny_config(text_encoder_dir, steps=3, holdout=0, batch_size=4).model_copy(update={"model": model})

    checkpoint = train(latent_set, tmp_path / "run", cfg(vae))  # batches without pixels: the latents feed it
    assert (Path(checkpoint) / "config.json").exists()
    other = write_tiny_autoencoder_kl(tmp_path / "other", latents_stats=True)
    with pytest.raises(ConfigError, match="holds latents of autoencoder"):
        train(latent_set, tmp_path / "other-run", cfg(other))


def test_the_image_bytes_do_not_depend_on_storing_latents(rewritten, latent_set, vae, tmp_path):
    plain = tmp_path / "plain"
    run_stage("pack", rewritten, plain, load_config(["data.pack.resolution=32", "data.pack.batch_size=4"]))
    a, b = read_manifest(plain), read_manifest(latent_set)
    assert a.rows == b.rows and a.latents is None
    images = {
        hashlib.sha256(image).hexdigest()
        for root, m in ((plain, a), (latent_set, b))
        for info in m.shards
        for _, image in Shard(str(root), info).read(range(info.rows))
    }
    assert len(images) == a.rows  # the same images, stored once per row in both sets
