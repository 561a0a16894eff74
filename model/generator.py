"""The Generator: what the trainer trains, the sampler samples and the evaluator scores.

Trainable: the text fusion and the DiT. Held by reference (frozen, never saved, never in parameters()):
the HF text backbone and the autoencoder. Checkpoints are a folder with config.json (the ModelConfig, the
resolved DiTConfig, the backbone path) and model.safetensors (trainable weights only).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from kiln.config import ModelConfig
from model.attention import gelu_hidden
from model.autoencoder import Autoencoder, build_autoencoder, latent_channels_of
from model.dit import DiT, DiTConfig
from model.reference import ReferenceBatch, ReferencePathway
from model.sizes import get_size
from model.text_encoder import TextBackbone, TextBatch, TextFusion

FORMAT = "kiln-generator/1"


def resolve_dit_config(cfg: ModelConfig, in_channels: int | None = None) -> DiTConfig:
    """ModelConfig + the size registry -> the DiT's full shape (the ablation knobs override the size's)."""
    size = get_size(cfg.size)
    kv_heads = size.kv_heads if cfg.kv_heads is None else cfg.kv_heads
    if size.heads % kv_heads:
        raise ValueError(f"model.kv_heads={kv_heads} does not divide the {cfg.size} size's {size.heads} heads")
    return DiTConfig(
        width=size.width,
        depth=size.depth,
        heads=size.heads,
        kv_heads=kv_heads,
        mlp_hidden=size.mlp_hidden if cfg.mlp == "swiglu" else gelu_hidden(size.width),
        patch_size=cfg.patch_size,
        in_channels=in_channels or cfg.in_channels or latent_channels_of(cfg.autoencoder, cfg.autoencoder_path),
        modulation=cfg.modulation,
        timestep_tokens=cfg.timestep_tokens,
        pad_to_multiple=cfg.pad_to_multiple,
        qk_norm=cfg.qk_norm,
        gated_attention=cfg.attention_gate,
        rope_fraction=cfg.rope_fraction,
        mlp=cfg.mlp,
        abs_pos=cfg.abs_pos,
        prediction=cfg.prediction,
        pixel_head=cfg.pixel_head,
    )


class Generator(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dit_cfg: DiTConfig,
        backbone: TextBackbone,
        autoencoder: Autoencoder,
    ):
        super().__init__()
        if autoencoder.latent_channels != dit_cfg.in_channels:
            raise ValueError(
                f"model.in_channels={dit_cfg.in_channels} but the {cfg.autoencoder} autoencoder has "
                f"{autoencoder.latent_channels} latent channels"
            )
        self.cfg, self.dit_cfg = cfg, dit_cfg
        # plain attributes, not submodules: frozen and held by reference
        self.__dict__["backbone"] = backbone
        self.__dict__["autoencoder"] = autoencoder
        w = dit_cfg.width
        self.text_fusion = TextFusion(
            backbone.hidden_size, w, dit_cfg.heads, dit_cfg.kv_heads, cfg.text_encoder.refiner_layers
        )
        self.dit = DiT(dit_cfg)
        # the style-reference pathway (model/reference.py) only when enabled: without it the parameters,
        # the state dict and every output are what they were before it existed
        self.reference = ReferencePathway(cfg.reference, w) if cfg.reference.enabled else None
        self._null: TextBatch | None = None

    @classmethod
    def build(cls, cfg: ModelConfig, dit_cfg: DiTConfig | None = None) -> "Generator":
        te = cfg.text_encoder
        backbone = TextBackbone(te.path, te.layers, te.max_length, te.cache_dir, getattr(torch, te.dtype))
        autoencoder = build_autoencoder(cfg.autoencoder, cfg.autoencoder_path)
        return cls(cfg, dit_cfg or resolve_dit_config(cfg), backbone, autoencoder)

    # ------------------------------------------------------------------------------------------ text
    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def text_length(self) -> int:
        return self.backbone.max_length

    def encode_text(self, prompts: list[str]) -> TextBatch:
        """Frozen backbone states (no grad), on this module's device; cached on disk when configured."""
        if self.backbone.device != self.device:
            self.backbone.to(self.device)
        return self.backbone.encode(list(prompts)).to(self.device)

    def null_text(self, batch: int) -> TextBatch:
        """The empty prompt, repeated: the unconditional branch for caption dropout and CFG."""
        if self._null is None or self._null.hidden.device != self.device:
            self._null = self.encode_text([""])
        return TextBatch(self._null.hidden.expand(batch, -1, -1, -1), self._null.mask.expand(batch, -1))

    # ------------------------------------------------------------------------------------------ model
    def forward(self, x: Tensor, t: Tensor, text: TextBatch, refs: ReferenceBatch | None = None, route=None) -> Tensor:
        """Predicted velocity (eps - x0) for x [B, C, H, W] at times t [B] given the text (and style
        references with their strengths, from `encode_references`). `route`: training's token routing
        (model/routing.py), None = every token through every block."""
        tokens, mask = self.text_fusion(text.to(x.device))
        extra = {"route": route} if route is not None else {}
        if refs is None:
            return self.dit(x, t, tokens, mask, **extra)
        if self.reference is None:
            raise ValueError("this generator has no reference pathway (model.reference.enabled is false)")
        return self.dit(x, t, tokens, mask, self.reference(refs.to(x.device)), **extra)

    def encode_references(self, images, strengths) -> ReferenceBatch:
        """Per sample a list of uint8 [H, W, 3] reference images and their strengths in [0, 1] -> the
        reference pathway's inputs (padded with strength-0 references), on this module's device."""
        if self.reference is None:
            raise ValueError("this generator has no reference pathway (model.reference.enabled is false)")
        return self.reference.prepare(images, strengths).to(self.device)

    def with_references(self, reference_cfg) -> Generator:
        """A copy of this generator with the reference pathway (`reference_cfg`, a ReferenceConfig with
        enabled=True) added at its initialisation, and every existing weight kept."""
        cfg = self.cfg.model_copy(update={"reference": reference_cfg.model_copy(update={"enabled": True})})
        gen = Generator(cfg, self.dit_cfg, self.backbone, self.autoencoder)
        missing, unexpected = gen.load_state_dict(self.state_dict(), strict=False)
        if unexpected or any(not k.startswith("reference.") for k in missing):
            raise ValueError(f"cannot add a reference pathway: missing {missing}, unexpected {unexpected}")
        return gen.to(self.device)

    def tokens_per_sample(self, height: int, width: int) -> int:
        """Sequence length one sample occupies (text + patches + padding) for input [C, height, width]."""
        return self.dit.sequence_length(self.text_length, height, width)

    def flops_per_sample(self, height: int, width: int, training: bool = True) -> int:
        """FLOPs of the trainable network for one sample of input size height x width (latent pixels).
        Training counts forward + backward as 3x forward; the frozen backbone is excluded (it is cached)."""
        fwd = self.dit.flops_per_sample(self.text_length, height, width) + self.text_fusion.flops_per_sample(
            self.text_length
        )
        return 3 * fwd if training else fwd

    def flops_per_token(self, height: int, width: int, training: bool = True) -> float:
        """flops_per_sample per image token (patch): multiply by image tokens/s for achieved FLOP/s."""
        p = self.dit_cfg.patch_size
        return self.flops_per_sample(height, width, training) / ((height // p) * (width // p))

    def num_params(self, trainable_only: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        if not trainable_only:
            n += sum(p.numel() for p in self.backbone.model.parameters())
        return n

    # ---------------------------------------------------------------------------------------- storage
    def save_pretrained(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        meta = {
            "format": FORMAT,
            "model": self.cfg.model_dump(mode="json"),
            "dit": self.dit_cfg.to_dict(),
            # as configured (None: the packaged MiniLM), never the resolved install path: that names the checkout's
            # virtual environment, and the same run in another clone must write the same bytes (dvc.lock pins them)
            "text_encoder_path": self.cfg.text_encoder.path,
            "text_hidden_size": self.backbone.hidden_size,
            "num_params": self.num_params(),
        }
        (d / "config.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(d / "model.safetensors"), metadata={"format": FORMAT})

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: torch.device | str = "cpu") -> "Generator":
        d = Path(directory)
        meta = json.loads((d / "config.json").read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"{d} is not a kiln generator checkpoint (format {meta.get('format')!r})")
        cfg = ModelConfig.model_validate(meta["model"])
        gen = cls.build(cfg, DiTConfig(**meta["dit"]))
        gen.load_state_dict(load_file(str(d / "model.safetensors")), strict=True)
        return gen.to(device)
