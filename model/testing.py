"""Tiny, randomly initialised real components for tests (here and in training/): real classes from
configs, saved with save_pretrained and loaded back through the product's own from_pretrained path."""

from __future__ import annotations

from pathlib import Path

from kiln.config import ModelConfig, TextEncoderConfig

WORDS = (
    "a an the of on in with and red green blue yellow white black orange purple circle square triangle "
    "star dot stripe background small large big two three one left right top bottom centre center photo "
    "image picture scene sky grass sea cat dog house tree car"
).split()


def write_tiny_text_encoder(directory: str | Path, layers: int = 3, hidden: int = 32, seed: int = 0) -> Path:
    """A random BertModel (hidden 32, `layers` layers) + a BertTokenizerFast over a small vocabulary."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    vocab = d / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    tok = BertTokenizerFast(vocab_file=str(vocab), do_lower_case=True)
    tok.save_pretrained(str(d))
    config = BertConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    BertModel(config).eval().save_pretrained(str(d))
    return d


def write_tiny_autoencoder_kl(
    directory: str | Path, latent_channels: int = 4, seed: int = 0, latents_stats: bool = False
) -> Path:
    """A random diffusers AutoencoderKL with two down blocks (downsample 2)."""
    import torch
    from diffusers import AutoencoderKL

    kwargs = {}
    if latents_stats:
        kwargs = {
            "latents_mean": [0.1 * i for i in range(latent_channels)],
            "latents_std": [1.0 + 0.5 * i for i in range(latent_channels)],
        }
    torch.manual_seed(seed)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=32,
        scaling_factor=0.5,
        shift_factor=0.1,
        **kwargs,
    )
    d = Path(directory)
    vae.eval().save_pretrained(str(d))
    return d


TINY_VAE_BLOCKS = {
    "down_block_types": ("DownEncoderBlock2D", "DownEncoderBlock2D"),
    "up_block_types": ("UpDecoderBlock2D", "UpDecoderBlock2D"),
    "block_out_channels": (8, 16),
    "layers_per_block": 1,
    "norm_num_groups": 4,
    "sample_size": 32,
}


def write_tiny_autoencoder_flux2(directory: str | Path, latent_channels: int = 4, seed: int = 0) -> Path:
    """A random diffusers AutoencoderKLFlux2 (VAE downsample 2; 4x the channels at 4x once patchified) with
    batch-norm statistics far from (0, 1), so a loader that ignores them gives other latents."""
    import torch
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(in_channels=3, out_channels=3, latent_channels=latent_channels, **TINY_VAE_BLOCKS)
    n = 4 * latent_channels
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.linspace(-0.5, 0.5, n))
        vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, n))
    d = Path(directory)
    vae.eval().save_pretrained(str(d))
    return d


def write_tiny_autoencoder_qwenimage(directory: str | Path, z_dim: int = 4, seed: int = 0) -> Path:
    """A random diffusers AutoencoderKLQwenImage (downsample 2) with per-channel latent statistics."""
    import torch
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=z_dim,
        dim_mult=[1, 2],
        num_res_blocks=1,
        temperal_downsample=[False],
        latents_mean=[0.1 * i for i in range(z_dim)],
        latents_std=[1.0 + 0.5 * i for i in range(z_dim)],
    )
    d = Path(directory)
    vae.eval().save_pretrained(str(d))
    return d


def micro_model_config(text_encoder_dir: str | Path, **overrides) -> ModelConfig:
    """The `micro` DiT over a tiny text encoder: milliseconds per forward, for unit tests."""
    te = TextEncoderConfig(path=str(text_encoder_dir), max_length=16, layers=[-1, -2, -3], refiner_layers=1)
    fields = {"size": "micro", "patch_size": 2, "pad_to_multiple": 16, "text_encoder": te}
    fields.update(overrides)
    return ModelConfig(**fields)
