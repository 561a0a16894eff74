"""The rewrite stage: each long caption into short, medium, tag-list and JSON forms, all stored on every row.

Training then draws one form per sample per epoch with configured probabilities (kiln.sampling.pick_form, in
the loader, training/data.py), so that the model learns both from dense descriptions and from the terse
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
import re
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Protocol

import pyarrow as pa

from assets.vlm import GenerationSettings, seed_everything
from kiln.config import KilnConfig, RewriteConfig
from kiln.reasons import Reason
from kiln.sampling import FORMS  # shared with training, which draws the forms
from kiln.schemas import OCR_CAPTIONED, REWRITTEN
from kiln.stage import Rejects, Stage, StageOutput

PREPOSITIONS = frozenset(["on", "at", "in", "with", "under", "over", "behind", "beside", "near"])
STOPWORDS = frozenset(["a", "an", "the", "of", "on", "in", "at", "to", "with", "and", "or", "is", "are", "its", "it", "this", "that", "there", "which", "by", "for", "from", "as"])


@dataclass(frozen=True)
class Forms:
    short: str
    medium: str
    long: str
    tags: str
    json: str
    json_origin: str = "composed"  # "generated" when the LLM's own JSON answer parsed


class Rewriter(Protocol):
    name: str
    decoding: dict

    def rewrite(self, captions: list[str], ocr_texts: list[str]) -> list[Forms]: ...


# ---------------------------------------------------------------------------------------------- rules
def clauses(caption: str) -> list[str]:
    """Top-level comma clauses; commas inside quotes (OCR'd text) do not split."""
    parts = re.split(r',\s*(?=(?:[^"]*"[^"]*")*[^"]*$)', caption.strip())
    return [p.strip() for p in parts if p.strip()]


def split_tail(clause: str) -> tuple[str, str]:
    """'a large red circle on the left' -> ('a large red circle', 'on the left'); quoted text never splits."""
    words = clause.split()
    for i, w in enumerate(words[1:], start=1):
        if w.lower() in PREPOSITIONS and '"' not in " ".join(words[i:]):
            return " ".join(words[:i]), " ".join(words[i:])
    return clause, ""


def tag_list(caption: str, ocr_text: str = "") -> list[str]:
    """Quoted text first (as written), then content words in order of appearance, each once."""
    quoted = re.findall(r'"([^"]+)"', caption)
    words = re.findall(r"[a-z0-9]+", re.sub(r'"[^"]*"', " ", caption.lower()))
    tags = quoted + [w for w in words if w not in STOPWORDS and not w.isdigit()]
    tags += [line for line in ocr_text.splitlines() if line.strip()]
    seen: dict[str, None] = {}
    for t in tags:
        seen.setdefault(t.strip(), None)
    return [t for t in seen if t]


def compose_json(long: str, short: str, tags: list[str], ocr_text: str) -> str:
    cl = clauses(long)
    obj = {"caption": long, "subject": cl[0] if cl else short, "details": cl[1:], "text": ocr_text.splitlines() or None, "tags": tags}
    return json.dumps(obj, sort_keys=True, ensure_ascii=False)


def rule_forms(caption: str, ocr_text: str, short_words: int) -> Forms:
    cl = clauses(caption) or [caption]
    short = " ".join(split_tail(cl[0])[0].split()[:short_words])  # the subject, without where it is
    medium = ", ".join(cl[: max(1, len(cl) - 1)])  # everything but the last clause (usually the background)
    tags = tag_list(caption, ocr_text)
    return Forms(short, medium, caption.strip(), ", ".join(tags), compose_json(caption.strip(), short, tags, ocr_text))


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


@lru_cache(maxsize=2)
def load_llm(path: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), tok


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
            out += [t.strip() for t in self.tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)]
        return out

    def rewrite(self, captions: list[str], ocr_texts: list[str]) -> list[Forms]:
        answers = {form: self.generate([t.format(caption=c) for c in captions]) for form, t in INSTRUCTIONS.items()}
        forms = []
        for i, (c, o) in enumerate(zip(captions, ocr_texts)):
            short, medium, tags = answers["short"][i], answers["medium"][i], answers["tags"][i]
            js, origin = parse_json_object(answers["json"][i]), "generated"
            if js is None:  # recorded per row in rewrite_decoding
                js, origin = compose_json(c.strip(), short, [t.strip() for t in tags.split(",") if t.strip()], o), "composed"
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
    for i, (id_, uri, forms) in enumerate(zip(table.column("id").to_pylist(), table.column("uri").to_pylist(), all_forms)):
        bad = length_problem(forms, cfg.lengths)
        if bad:
            form, n, (lo, hi) = bad
            rejects.add(id_, uri, Reason.CAPTION_LENGTH, float(n), f"{form} form has {n} characters, allowed {lo}..{hi}")
        else:
            keep.append(i)
    kept = table.take(pa.array(keep, pa.int64()))
    for form in FORMS:
        kept = kept.append_column(pa.field(f"caption_{form}", pa.string(), nullable=False), pa.array([getattr(all_forms[i], form) for i in keep], pa.string()))
    kept = kept.append_column(pa.field("rewrite_source", pa.string(), nullable=False), pa.array([rewriter.name] * len(keep), pa.string()))
    decoding = [json.dumps(rewriter.decoding | {"json": all_forms[i].json_origin}, sort_keys=True) for i in keep]
    kept = kept.append_column(pa.field("rewrite_decoding", pa.string(), nullable=False), pa.array(decoding, pa.string()))
    return StageOutput(kept, rejects.table())


def rewrite_stage(table: pa.Table, cfg: KilnConfig) -> StageOutput:
    return rewrite_rows(table, make_rewriter(cfg.data.rewrite), cfg.data.rewrite)


# ------------------------------------------------------------------------------------------- training
STAGE = Stage("rewrite", rewrite_stage, input_schema=OCR_CAPTIONED, output_schema=REWRITTEN, scope="shard")
