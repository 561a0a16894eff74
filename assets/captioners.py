"""Captioners that see the OCR text: a VLM through transformers, and the demo's honest metadata captioner.

Both go through the `Captioner` interface of assets.caption and the `caption_ocr` stage below, which
runs after the OCR stage and stores, next to every caption, how it was produced (`caption_decoding`).

- `VLMCaptioner`: any image-text-to-text model with its processor, loaded by local path through
  `AutoModelForImageTextToText` / `AutoProcessor`, prompted with the OCR text and the image metadata,
  batched, greedy by default so the same rows give the same captions.
- `OCRGroundedCaptioner`: wraps a captioner that cannot read (the demo's scene-metadata lookup) and
  adds the OCR'd text where its caption does not already quote it; named for both halves.

The VLM helpers (`load_vlm`, `chat_text`, `vlm_inputs`, `GenerationSettings`) are shared with the other
VLM users: the classify stage's `VLMLabeller` loads, prompts and batches through them too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

import pyarrow as pa

from assets.caption import Captioner, caption_rows, make_captioner
from assets.imageio import open_rgb
from kiln.config import CaptionConfig, KilnConfig
from kiln.schemas import OCR_CAPTIONED, OCRED
from kiln.stage import Stage, StageOutput
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
        kw = {"max_new_tokens": self.max_new_tokens, "min_new_tokens": self.min_new_tokens, "num_beams": self.num_beams, "do_sample": self.do_sample}
        return kw if self.do_sample else kw | {"temperature": None, "top_p": None, "top_k": None}


def seed_everything(seed: int) -> None:
    import torch

    torch.manual_seed(seed)


def ocr_clause(ocr_text: str) -> str:
    text = " ".join(ocr_text.split())
    return f' It shows the text: "{text}".' if text else ""


def build_prompt(template: str, row: dict) -> str:
    """The VLM instruction for one row: the OCR text and the image's metadata filled into the template."""
    return template.format(ocr=ocr_clause(row.get("ocr_text") or ""), width=row["width"], height=row["height"], format=row.get("format") or "unknown")


def load_vlm(path: str, device: str = "cpu"):
    """Model + processor from one local folder (the product's only loading path; tests use it too).

    Shared by every VLM user (this captioner, assets.classify.VLMLabeller); loaded once per process."""
    return _load_vlm(path, device)


@lru_cache(maxsize=2)
def _load_vlm(path: str, device: str):
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    processor.tokenizer.padding_side = "left"  # batched: every prompt ends at the last position, where the answer starts
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
        self.path, self.prompt, self.batch_size, self.settings = path, prompt, batch_size, settings or GenerationSettings()
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

        records = rows.select([c for c in ("uri", "width", "height", "format", "ocr_text") if c in rows.column_names]).to_pylist()
        out: list[str | None] = []
        for start in range(0, len(records), self.batch_size):
            batch = records[start : start + self.batch_size]
            inputs = vlm_inputs(self.processor, [r["uri"] for r in batch], [build_prompt(self.prompt, r) for r in batch])
            seed_everything(self.settings.seed + start)
            with torch.no_grad():
                ids = self.model.generate(**inputs, **self.settings.kwargs())
            new = ids[:, inputs["input_ids"].shape[1] :]
            out += [t.strip() or None for t in self.processor.batch_decode(new, skip_special_tokens=True)]
        return out


class OCRGroundedCaptioner:
    """A reading-blind captioner plus the OCR: quotes the OCR'd text where the caption does not."""

    def __init__(self, base: Captioner, engine: str):
        self.base = base
        self.name = f"{base.name}+ocr:{engine}"
        self.decoding = {"method": "lookup+ocr", "base": base.name, "ocr_engine": engine}

    def caption(self, rows: pa.Table) -> list[str | None]:
        out = []
        for cap, text in zip(self.base.caption(rows), rows.column("ocr_text").to_pylist()):
            words = " ".join(text.split())
            if cap is not None and words and words.lower() not in cap.lower():
                cap = f'{cap}, with the text "{words}" visible'
            out.append(cap)
        return out


def make_ocr_captioner(cfg: KilnConfig) -> Captioner:
    captioner = make_captioner(cfg.data.caption)
    return captioner if isinstance(captioner, VLMCaptioner) else OCRGroundedCaptioner(captioner, cfg.data.ocr.engine)


def caption_ocr_stage(table: pa.Table, cfg: KilnConfig) -> StageOutput:
    return caption_rows(table, make_ocr_captioner(cfg), stage="caption_ocr", record_decoding=True)


STAGE = Stage("caption_ocr", caption_ocr_stage, input_schema=OCRED, output_schema=OCR_CAPTIONED, scope="shard", setup=make_ocr_captioner)
