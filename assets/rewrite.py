"""The rewrite stage: each long caption into short, medium, tag-list and JSON forms, all stored on every row.

Training then draws one form per sample per epoch with configured probabilities (kiln.sampling.pick_form, in
the loader, training/core/data.py), so that the model learns both from dense descriptions and from the terse
prompts people type.

Two rewriters behind one interface (`Rewriter.rewrite(captions, ocr_texts) -> list[Forms]`):
- `LLMRewriter`: a transformers causal LM loaded by local path, one instruction per form, batched and
  greedy; its settings go to `rewrite_decoding`. A JSON answer that does not parse as an object is
  replaced by one composed from the other forms, and the decoding record says so.
- `RuleRewriter`: clause and word rules, honest about being rules; the offline demo uses it.
A row whose forms fall outside the configured lengths is rejected (`caption_length`), never truncated
silently.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Protocol

import pyarrow as pa

from components.llm import load_llm
from components.rule_text import Forms, compose_json, rule_forms
from components.vlm import GenerationSettings, seed_everything
from kiln.config import KilnConfig, RewriteConfig
from kiln.reasons import Reason
from kiln.sampling import FORMS  # shared with training, which draws the forms
from kiln.schemas import OCR_CAPTIONED, REWRITTEN
from kiln.stage import Rejects, Stage, StageOutput


class Rewriter(Protocol):
    name: str
    decoding: dict

    def rewrite(self, captions: list[str], ocr_texts: list[str]) -> list[Forms]: ...


class RuleRewriter:
    name = "rules:clauses"

    def __init__(self, short_words: int = 12):
        self.short_words = short_words
        self.decoding = {"method": "rules", "short_words": short_words}

    def rewrite(self, captions: list[str], ocr_texts: list[str]) -> list[Forms]:
        return [rule_forms(c, o, self.short_words) for c, o in zip(captions, ocr_texts)]


# ------------------------------------------------------------------------------------------------ llm
INSTRUCTIONS = {
    "short": "Rewrite the image caption in a few words.\nCaption: {caption}\nShort:",
    "medium": "Rewrite the image caption in one sentence.\nCaption: {caption}\nSentence:",
    "tags": "List the things in the image caption as comma-separated tags.\nCaption: {caption}\nTags:",
    "json": 'Describe the image caption as a JSON object with keys "subject", "details", "text".\nCaption: {caption}\nJSON:',
}


def parse_json_object(text: str) -> str | None:
    """The first {...} in an answer, re-serialised canonically; None when there is no valid object."""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end <= start:
        return None
    try:
        obj = json.loads(text[start : end + 1])
    except json.JSONDecodeError:
        return None
    return json.dumps(obj, sort_keys=True, ensure_ascii=False) if isinstance(obj, dict) else None


class LLMRewriter:
    def __init__(self, path: str, batch_size: int = 8, settings: GenerationSettings | None = None):
        self.path, self.batch_size, self.settings = path, batch_size, settings or GenerationSettings()
        self.model, self.tokenizer = load_llm(path)
        self.name = f"llm:{self.model.config.model_type}"
        self.decoding = {"model": path, "instructions": INSTRUCTIONS, "batch_size": batch_size, **asdict(self.settings)}

    def generate(self, prompts: list[str]) -> list[str]:
        import torch

        out = []
        for start in range(0, len(prompts), self.batch_size):
            enc = self.tokenizer(prompts[start : start + self.batch_size], return_tensors="pt", padding=True)
            seed_everything(self.settings.seed + start)
            with torch.no_grad():
                ids = self.model.generate(**enc, **self.settings.kwargs(), pad_token_id=self.tokenizer.pad_token_id)
            out += [
                t.strip()
                for t in self.tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            ]
        return out

    def rewrite(self, captions: list[str], ocr_texts: list[str]) -> list[Forms]:
        answers = {form: self.generate([t.format(caption=c) for c in captions]) for form, t in INSTRUCTIONS.items()}
        forms = []
        for i, (c, o) in enumerate(zip(captions, ocr_texts)):
            short, medium, tags = answers["short"][i], answers["medium"][i], answers["tags"][i]
            js, origin = parse_json_object(answers["json"][i]), "generated"
            if js is None:  # recorded per row in rewrite_decoding
                js, origin = (
                    compose_json(c.strip(), short, [t.strip() for t in tags.split(",") if t.strip()], o),
                    "composed",
                )
            forms.append(Forms(short, medium, c.strip(), tags, js, origin))
        return forms


def make_rewriter(cfg: RewriteConfig) -> Rewriter:
    if cfg.rewriter == "llm":
        if not cfg.llm_path:
            raise ValueError("rewriter=llm needs data.rewrite.llm_path (a local causal LM + tokenizer folder)")
        s = GenerationSettings(cfg.max_new_tokens, cfg.min_new_tokens, 1, False, cfg.seed)
        return LLMRewriter(cfg.llm_path, cfg.batch_size, s)
    return RuleRewriter(cfg.short_words)


# ---------------------------------------------------------------------------------------------- stage
def length_problem(forms: Forms, lengths: dict[str, tuple[int, int]]) -> tuple[str, int, tuple[int, int]] | None:
    for form in FORMS:
        n, (lo, hi) = len(getattr(forms, form)), lengths[form]
        if not lo <= n <= hi:
            return form, n, (lo, hi)
    return None


def rewrite_rows(table: pa.Table, rewriter: Rewriter, cfg: RewriteConfig, stage: str = "rewrite") -> StageOutput:
    """Pure core: add every caption form; rows with a form outside its length range are rejected."""
    captions, ocr = table.column("caption").to_pylist(), table.column("ocr_text").to_pylist()
    all_forms = rewriter.rewrite(captions, ocr)
    rejects, keep = Rejects(stage), []
    for i, (id_, uri, forms) in enumerate(
        zip(table.column("id").to_pylist(), table.column("uri").to_pylist(), all_forms)
    ):
        bad = length_problem(forms, cfg.lengths)
        if bad:
            form, n, (lo, hi) = bad
            rejects.add(
                id_, uri, Reason.CAPTION_LENGTH, float(n), f"{form} form has {n} characters, allowed {lo}..{hi}"
            )
        else:
            keep.append(i)
    kept = table.take(pa.array(keep, pa.int64()))
    for form in FORMS:
        kept = kept.append_column(
            pa.field(f"caption_{form}", pa.string(), nullable=False),
            pa.array([getattr(all_forms[i], form) for i in keep], pa.string()),
        )
    kept = kept.append_column(
        pa.field("rewrite_source", pa.string(), nullable=False), pa.array([rewriter.name] * len(keep), pa.string())
    )
    decoding = [json.dumps(rewriter.decoding | {"json": all_forms[i].json_origin}, sort_keys=True) for i in keep]
    kept = kept.append_column(
        pa.field("rewrite_decoding", pa.string(), nullable=False), pa.array(decoding, pa.string())
    )
    return StageOutput(kept, rejects.table())


def rewrite_stage(table: pa.Table, cfg: KilnConfig) -> StageOutput:
    return rewrite_rows(table, make_rewriter(cfg.data.rewrite), cfg.data.rewrite)


# ------------------------------------------------------------------------------------------- training
STAGE = Stage("rewrite", rewrite_stage, input_schema=OCR_CAPTIONED, output_schema=REWRITTEN, scope="shard")
