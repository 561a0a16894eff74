"""The rule-based text tools the demo's stand-ins write with, honest about being rules: caption clauses and
tags, the rule rewriter's five forms, short prompts made by dropping details from a long caption, and the
rule user-prompt writer's styles (terse, conversational, instruction). The rewrite, prompt-pair and
user-prompt stages (assets/) and the expander's RL prompts (training.expander) share them."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

PREPOSITIONS = frozenset(["on", "at", "in", "with", "under", "over", "behind", "beside", "near"])


STOPWORDS = frozenset(
    [
        "a",
        "an",
        "the",
        "of",
        "on",
        "in",
        "at",
        "to",
        "with",
        "and",
        "or",
        "is",
        "are",
        "its",
        "it",
        "this",
        "that",
        "there",
        "which",
        "by",
        "for",
        "from",
        "as",
    ]
)


@dataclass(frozen=True)
class Forms:
    short: str
    medium: str
    long: str
    tags: str
    json: str
    json_origin: str = "composed"  # "generated" when the LLM's own JSON answer parsed


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
    obj = {
        "caption": long,
        "subject": cl[0] if cl else short,
        "details": cl[1:],
        "text": ocr_text.splitlines() or None,
        "tags": tags,
    }
    return json.dumps(obj, sort_keys=True, ensure_ascii=False)


def rule_forms(caption: str, ocr_text: str, short_words: int) -> Forms:
    cl = clauses(caption) or [caption]
    short = " ".join(split_tail(cl[0])[0].split()[:short_words])  # the subject, without where it is
    medium = ", ".join(cl[: max(1, len(cl) - 1)])  # everything but the last clause (usually the background)
    tags = tag_list(caption, ocr_text)
    return Forms(short, medium, caption.strip(), ", ".join(tags), compose_json(caption.strip(), short, tags, ocr_text))


SIZE_WORDS = frozenset(["small", "large", "big", "tiny", "huge", "little", "giant"])


def _draw(seed: int, row_id: str, k: int) -> float:
    return int.from_bytes(hashlib.sha1(f"{seed}:{row_id}:{k}".encode()).digest()[:8], "big") / 2**64


def make_prompt(caption: str, row_id: str, drop: float, seed: int = 0) -> tuple[str, list[str]]:
    """(prompt, dropped details) for one long caption."""
    cl = clauses(caption) or [caption]
    head, tail = split_tail(cl[0])
    words = head.split()
    candidates = (
        [("clause", c) for c in cl[1:]]
        + ([("tail", tail)] if tail else [])
        + [("size", w) for w in words if w.lower() in SIZE_WORDS]
    )
    dropped = [c for k, c in enumerate(candidates) if _draw(seed, row_id, k) < drop]
    if not dropped and candidates:  # a pair must leave something out; drop the last detail
        dropped = [candidates[-1]]
    gone = {(kind, text) for kind, text in dropped}
    kept_words = [w for w in words if ("size", w) not in gone]
    prompt = " ".join(kept_words) + ("" if ("tail", tail) in gone or not tail else f" {tail}")
    rest = [c for c in cl[1:] if ("clause", c) not in gone]
    prompt = ", ".join([prompt.strip(), *rest])
    return re.sub(r"\s+", " ", prompt).strip(), [text for _, text in dropped]


STYLES = ("terse", "conversational", "instruction")


TERSE_DROP = frozenset(["a", "an", "the", "on", "at", "in", "of", "with"])


TEMPLATES = {
    "conversational": (
        "can you make me {p}?",
        "i'd like a picture of {p}, please",
        "hey, show me {p}",
    ),
    "instruction": (
        "Generate an image of {p}.",
        "Draw {p}.",
        "Create a picture showing {p}.",
    ),
}


def draw(seed: int, row_id: str, what: str) -> float:
    """A uniform draw in [0, 1) that is a pure function of (seed, row, what): the stage reproduces."""
    return int.from_bytes(hashlib.sha1(f"{seed}:{row_id}:{what}".encode()).digest()[:8], "big") / 2**64


def pick_style(styles: dict[str, float], seed: int, row_id: str) -> str:
    names = [s for s in STYLES if styles.get(s, 0) > 0]
    total, u, acc = sum(styles[s] for s in names), draw(seed, row_id, "style"), 0.0
    for s in names:
        acc += styles[s] / total
        if u < acc:
            return s
    return names[-1]


# ---------------------------------------------------------------------------------------------- rules
def terse(prompt: str) -> str:
    """'a large red circle on the left, on a blue background' -> 'large red circle left, blue background'."""
    words = [w for w in prompt.replace(",", " , ").split() if w.lower() not in TERSE_DROP]
    return re.sub(r"\s+,", ",", " ".join(words)).strip(" ,")


def rule_prompt(prompt: str, style: str, seed: int) -> str:
    if style == "terse":
        return terse(prompt)
    options = TEMPLATES[style]
    return options[seed % len(options)].format(p=prompt)
