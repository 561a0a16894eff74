"""The input side of a training step: the next batches read, decoded and encoded while the current step runs.

`Prefetcher` takes the stream's work items (which rows of which shard, training.core.data.Work) and runs what
each needs in `workers` threads, a few batches ahead: the ranged reads, the image decode, and the autoencoder
(a VAE forward for latent models, a cast for pixel space) or a read from the latent cache. It hands batches
back in stream order, so a resumed run still sees exactly the batches of the uninterrupted one. On CUDA the
inputs land in pinned memory, so the copy to the device does not block the step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from training.core.data import Batch


@dataclass(frozen=True)
class StepInput:
    batch: Batch
    x0: Tensor  # the model's input space: latents (or [-1, 1] pixels), [b, C, H, W]


def latent_encoder(gen, cache_dir: str | None, pin: bool = False) -> Callable[[Batch], StepInput]:
    """Batch -> StepInput: a latent train set's stored latents as they are, else the pixels through the
    Generator's autoencoder (via the on-disk latent cache when configured); `pin`: into page-locked memory,
    for a non-blocking copy to the GPU."""
    encode = gen.autoencoder.encode
    if cache_dir:
        from model.autoencoder import LatentCache

        encode = LatentCache(cache_dir, gen.autoencoder).encode

    def prepare(batch: Batch) -> StepInput:
        x0 = torch.from_numpy(batch.latents) if batch.latents is not None else encode(batch.pixels)
        return StepInput(batch, x0.pin_memory() if pin else x0)

    return prepare


def loader_workers(configured: int | None, device_type: str) -> int:
    """`train.loader_workers`, or the measured default: none on CPU, where a loader thread's torch ops start
    their own OpenMP team that takes cores from the step (0.64x against 0.88x of a minimal loop on 2 cores,
    benchmarks/bench_trainer_overhead.py), and one on CUDA, where the step leaves the host's cores free."""
    if configured is not None:
        return configured
    return 1 if device_type == "cuda" else 0


class Prefetcher:
    """Ordered, bounded read-ahead over an endless stream of work; `workers=0` prepares in the caller."""

    def __init__(
        self, stream: Iterator, prepare: Callable[[object], StepInput], workers: int = 1, depth: int | None = None
    ):
        self.stream, self.prepare = stream, prepare
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="kiln-loader") if workers > 0 else None
        self.depth = depth if depth is not None else workers + 1
        self.pending: deque = deque()

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self) -> StepInput:
        if self.pool is None:
            return self.prepare(next(self.stream))
        while len(self.pending) < max(self.depth, 1):
            self.pending.append(self.pool.submit(self.prepare, next(self.stream)))
        return self.pending.popleft().result()

    def close(self) -> None:
        if self.pool is not None:
            for f in self.pending:
                f.cancel()
            self.pool.shutdown(wait=True)
            self.pending.clear()

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
