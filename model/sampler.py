"""Euler ODE sampling from t = 1 (noise) to t = 0 (data) with classifier-free guidance.

Noise for image i depends only on (seed, i) and the latent shape, never on batch_size, so a seed gives the
same images however they are batched. cfg_scale == 1 runs the conditional branch alone (it is exactly
v_uncond + 1 * (v_cond - v_uncond)).
"""

from __future__ import annotations

import numpy as np
import torch

from model.flow import euler_timesteps, resolution_shift
from model.generator import Generator
from model.reference import ReferenceBatch
from model.text_encoder import TextBatch


def initial_noise(n: int, channels: int, height: int, width: int, seed: int) -> torch.Tensor:
    """[n, C, h, w] float32 CPU noise; row i is drawn from its own generator seeded (seed, i)."""
    rows = []
    for i in range(n):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        rows.append(torch.randn(channels, height, width, generator=g))
    return torch.stack(rows)


@torch.no_grad()
def denoise(
    gen: Generator,
    noise: torch.Tensor,
    text: TextBatch,
    steps: int,
    cfg_scale: float,
    shift: float,
    refs: ReferenceBatch | None = None,
) -> torch.Tensor:
    """Integrate dx/dt = v from t=1 to t=0 in `steps` Euler steps; returns the final latents. Style
    references (`refs`) condition both CFG branches: guidance amplifies the text, the strengths set the style."""
    x = noise.to(gen.device)
    ts = euler_timesteps(steps, shift).to(gen.device)
    b = x.shape[0]
    guided = cfg_scale != 1.0
    if guided:  # one forward over [cond; uncond]
        text = TextBatch.cat([text.to(gen.device), gen.null_text(b)])
        refs = ReferenceBatch.cat([refs, refs]) if refs is not None else None
    extra = {"refs": refs} if refs is not None else {}
    for i in range(steps):
        t = ts[i].expand(b)
        if guided:
            v_cond, v_uncond = gen(torch.cat([x, x]), torch.cat([t, t]), text, **extra).chunk(2)
            v = v_uncond + cfg_scale * (v_cond - v_uncond)
        else:
            v = gen(x, t, text, **extra)
        x = x + (ts[i + 1] - ts[i]) * v
    return x


@torch.no_grad()
def sample(
    gen: Generator,
    prompts: list[str],
    height: int,
    width: int,
    steps: int,
    cfg_scale: float,
    seed: int,
    shift: float | None = None,
    batch_size: int = 16,
    refs: ReferenceBatch | None = None,
) -> np.ndarray:
    """uint8 [N, height, width, 3] images for the prompts (pixel sizes; latents are height/downsample);
    `refs`: one row of style references per prompt (Generator.encode_references)."""
    ae, p = gen.autoencoder, gen.dit_cfg.patch_size
    ds = ae.downsample
    if height % (ds * p) or width % (ds * p):
        raise ValueError(f"{height}x{width} must be a multiple of downsample*patch = {ds * p}")
    h, w = height // ds, width // ds
    if shift is None:
        shift = resolution_shift((h // p) * (w // p))
    was_training = gen.training
    gen.eval()
    noise = initial_noise(len(prompts), ae.latent_channels, h, w, seed)
    out = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        text = gen.encode_text(chunk)
        rows = (
            None
            if refs is None
            else ReferenceBatch(refs.inputs[start : start + len(chunk)], refs.strength[start : start + len(chunk)])
        )
        latents = denoise(gen, noise[start : start + len(chunk)], text, steps, cfg_scale, shift, rows)
        out.append(ae.decode(latents).numpy())
    gen.train(was_training)
    return np.concatenate(out) if out else np.zeros((0, height, width, 3), np.uint8)
