"""What every config group shares: the strict base model (unknown keys refused, frozen), the bounds that
make a typo fail at load with the key named, and the error for settings that contradict each other."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# Bounds shared by many settings: generous physical limits, so that a typo (a sign, a missing decimal point) fails
# at load with the key named rather than hours into a run. tests/test_config_bounds.py keeps every number bounded.
SEED_MAX = 2**31 - 1  # every consumer takes it: numpy and scikit-learn (< 2**32), FAISS (a C int), torch
MAX_SIDE = 65536  # px: an image side, a training resolution
MAX_STEPS = 10**9  # optimiser / sampler / k-means steps
MAX_ROWS = 10**12  # rows of a data set
MAX_BATCH = 2**20  # rows or images per batch
MAX_THREADS = 4096  # threads, processes, tasks, CPUs
MAX_TOKENS = 2**20  # tokens of a text
Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]


class PairError(ValueError):
    """Settings that contradict each other; `keys` (dotted, relative to the model that raised it) let
    validate() say which file or override each came from."""

    def __init__(self, message: str, *keys: str):
        super().__init__(message)
        self.keys = keys


def check_order(low_key: str, low: float, high_key: str, high: float, strict: bool = False) -> None:
    """A min / max pair in order, or a PairError naming both keys (`strict`: the two may not be equal)."""
    if low > high or (strict and low == high):
        raise PairError(
            f"{low_key} ({low}) must be {'below' if strict else 'at most'} {high_key} ({high})", low_key, high_key
        )
