"""Latents for the pack stage (data.pack.latents_from): each fitted image encoded once by the model's autoencoder.

The report and PRX train on precomputed VAE latents: the VAE's forward then runs once per image, not once per
image and epoch, and a step reads a fraction of the bytes (a 16-channel f8 latent of a 256-px image is 32 KB in
float16, its PNG about 150 KB). The images stay in the shards beside the latents (evaluation's references and
REPA's encoder read them); the trainer reads only the latents.

A latent train set is only as good as its autoencoder, so before encoding the whole set the stage measures
decode(encode(x)) on the held-out rows (the smallest sha1(id), as evaluation holds out) and refuses an
autoencoder whose mean PSNR is below `data.pack.min_psnr`: a wrong folder, a VAE of another resolution or
colour space, random weights. The figure of the stored latents (their float16 rounding included) goes into
the manifest.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from kiln.config import KilnConfig
from kiln.progress import log
from kiln.trainshards import LatentInfo, decode_image, decode_latent, encode_latent


@functools.lru_cache(maxsize=2)
def load_autoencoder(path: str):
    """The autoencoder on the best device here (loaded once per process: the check and the encode share it)."""
    import torch

    from model.autoencoder import load_vae

    return load_vae(path, "cuda" if torch.cuda.is_available() else "cpu")


def autoencoder_of(cfg: KilnConfig):
    assert cfg.data.pack.latents_from is not None
    return load_autoencoder(cfg.data.pack.latents_from)


def psnr_db(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of two uint8 images (inf when identical)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def mean_psnr(originals: Sequence[np.ndarray], reconstructions: Sequence[np.ndarray]) -> float:
    """Mean of the per-image PSNRs, identical images counted at 100 dB (so one cannot make the mean infinite)."""
    values = [min(psnr_db(a, b), 100.0) for a, b in zip(originals, reconstructions, strict=True)]
    return float(np.mean(values)) if values else math.nan


def _by_shape(images: Sequence[np.ndarray]) -> dict[tuple, list[int]]:
    groups: dict[tuple, list[int]] = {}
    for k, im in enumerate(images):
        groups.setdefault(im.shape, []).append(k)
    return groups


def _batched(fn, arrays: Sequence[np.ndarray], batch: int) -> list[np.ndarray]:
    """`fn` over `arrays` stacked `batch` at a time among those of one shape; the results in input order."""
    out: list[np.ndarray | None] = [None] * len(arrays)
    for ks in _by_shape(arrays).values():
        for s in range(0, len(ks), batch):
            part = ks[s : s + batch]
            for k, y in zip(part, fn(np.stack([arrays[k] for k in part])), strict=True):
                out[k] = y
    return out  # type: ignore[return-value]


def encode(ae, images: Sequence[np.ndarray], batch: int) -> list[np.ndarray]:
    """Each uint8 HxWx3 image's latent [C, h, w] (float32)."""
    return _batched(lambda x: ae.encode(x).float().cpu().numpy(), images, batch)


def decode(ae, latents: Sequence[np.ndarray], batch: int) -> list[np.ndarray]:
    """Each latent's uint8 HxWx3 image."""
    import torch

    return _batched(lambda z: ae.decode(torch.from_numpy(z)).numpy(), latents, batch)


def round_trip(latent: np.ndarray, dtype: str) -> np.ndarray:
    """The latent as the shards will hold it."""
    return decode_latent(encode_latent(latent, dtype))  # type: ignore[arg-type]


def check_autoencoder(cfg: KilnConfig, images: Sequence[np.ndarray]) -> float:
    """The autoencoder's mean PSNR on `images` (the held-out rows, fitted to their buckets), through the
    stored dtype; a ValueError naming the figure when it is below data.pack.min_psnr."""
    pc = cfg.data.pack
    ae = autoencoder_of(cfg)
    stored = [round_trip(z, pc.latent_dtype) for z in encode(ae, images, pc.encode_batch)]
    score = mean_psnr(images, decode(ae, stored, pc.encode_batch))
    log.info("pack: autoencoder %s reconstructs %d held-out rows at %.2f dB PSNR", ae.identity(), len(images), score)
    if not score >= pc.min_psnr:
        raise ValueError(
            f"data.pack.latents_from: the autoencoder at {pc.latents_from} reconstructs the {len(images)} "
            f"held-out rows at {score:.2f} dB PSNR, below data.pack.min_psnr={pc.min_psnr:g}: the wrong folder, "
            "random weights, or a VAE not made for these images? Nothing was written."
        )
    return score


def latent_info(cfg: KilnConfig, held: Sequence[tuple[bytes, bytes]]) -> LatentInfo:
    """The manifest's record of a latent train set, its PSNR measured on what the shards hold: `held` is the
    held-out rows' (encoded image, latent .npy) pairs."""
    pc, ae = cfg.data.pack, autoencoder_of(cfg)
    images = [decode_image(image) for image, _ in held]
    score = mean_psnr(images, decode(ae, [decode_latent(z) for _, z in held], pc.encode_batch))
    return LatentInfo(
        ae.identity(), ae.latent_channels, ae.downsample, pc.latent_dtype, round(score, 4), len(held), pc.min_psnr
    )
