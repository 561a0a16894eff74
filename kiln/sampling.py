"""Deterministic per-row draws shared by curation and training: which caption form a sample trains on,
and how many times a weighted row appears in an epoch.

Each draw is a hash of (seed, epoch, row id), not a stateful RNG, so it depends on nothing else: not on
the order rows are read in, the number of ranks, or where a resumed run starts.
"""

from __future__ import annotations

import hashlib
import json
import math

FORMS = ("short", "medium", "long", "tags", "json")


def hash_uniform(key: str) -> float:
    """A uniform number in [0, 1) that is a pure function of `key`."""
    return int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "big") / 2**64


def check_form_probs(probs: dict[str, float]) -> None:
    """Refuse probabilities that name an unknown form, are negative, or sum to nothing."""
    unknown = sorted(set(probs) - set(FORMS))
    if unknown or any(not (p >= 0 and math.isfinite(p)) for p in probs.values()) or sum(probs.values()) <= 0:
        raise ValueError(f"form probabilities {probs} must be non-negative over forms {FORMS} with a positive sum")


def pick_form(row_id: str, probs: dict[str, float], seed: int = 0, epoch: int = 0) -> str:
    """The caption form one sample trains on: a deterministic draw from `probs` keyed by (seed, epoch, id)."""
    check_form_probs(probs)
    total = sum(probs.values())
    u = hash_uniform(f"{seed}:{epoch}:{row_id}")
    acc = 0.0
    drawable = [f for f in sorted(probs) if probs[f] > 0]
    for form in drawable:
        acc += probs[form] / total
        if u < acc:
            return form
    return drawable[-1]  # u above a sum that rounded below 1


def copies_in_epoch(weight: float, row_id: str, seed: int = 0, epoch: int = 0) -> int:
    """How often a row appears in one epoch: floor(w), plus one with probability frac(w), so the
    expectation is exactly `weight`; weight 0 never appears, weight 1 exactly once."""
    whole = math.floor(weight)
    return whole + int(hash_uniform(f"copies:{seed}:{epoch}:{row_id}") < weight - whole)


def dump_forms(forms: dict[str, str]) -> str:
    """The caption forms of one row as deterministic JSON bytes (sorted keys)."""
    unknown = sorted(set(forms) - set(FORMS))
    if unknown:
        raise ValueError(f"caption forms {unknown} are not among {FORMS}")
    return json.dumps(forms, sort_keys=True, ensure_ascii=False)
