"""A VLM by path, as every model stage uses one: loading (once per process), the chat prompt, a padded batch of
images and prompts, the generate() settings recorded with each output, and the captioner built on them.

Any image-text-to-text model with its processor, loaded by local path through `AutoModelForImageTextToText` /
`AutoProcessor`; `VLMCaptioner` prompts it with the OCR text and the image metadata, batched, greedy by default so
the same rows give the same captions. Its users: the captioners (assets.caption, assets.captioners), the classify
stage's `VLMLabeller`, the cluster namer, the rewriter's settings, the rubric judge (training.evaluation.rubric).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

import pyarrow as pa

from kiln.config import CaptionConfig
from kiln.imageio import open_rgb
from kiln.uri import read_bytes


@dataclass(frozen=True)
class GenerationSettings:
    """The generate() arguments that decide the text; recorded with every caption and rewrite."""

    max_new_tokens: int = 64
    min_new_tokens: int = 1
    num_beams: int = 1
    do_sample: bool = False
    seed: int = 0

    def kwargs(self) -> dict:
        kw = {
            "max_new_tokens": self.max_new_tokens,
            "min_new_tokens": self.min_new_tokens,
            "num_beams": self.num_beams,
            "do_sample": self.do_sample,
        }
        return kw if self.do_sample else kw | {"temperature": None, "top_p": None, "top_k": None}


def seed_everything(seed: int) -> None:
    import torch

    torch.manual_seed(seed)


def ocr_clause(ocr_text: str) -> str:
    text = " ".join(ocr_text.split())
    return f' It shows the text: "{text}".' if text else ""


def build_prompt(template: str, row: dict) -> str:
    """The VLM instruction for one row: the OCR text and the image's metadata filled into the template."""
    return template.format(
        ocr=ocr_clause(row.get("ocr_text") or ""),
        width=row["width"],
        height=row["height"],
        format=row.get("format") or "unknown",
    )


def load_vlm(path: str, device: str = "cpu"):
    """Model + processor from one local folder (the product's only loading path; tests use it too).

    Shared by every VLM user (this captioner, assets.classify.VLMLabeller); loaded once per process."""
    return _load_vlm(path, device)


@lru_cache(maxsize=2)
def _load_vlm(path: str, device: str):
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    processor.tokenizer.padding_side = (
        "left"  # batched: every prompt ends at the last position, where the answer starts
    )
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval().to(device)
    return model, processor


def chat_text(processor, prompt: str) -> str:
    """One image and one instruction as the model expects them: its chat template, with the answer prompt."""
    if getattr(processor, "chat_template", None):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        return processor.apply_chat_template(messages, add_generation_prompt=True)
    return f"{processor.image_token}\n{prompt}"  # processors without a template: image placeholder, then the ask


def vlm_inputs(processor, uris: list[str], prompts: list[str], device: str = "cpu", max_pixels: int = 64_000_000):
    """One padded batch: each image opened as every stage opens it (EXIF-upright RGB), each prompt in the chat template."""
    images = [open_rgb(read_bytes(u), max_pixels) for u in uris]
    texts = [chat_text(processor, p) for p in prompts]
    return processor(images=images, text=texts, return_tensors="pt", padding=True).to(device)


class VLMCaptioner:
    """A VLM caption for each row, given the image, its OCR text and its size."""

    def __init__(self, path: str, prompt: str, batch_size: int = 8, settings: GenerationSettings | None = None):
        self.path, self.prompt, self.batch_size, self.settings = (
            path,
            prompt,
            batch_size,
            settings or GenerationSettings(),
        )
        self.model, self.processor = load_vlm(path)
        self.name = f"vlm:{self.model.config.model_type}"
        self.decoding = {"model": path, "prompt": prompt, "batch_size": batch_size, **asdict(self.settings)}

    @classmethod
    def from_config(cls, cfg: CaptionConfig) -> VLMCaptioner:
        if not cfg.vlm_path:
            raise ValueError("captioner=vlm needs data.caption.vlm_path (a local model + processor folder)")
        s = GenerationSettings(cfg.max_new_tokens, cfg.min_new_tokens, cfg.num_beams, cfg.do_sample, cfg.seed)
        return cls(cfg.vlm_path, cfg.prompt, cfg.batch_size, s)

    def caption(self, rows: pa.Table) -> list[str | None]:
        import torch

        records = rows.select(
            [c for c in ("uri", "width", "height", "format", "ocr_text") if c in rows.column_names]
        ).to_pylist()
        out: list[str | None] = []
        for start in range(0, len(records), self.batch_size):
            batch = records[start : start + self.batch_size]
            inputs = vlm_inputs(
                self.processor, [r["uri"] for r in batch], [build_prompt(self.prompt, r) for r in batch]
            )
            seed_everything(self.settings.seed + start)
            with torch.no_grad():
                ids = self.model.generate(**inputs, **self.settings.kwargs())
            new = ids[:, inputs["input_ids"].shape[1] :]
            out += [t.strip() or None for t in self.processor.batch_decode(new, skip_special_tokens=True)]
        return out
