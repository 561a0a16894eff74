"""Reading the pack stage's output as training batches.

The pack stage already shuffled rows and grouped them into batches that share one aspect bucket;
the loader keeps those batches intact (splitting one only when it is larger than the step's batch
size) and only reshuffles the *order of batches* per epoch, seeded, so a position
(epoch, batch index) names exactly which rows come next: that is what makes a resume exact.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kiln.schemas import TRAIN, check_schema
from kiln.stage import read_dataset


@dataclass(frozen=True)
class DataPosition:
    """Where the stream stands: `batch` batches of epoch `epoch` have been consumed."""

    epoch: int = 0
    batch: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> "DataPosition":
        return cls(epoch=int(d["epoch"]), batch=int(d["batch"]))


@dataclass(frozen=True)
class Batch:
    """One training step's rows: all of one bucket, pixels as uint8 NHWC."""

    ids: tuple[str, ...]
    captions: tuple[str, ...]
    bucket: str
    pixels: np.ndarray  # uint8 [B, H, W, 3]
    position: DataPosition  # the position *before* this batch; resuming from it yields this batch again

    @property
    def size(self) -> int:
        return len(self.ids)


def holdout_ids(ids: Iterable[str], n: int) -> set[str]:
    """The `n` rows held out of training for evaluation: the smallest sha1(id), so the choice depends
    only on which rows exist, not on their order or on the pack seed."""
    ranked = sorted(set(ids), key=lambda i: hashlib.sha1(i.encode()).hexdigest())
    return set(ranked[:n])


def read_train_table(data_dir: Path) -> pa.Table:
    """The pack stage's kept rows (`DIR/kept/part-*.parquet`, or DIR itself), schema-checked, in stream order."""
    src = data_dir / "kept" if (data_dir / "kept").is_dir() else data_dir
    table = check_schema(read_dataset(src), TRAIN, f"training data {src}")
    return table.sort_by([("batch", "ascending"), ("order", "ascending")])


def decode_pixels(table: pa.Table) -> np.ndarray:
    """uint8 [N, H, W, 3] from the `pixels` column of rows that share one bucket."""
    h, w = table.column("height").to_pylist(), table.column("width").to_pylist()
    if len(set(h)) != 1 or len(set(w)) != 1:
        raise ValueError(f"rows of one batch have several sizes: {sorted(set(zip(h, w)))}")
    raw = bytearray(b"".join(table.column("pixels").to_pylist()))  # writable: torch refuses read-only buffers
    return np.frombuffer(raw, dtype=np.uint8).reshape(table.num_rows, h[0], w[0], 3)


def _check_one_bucket(table: pa.Table, batch_no: int) -> str:
    buckets = set(table.column("bucket").to_pylist())
    if len(buckets) != 1:
        raise ValueError(f"packed batch {batch_no} mixes buckets {sorted(buckets)}")
    return buckets.pop()


class TrainSet:
    """The packed batches of one training set, in memory (the demo and per-stage sets fit; a streaming
    reader over shards would keep this interface)."""

    def __init__(self, batches: list[Batch]):
        if not batches:
            raise ValueError("training set has no rows")
        self.batches = batches

    @classmethod
    def from_table(cls, table: pa.Table, max_batch_size: int, exclude_ids: set[str] | None = None) -> "TrainSet":
        if exclude_ids:
            table = table.filter(pc.invert(pc.is_in(table.column("id"), pa.array(sorted(exclude_ids)))))
        batches: list[Batch] = []
        batch_col = table.column("batch").to_numpy()
        starts = np.flatnonzero(np.r_[True, batch_col[1:] != batch_col[:-1]]) if len(batch_col) else []
        ends = list(starts[1:]) + [len(batch_col)]
        for s, e in zip(starts, ends):
            packed = table.slice(int(s), int(e - s))
            bucket = _check_one_bucket(packed, int(batch_col[s]))
            for off in range(0, packed.num_rows, max_batch_size):
                part = packed.slice(off, max_batch_size)
                batches.append(
                    Batch(
                        ids=tuple(part.column("id").to_pylist()),
                        captions=tuple(part.column("caption").to_pylist()),
                        bucket=bucket,
                        pixels=decode_pixels(part),
                        position=DataPosition(),
                    )
                )
        return cls(batches)

    @classmethod
    def from_dir(cls, data_dir: Path, max_batch_size: int, holdout: int = 0) -> "TrainSet":
        table = read_train_table(data_dir)
        return cls.from_table(table, max_batch_size, holdout_ids(table.column("id").to_pylist(), holdout))

    def __len__(self) -> int:
        return len(self.batches)

    @property
    def num_rows(self) -> int:
        return sum(b.size for b in self.batches)

    def captions(self) -> list[str]:
        """Unique captions, sorted: the text-embedding cache is built over these once."""
        return sorted({c for b in self.batches for c in b.captions})

    def main_bucket(self) -> str:
        """The bucket most rows are in (ties broken by name): the resolution samples are drawn at."""
        counts: dict[str, int] = {}
        for b in self.batches:
            counts[b.bucket] = counts.get(b.bucket, 0) + b.size
        return min(counts, key=lambda k: (-counts[k], k))

    def epoch_order(self, epoch: int, seed: int) -> list[int]:
        """Batch order of one epoch: epoch 0 keeps the pack stage's pre-shuffled order, later epochs
        are a permutation seeded by (seed, epoch)."""
        if epoch == 0:
            return list(range(len(self.batches)))
        rng = np.random.default_rng([seed, epoch])
        return rng.permutation(len(self.batches)).tolist()

    def stream(self, seed: int, start: DataPosition = DataPosition()) -> Iterator[Batch]:
        """Endless batches from `start`; each carries the position it was read at."""
        epoch, index = start.epoch, start.batch
        while True:
            order = self.epoch_order(epoch, seed)
            for i in range(index, len(order)):
                b = self.batches[order[i]]
                yield Batch(b.ids, b.captions, b.bucket, b.pixels, DataPosition(epoch, i))
            epoch, index = epoch + 1, 0


def next_position(pos: DataPosition, n_batches: int) -> DataPosition:
    """The position after consuming the batch read at `pos`."""
    return DataPosition(pos.epoch + 1, 0) if pos.batch + 1 >= n_batches else DataPosition(pos.epoch, pos.batch + 1)


def bucket_size(bucket: str) -> tuple[int, int]:
    """(height, width) from a bucket name "HxW"."""
    h, w = bucket.lower().split("x")
    return int(h), int(w)
