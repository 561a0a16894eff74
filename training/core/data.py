"""Reading the pack stage's output as training batches.

The pack stage already shuffled rows and grouped them into batches that share one aspect bucket.
Without sampling weights (every weight 1) the loader keeps those batches intact (splitting one only when
it is larger than the step's batch size) and only reshuffles the *order of batches* per epoch; with
weights, each epoch draws every row about `sampling_weight` times and re-batches them per bucket. Both
are pure functions of (seed, epoch), so a position (epoch, batch index) names exactly which rows come
next: that is what makes a resume exact. Each sample's caption is one of the row's caption forms,
drawn per epoch with `data.rewrite.form_probs` (kiln.sampling.pick_form).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kiln.config import ConfigError
from kiln.sampling import check_form_probs, copies_in_epoch, pick_form
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

    ids: tuple[str, ...]  # a weighted epoch may repeat a row
    captions: tuple[str, ...]  # each row's caption form drawn for this epoch
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


HELDOUT_FILE = "heldout.json"  # in a checkpoint folder: the ids its run held out, inherited by runs started from it


def read_heldout(checkpoint: Path | str | None) -> set[str] | None:
    """The ids a checkpoint's run held out, or None (no checkpoint, or one written before kiln kept the record)."""
    path = Path(checkpoint) / HELDOUT_FILE if checkpoint else None
    return set(json.loads(path.read_text())["ids"]) if path and path.exists() else None


def write_heldout(out_dir: Path, ids: set[str]) -> None:
    (Path(out_dir) / HELDOUT_FILE).write_text(json.dumps({"ids": sorted(ids)}, indent=0) + "\n")


def choose_heldout(ids: Iterable[str], n: int, init_from: Path | str | None) -> set[str]:
    """The rows a run holds out: those its starting checkpoint's run held out (so no rung of a ladder ever
    trains on the first rung's held-out rows, which evaluation reads), else the `n` smallest sha1(id)."""
    inherited = read_heldout(init_from)
    return inherited if inherited is not None else holdout_ids(ids, n)


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
    reader over shards would keep this interface), with each row's caption forms and sampling weight.

    `batches` are the pack's batches (split to `batch_size`), captioned with the long caption; what a
    step trains on comes from `stream`, where each sample's caption is the form drawn for its epoch
    (`form_probs`; None = the long caption) and, when any weight differs from 1, the rows of an epoch
    are drawn by weight (`epoch_batches`)."""

    def __init__(
        self,
        batches: list[Batch],
        batch_size: int | None = None,
        forms: dict[str, dict[str, str]] | None = None,
        weights: dict[str, float] | None = None,
        form_probs: dict[str, float] | None = None,
    ):
        if not batches:
            raise ValueError("training set has no rows")
        self.batches = batches
        self.batch_size = batch_size or max(b.size for b in batches)
        self.form_probs = dict(form_probs) if form_probs is not None else None
        self.held_out: set[str] = set()  # ids kept out of training (from_dir)
        self.forms = forms or {}
        self._packed = {b.ids: b for b in batches}  # an epoch batch that is a packed batch reuses its pixels
        self._where = {i: (k, j) for k, b in enumerate(batches) for j, i in enumerate(b.ids)}
        self._long = {i: c for b in batches for i, c in zip(b.ids, b.captions)}
        self.weights = {i: 1.0 for i in self._where} | {i: w for i, w in (weights or {}).items() if i in self._where}
        self._plans: dict[tuple[int, int], list[tuple[str, ...]]] = {}
        self._check_weights()
        self._check_forms()

    def _check_weights(self) -> None:
        if any(not (w >= 0 and np.isfinite(w)) for w in self.weights.values()):
            raise ValueError("sampling weights must be finite and >= 0")
        if not any(w > 0 for w in self.weights.values()):
            raise ValueError("no training row has a positive sampling weight")

    def _check_forms(self) -> None:
        """Every form the probabilities can draw exists on every row: a missing one fails here, not mid-run."""
        if self.form_probs is None:
            return
        check_form_probs(self.form_probs)
        for form in self.drawable_forms():
            missing = [i for i in self._where if form not in self.forms.get(i, {})]
            if missing:
                raise ValueError(
                    f"caption form {form!r} (probability {self.form_probs[form]}) is missing on {len(missing)} rows, e.g. {missing[0]}"
                )

    @classmethod
    def from_table(
        cls,
        table: pa.Table,
        max_batch_size: int,
        exclude_ids: set[str] | None = None,
        form_probs: dict[str, float] | None = None,
    ) -> "TrainSet":
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
        ids = table.column("id").to_pylist()
        forms = {i: json.loads(f) for i, f in zip(ids, table.column("caption_forms").to_pylist())}
        weights = dict(zip(ids, table.column("sampling_weight").to_pylist()))
        return cls(batches, max_batch_size, forms, weights, form_probs)

    @classmethod
    def from_dir(
        cls,
        data_dir: Path,
        max_batch_size: int,
        holdout: int = 0,
        form_probs: dict[str, float] | None = None,
        init_from: Path | str | None = None,
    ) -> "TrainSet":
        """Hold out `holdout` rows, or the rows `init_from`'s run held out (choose_heldout); `held_out` says which."""
        table = read_train_table(data_dir)
        ids = set(table.column("id").to_pylist())
        held = choose_heldout(ids, holdout, init_from)
        if (
            ids and ids <= held
        ):  # else the trainer would fail later with "no training row has a positive sampling weight"
            why = (
                f"the {len(held)} rows {init_from} held out"
                if read_heldout(init_from) is not None
                else f"train.holdout={holdout}"
            )
            raise ConfigError(
                f"{why}: no row is left to train on, the train set {data_dir} has {len(ids)} rows (train.holdout must be below that)"
            )
        out = cls.from_table(table, max_batch_size, held, form_probs)
        out.held_out = held
        return out

    def __len__(self) -> int:
        """Packed batches; an epoch of a weighted set may have more or fewer (`epoch_length`)."""
        return len(self.batches)

    @property
    def num_rows(self) -> int:
        return sum(b.size for b in self.batches)

    @property
    def weighted(self) -> bool:
        """Whether any row's weight differs from 1: only then are an epoch's rows drawn rather than read in pack order."""
        return any(w != 1.0 for w in self.weights.values())

    def drawable_forms(self) -> list[str]:
        return sorted(f for f, p in (self.form_probs or {}).items() if p > 0)

    def captions(self) -> list[str]:
        """Every caption text the stream can yield, unique and sorted: the text-embedding cache is built over these once."""
        if self.form_probs is None:
            return sorted(set(self._long.values()))
        return sorted({self.forms[i][f] for i in self._where for f in self.drawable_forms()})

    def caption_form(self, row_id: str, seed: int, epoch: int) -> str | None:
        """The caption form this row trains on in `epoch`; None without form probabilities (the long caption)."""
        return None if self.form_probs is None else pick_form(row_id, self.form_probs, seed, epoch)

    def caption_text(self, row_id: str, seed: int, epoch: int) -> str:
        form = self.caption_form(row_id, seed, epoch)
        return self._long[row_id] if form is None else self.forms[row_id][form]

    def main_bucket(self) -> str:
        """The bucket most rows are in (ties broken by name): the resolution samples are drawn at."""
        counts: dict[str, int] = {}
        for b in self.batches:
            counts[b.bucket] = counts.get(b.bucket, 0) + b.size
        return min(counts, key=lambda k: (-counts[k], k))

    def epoch_order(self, epoch: int, seed: int) -> list[int]:
        """Packed-batch order of one unweighted epoch: epoch 0 keeps the pack stage's pre-shuffled order,
        later epochs are a permutation seeded by (seed, epoch)."""
        if epoch == 0:
            return list(range(len(self.batches)))
        rng = np.random.default_rng([seed, epoch])
        return rng.permutation(len(self.batches)).tolist()

    def epoch_batches(self, epoch: int, seed: int) -> list[tuple[str, ...]]:
        """The row ids of each batch of one epoch, in order; a pure function of (seed, epoch).

        Unweighted: the packed batches in `epoch_order`. Weighted: each row appears `copies_in_epoch`
        times (floor(w), plus one with probability frac(w)), its copies shuffled within its bucket, cut
        into batches of `batch_size`, and the batches shuffled, all seeded by (seed, epoch)."""
        key = (seed, epoch)
        if key not in self._plans:
            if len(self._plans) >= 4:  # the stream moves forward: old epochs are not asked for again
                self._plans.clear()
            self._plans[key] = (
                self._weighted_epoch(epoch, seed)
                if self.weighted
                else [self.batches[k].ids for k in self.epoch_order(epoch, seed)]
            )
        return self._plans[key]

    def _weighted_epoch(self, epoch: int, seed: int) -> list[tuple[str, ...]]:
        per_bucket: dict[str, list[str]] = {}
        for b in self.batches:
            for i in b.ids:
                per_bucket.setdefault(b.bucket, []).extend([i] * copies_in_epoch(self.weights[i], i, seed, epoch))
        rng = np.random.default_rng([seed, epoch])
        batches: list[tuple[str, ...]] = []
        for bucket in sorted(per_bucket):
            rows = per_bucket[bucket]
            shuffled = [rows[k] for k in rng.permutation(len(rows))]
            batches += [tuple(shuffled[k : k + self.batch_size]) for k in range(0, len(shuffled), self.batch_size)]
        return [batches[k] for k in rng.permutation(len(batches))]

    def epoch_length(self, epoch: int, seed: int) -> int:
        """Batches in one epoch: what `next_position` needs to know when an epoch ends."""
        return len(self.epoch_batches(epoch, seed))

    def planned(
        self, seed: int, start: DataPosition = DataPosition()
    ) -> Iterator[tuple[DataPosition, tuple[str, ...]]]:
        """Endless (position, row ids) from `start`, without pixels: the stream's plan."""
        epoch, index = start.epoch, start.batch
        while True:
            plan = self.epoch_batches(epoch, seed)
            for i in range(index, len(plan)):
                yield DataPosition(epoch, i), plan[i]
            epoch, index = epoch + 1, 0

    def stream(self, seed: int, start: DataPosition = DataPosition()) -> Iterator[Batch]:
        """Endless batches from `start`; each carries the position it was read at."""
        for pos, ids in self.planned(seed, start):
            yield self._batch(ids, seed, pos)

    def _batch(self, ids: tuple[str, ...], seed: int, pos: DataPosition) -> Batch:
        packed = self._packed.get(ids)
        first = self.batches[self._where[ids[0]][0]]
        pixels = (
            packed.pixels
            if packed is not None
            else np.stack([self.batches[k].pixels[j] for k, j in map(self._where.__getitem__, ids)])
        )
        return Batch(ids, tuple(self.caption_text(i, seed, pos.epoch) for i in ids), first.bucket, pixels, pos)

    def form_counts(self, seed: int, batches: int) -> dict[str, int]:
        """How many samples drew each caption form over the first `batches` batches of the stream
        (a run's steps, whether or not it was resumed on the way)."""
        if self.form_probs is None:
            return {}
        counts = dict.fromkeys(sorted(self.form_probs), 0)
        for pos, ids in itertools.islice(self.planned(seed), batches):
            for i in ids:
                counts[pick_form(i, self.form_probs, seed, pos.epoch)] += 1
        return counts

    def weight_summary(self) -> dict[str, float]:
        w = list(self.weights.values())
        return {"min": min(w), "mean": sum(w) / len(w), "max": max(w)}


def next_position(pos: DataPosition, n_batches: int) -> DataPosition:
    """The position after consuming the batch read at `pos`."""
    return DataPosition(pos.epoch + 1, 0) if pos.batch + 1 >= n_batches else DataPosition(pos.epoch, pos.batch + 1)


def bucket_size(bucket: str) -> tuple[int, int]:
    """(height, width) from a bucket name "HxW"."""
    h, w = bucket.lower().split("x")
    return int(h), int(w)


def dataset_version(data_dir: Path) -> str:
    """sha256 over the pack output's Parquet files (names and bytes, sorted by name): a new version of
    the data gives a new reference set, the same data always the same one."""
    root = Path(data_dir)
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.parquet")):
        h.update(str(f.relative_to(root)).encode() + b"\0")
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()
