"""The expander's RL rewards and GDPO's advantages.

Per short prompt, the policy writes G expansions; each gets:
- faithfulness: the share of the short prompt's attributes that survive into the expansion (the expander must
  add detail, never override intent). Attributes come from an extractor: the demo grammar's reader
  (`demo_attributes`, exact on demo prompts; a stand-in) or any causal LM by path (`LLMAttributeExtractor`,
  one attribute phrase per line, greedy); an LLM-listed phrase survives when all its content words appear
  in the expansion.
- image: the DiT draws the expansion and the rubric judge (training/evaluation/rewards.py, the post-training reward
  interface) scores the requirements the short prompt states (`IntentRubricReward`);
- diversity: each image's mean cosine distance (image embeddings) to the rest of its group, against collapse;
  in RL it counts only for expansions that keep every attribute (`diversity_of_faithful`): images spread
  most when expansions override the prompt (another background, another shape), so an unconditioned
  diversity reward pays for exactly what faithfulness forbids (GDPO's conditioned rewards);
- safety gate: an expansion with a blocklisted word gets 0 for every reward.

GDPO (`gdpo_advantages`): each reward is standardised within its group separately, the standardised rewards
are summed with their weights, and the sum is standardised over the batch. Standardising the sum of raw
rewards (GRPO) lets the reward with the largest spread decide the ranking; per-reward normalisation keeps
each one's ordering in the signal. A reward that is NaN for a sample (it could not score it) adds 0 there.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from training.evaluation.rubric import Judge, RubricPrompt

STOP = frozenset(
    [
        "a",
        "an",
        "the",
        "of",
        "on",
        "in",
        "at",
        "with",
        "and",
        "to",
        "is",
        "are",
        "it",
        "its",
        "this",
        "that",
    ]
)


# ------------------------------------------------------------------------------------------ GDPO
def group_normalise(r: Tensor, eps: float = 1e-4) -> Tensor:
    """[P, G] rewards standardised within each row (group); NaN entries give 0 and do not count."""
    ok = ~torch.isnan(r)
    n = ok.sum(1, keepdim=True).clamp(min=1)
    x = torch.where(ok, r, torch.zeros_like(r))
    mean = x.sum(1, keepdim=True) / n
    std = (torch.where(ok, (x - mean) ** 2, torch.zeros_like(r)).sum(1, keepdim=True) / n).sqrt()
    z = (x - mean) / torch.where(std > 0, std + eps, torch.ones_like(std))  # a constant group carries no signal: 0
    return torch.where(ok, z, torch.zeros_like(r))


def gdpo_advantages(rewards: dict[str, Tensor], weights: dict[str, float], eps: float = 1e-4) -> Tensor:
    """GDPO: sum_k w_k * group_normalise(r_k), then standardised over the whole batch. [P, G] each."""
    total = sum(weights.get(k, 0.0) * group_normalise(r, eps) for k, r in rewards.items())
    return (total - total.mean()) / (total.std(unbiased=False) + eps)


# --------------------------------------------------------------------------------------- safety gate
def blocked(text: str, blocklist: Iterable[str]) -> bool:
    """Whether `text` contains a blocklisted word or phrase (case-insensitive, whole words)."""
    return any(re.search(rf"\b{re.escape(w.lower())}\b", text.lower()) for w in blocklist if w.strip())


def gate(
    rewards: dict[str, np.ndarray], texts: list[str], blocklist: Iterable[str]
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Every reward set to 0 for the blocked expansions; returns the rewards and the blocked mask."""
    mask = np.array([blocked(t, blocklist) for t in texts], bool)
    return {k: np.where(mask, 0.0, v) for k, v in rewards.items()}, mask


# -------------------------------------------------------------------------------------- faithfulness
class AttributeExtractor(Protocol):
    name: str

    def attributes(self, prompt: str) -> list[str]: ...

    def survives(self, attribute: str, expansion: str) -> bool: ...


def demo_attributes(text: str) -> set[tuple[str, str]]:
    """(kind, value) of each attribute a demo-grammar text states: shape colours, background colours, shapes,
    sizes, positions, counts, patterns, sign colour and sign word. A colour is the background's when
    'background' follows it before any shape; a sign's when 'sign' does."""
    from components.demo_scenes import COLORS, COUNT_WORDS, POSITIONS, SHAPES, SIZES, WORDS

    words = re.findall(r"[A-Za-z]+", text)
    low = [w.lower() for w in words]
    counts = {v: str(k) for k, v in COUNT_WORDS.items() if k > 1}
    shape_of = {s: s for s in SHAPES} | {s + "s": s for s in SHAPES}
    out: set[tuple[str, str]] = set()
    for i, (w, lw) in enumerate(zip(words, low)):
        if lw in COLORS:
            ahead = low[i + 1 : i + 6]
            role = "color"
            for a in ahead:
                if a in shape_of:
                    break
                if a == "background":
                    role = "background"
                    break
                if a == "sign":
                    role = "sign"
                    break
            out.add((role, lw))
        elif lw in shape_of:
            out.add(("shape", shape_of[lw]))
        elif lw in SIZES or lw in POSITIONS:
            out.add(("size" if lw in SIZES else "position", lw))
        elif lw in counts:
            out.add(("count", counts[lw]))
        elif lw in ("striped", "gradient"):
            out.add(("pattern", lw))
        elif w in WORDS:
            out.add(("text", w))
    return out


class DemoGrammarExtractor:
    """The demo stand-in: attributes read by the demo grammar (exact on demo prompts, blind to anything else)."""

    name = "demo_grammar"

    def attributes(self, prompt: str) -> list[str]:
        return sorted(f"{k}={v}" for k, v in demo_attributes(prompt))

    def survives(self, attribute: str, expansion: str) -> bool:
        kind, value = attribute.split("=", 1)
        return (kind, value) in demo_attributes(expansion)


def content_words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9]+", text.lower()) if w not in STOP}


EXTRACT = "List every visual attribute that this image request states, one short phrase per line.\nRequest: {prompt}\nAttributes:\n"


class LLMAttributeExtractor:
    """Any causal LM by local path lists a prompt's attributes (greedy); a phrase survives an expansion
    when every content word of it appears there."""

    def __init__(self, path: str, max_new_tokens: int = 64):
        from training.expander.model import load_lm

        self.model, self.tok = load_lm(path)
        self.model.eval()
        self.name, self.max_new_tokens = f"llm:{path}", max_new_tokens

    @torch.no_grad()
    def attributes(self, prompt: str) -> list[str]:
        enc = self.tok([EXTRACT.format(prompt=prompt)], return_tensors="pt")
        ids = self.model.generate(
            **enc,
            max_new_tokens=self.max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=self.tok.pad_token_id,
        )
        text = self.tok.decode(ids[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        lines = [line.strip(" -*\t") for line in text.splitlines()]
        return [line for line in dict.fromkeys(lines) if content_words(line)]

    def survives(self, attribute: str, expansion: str) -> bool:
        return content_words(attribute) <= content_words(expansion)


def faithfulness(extractor: AttributeExtractor, short: str, expansions: list[str]) -> np.ndarray:
    """[G] share of the short prompt's attributes each expansion keeps (1 when it states none)."""
    attrs = extractor.attributes(short)
    if not attrs:
        return np.ones(len(expansions))
    return np.array([sum(extractor.survives(a, e) for a in attrs) / len(attrs) for e in expansions])


def make_extractor(cfg) -> AttributeExtractor:
    if cfg.extractor == "demo_grammar":
        return DemoGrammarExtractor()
    if not cfg.extractor_path:
        raise ValueError("expander.extractor=llm needs expander.extractor_path (a causal LM folder)")
    return LLMAttributeExtractor(cfg.extractor_path)


# ---------------------------------------------------------------------------------- image, diversity
def diversity_of_faithful(rewards: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The diversity reward conditioned on faithfulness: 0 for an expansion that lost any attribute of the
    short prompt, so the group's spread is rewarded only among expansions that keep the user's intent."""
    if "diversity" not in rewards:
        return rewards
    return rewards | {"diversity": np.where(rewards["faithfulness"] >= 1.0, rewards["diversity"], 0.0)}


@dataclass
class IntentRubricReward:
    """The rubric reward (training/evaluation/rewards.py's interface) on the requirements the *short* prompt states:
    the expansion is judged on what the user asked for; NaN when the short prompt states none of them."""

    judge: Judge
    name: str = "image"

    def score(self, prompt: RubricPrompt, images: np.ndarray, short: str = "") -> np.ndarray:
        answers = self.judge.answer(prompt, images)
        cols = [j for j, r in enumerate(prompt.requirements) if stated(r.attribute, str(r.value), short)]
        return answers[:, cols].mean(1) if cols else np.full(len(images), np.nan)


DEMO_KINDS = frozenset(["color", "position", "background", "shape", "count"])


def stated(attribute: str, value: str, short: str) -> bool:
    """Whether the short prompt asks for this requirement: by the demo grammar for its attributes, else by
    the value's words all appearing in it."""
    if attribute in DEMO_KINDS:
        return (attribute, value.lower()) in demo_attributes(short)
    return content_words(value) <= content_words(short)


def diversity(embeddings: np.ndarray) -> np.ndarray:
    """[G] each member's mean cosine distance to the others of its group ([G, D] embeddings)."""
    e = embeddings / np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)
    sim = e @ e.T
    g = len(e)
    if g < 2:
        return np.zeros(g)
    return np.clip(1.0 - (sim.sum(1) - np.diag(sim)) / (g - 1), 0.0, 2.0)  # clip: float rounding on identical images
