"""Streaming the pack stage's train set (kiln.trainshards) as training batches, in memory that does not grow with it.

One global stream of batches, a pure function of (seed, epoch):
- the epoch's shard order: epoch 0 keeps the pack's order, later epochs a permutation seeded by (seed, epoch);
- each shard's batches: unweighted, the packed batches (split to the step's batch size), in pack order in epoch 0
  and permuted by (seed, epoch, shard) later; weighted, each row `copies_in_epoch` times (floor(w), plus one with
  probability frac(w)), shuffled within its bucket, cut into batches and the batches permuted, seeded likewise;
- each sample's caption form drawn by (seed, epoch, id) (kiln.sampling.pick_form).

A position (epoch, shard, batch) names exactly which batch comes next, so a resume is exact, and it does not
depend on the number of ranks: data-parallel rank r reads only its `local_rows` of each global batch, so the
ranks' shares are disjoint, their union is the batch, and a run resumed on any other number of ranks continues
with the very next global batch (nothing repeated, nothing skipped). Memory: one shard's index, the batches
prefetched, and the held-out ids.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from kiln.config import ConfigError
from kiln.progress import log
from kiln.sampling import check_form_probs, copies_in_epoch, pick_form
from kiln.trainshards import (
    META_COLUMNS,
    Manifest,
    Shard,
    ShardError,
    decode_image,
    decode_latent,
    holdout_ids,
    manifest_version,
    read_manifest,
)


@dataclass(frozen=True)
class DataPosition:
    """Where the stream stands: in epoch `epoch`, `shard` shards of its order read and `batch` batches of the next."""

    epoch: int = 0
    shard: int = 0
    batch: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "shard": self.shard, "batch": self.batch}

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> "DataPosition":
        return cls(epoch=int(d["epoch"]), shard=int(d.get("shard", 0)), batch=int(d["batch"]))


@dataclass(frozen=True)
class PlannedBatch:
    """One global batch of the plan, before any image is read."""

    position: DataPosition  # before it; resuming from it yields this batch again
    after: DataPosition  # where the stream stands once it is consumed
    shard: int  # into the manifest's shards
    rows: tuple[int, ...]  # rows of that shard's index; a weighted epoch may repeat one
    ids: tuple[str, ...]
    bucket: str


@dataclass(frozen=True)
class Batch:
    """This rank's rows of one global batch, all of one bucket: pixels as uint8 NHWC, and the stored latents
    of a latent train set (whose pixels are read only when asked for: REPA's encoder)."""

    ids: tuple[str, ...]
    captions: tuple[str, ...]  # each row's caption form drawn for this epoch
    bucket: str
    pixels: np.ndarray | None  # uint8 [b, H, W, 3]; None: a latent train set read without them
    position: DataPosition
    after: DataPosition = DataPosition()
    rows: slice = field(default_factory=lambda: slice(None))  # which rows of the global batch these are
    global_size: int = 0  # rows in the global batch (0: these are all of it)
    latents: np.ndarray | None = None  # float32 [b, C, h, w], a latent train set's

    @property
    def size(self) -> int:
        return len(self.ids)

    @property
    def total(self) -> int:
        return self.global_size or self.size


@dataclass(frozen=True)
class Work:
    """One rank's share of a planned batch, for a loader worker to read: the shard is open, its index read."""

    plan: PlannedBatch
    shard: Shard
    rows: slice  # of the global batch
    seed: int


HELDOUT_FILE = "heldout.json"  # in a checkpoint folder: the ids its run held out, inherited by runs started from it


def read_heldout(checkpoint: Path | str | None) -> set[str] | None:
    """The ids a checkpoint's run held out, or None (no checkpoint, or one written before kiln kept the record)."""
    path = Path(checkpoint) / HELDOUT_FILE if checkpoint else None
    return set(json.loads(path.read_text())["ids"]) if path and path.exists() else None


def write_heldout(out_dir: Path, ids: set[str]) -> None:
    (Path(out_dir) / HELDOUT_FILE).write_text(json.dumps({"ids": sorted(ids)}, indent=0) + "\n")


def train_index(
    data_dir: Path | str, columns: tuple[str, ...] = ("id",), skip_bad: bool = False
) -> Iterator[tuple[int, dict[str, list]]]:
    """(shard number, its index's `columns`) for every shard: the rows' metadata, one shard at a time.
    `skip_bad`: leave out a shard that is missing, truncated or changed (train.bad_shard=skip)."""
    root, manifest = str(data_dir), read_manifest(data_dir)
    for k, info in enumerate(manifest.shards):
        try:
            shard = Shard(root, info)
        except ShardError:
            if skip_bad:
                continue
            raise
        yield k, {c: shard.column(c) for c in columns}


def train_ids(data_dir: Path | str, skip_bad: bool = False) -> Iterator[str]:
    for _, index in train_index(data_dir, skip_bad=skip_bad):
        yield from index["id"]


def read_train_rows(data_dir: Path | str, ids: set[str]) -> pa.Table:
    """The rows `ids` with their images decoded: id, caption, caption_forms, sampling_weight, bucket, height,
    width, pixels (uint8 HxWx3 bytes), in stream order. For evaluation's few rows, not for training."""
    root, manifest = str(data_dir), read_manifest(data_dir)
    out: list[dict] = []
    for info in manifest.shards:
        shard = Shard(root, info)
        rows = [r for r, i in enumerate(shard.column("id")) if i in ids]
        for meta, image in shard.read(rows) if rows else []:
            pixels = decode_image(image)
            out.append({k: meta[k] for k in META_COLUMNS} | {"pixels": pixels.tobytes()})
    return pa.Table.from_pylist(out)


def decode_pixels(table: pa.Table) -> np.ndarray:
    """uint8 [N, H, W, 3] from the `pixels` column of rows that share one size (read_train_rows)."""
    h, w = table.column("height").to_pylist(), table.column("width").to_pylist()
    if len(set(h)) != 1 or len(set(w)) != 1:
        raise ValueError(f"rows of one batch have several sizes: {sorted(set(zip(h, w)))}")
    raw = bytearray(b"".join(table.column("pixels").to_pylist()))  # writable: torch refuses read-only buffers
    return np.frombuffer(raw, dtype=np.uint8).reshape(table.num_rows, h[0], w[0], 3)


def choose_heldout(ids: Iterable[str], n: int, init_from: Path | str | None) -> set[str]:
    """The rows a run holds out: those its starting checkpoint's run held out (so no rung of a ladder ever
    trains on the first rung's held-out rows, which evaluation reads), else the `n` smallest sha1(id)."""
    inherited = read_heldout(init_from)
    return inherited if inherited is not None else holdout_ids(ids, n)


@dataclass
class _Census:
    """One pass over every shard's index: what a run must know before step 1, in memory O(held out)."""

    rows: int = 0
    weight_min: float = float("inf")
    weight_max: float = float("-inf")
    weight_sum: float = 0.0
    positive: bool = False
    buckets: dict[str, int] = field(default_factory=dict)


def check_latents(manifest: Manifest, autoencoder: str, where: Path | str) -> None:
    """A latent train set trains only the model whose autoencoder wrote its latents: another's latent space
    (or pixel space) would train silently on the wrong inputs."""
    if manifest.latents is not None and manifest.latents.autoencoder != autoencoder:
        raise ConfigError(
            f"{where} holds latents of autoencoder {manifest.latents.autoencoder}, but the model's is {autoencoder}: "
            "set model.autoencoder_path to the one data.pack used, or pack the train set again"
        )


def check_buckets(buckets: list[str], side: int, where: Path | str) -> None:
    """Every bucket must be whole DiT tokens (`side` px: the autoencoder's downsample x model.patch_size); a
    set packed for another model would fail deep in the first step with a shape error instead."""
    bad = [b for b in buckets if any(s % side for s in bucket_size(b))]
    if bad:
        raise ConfigError(
            f"{where}: bucket(s) {', '.join(sorted(bad))} are not whole tokens of this model ({side} px a side: its "
            "autoencoder's downsample x model.patch_size); pack the train set again for this model (assets.pack.side_step)"
        )


class TrainSet:
    """The pack stage's train set, streamed: `stream(seed, position, dp_rank, dp_size)` yields this rank's rows
    of each global batch from `position` on, reading only those rows' images."""

    def __init__(
        self,
        root: str,
        manifest: Manifest,
        batch_size: int,
        held_out: set[str],
        form_probs: dict[str, float] | None = None,
        on_bad_shard: str = "stop",
    ):
        self.root, self.manifest = root, manifest
        self.batch_size = batch_size
        self.held_out = held_out
        self.form_probs = dict(form_probs) if form_probs is not None else None
        self.on_bad_shard = on_bad_shard
        self.with_pixels = manifest.latents is None  # a latent set's images are read only when asked (REPA)
        self.skipped: list[dict] = []  # shards skipped (on_bad_shard=skip): epoch, uri, why
        if self.form_probs is not None:
            check_form_probs(self.form_probs)
        self.census = self._take_census()
        self._shard: tuple[int, Shard] | None = None

    @classmethod
    def from_dir(
        cls,
        data_dir: Path | str,
        max_batch_size: int,
        holdout: int = 0,
        form_probs: dict[str, float] | None = None,
        init_from: Path | str | None = None,
        on_bad_shard: str = "stop",
    ) -> "TrainSet":
        """Hold out `holdout` rows, or the rows `init_from`'s run held out (choose_heldout); `held_out` says which."""
        root = str(data_dir)
        manifest = read_manifest(root)
        held = choose_heldout(train_ids(root, skip_bad=on_bad_shard == "skip"), holdout, init_from)
        out = cls(root, manifest, max_batch_size, held, form_probs, on_bad_shard)
        if out.num_rows == 0:
            why = (
                f"the {len(held)} rows {init_from} held out"
                if read_heldout(init_from) is not None
                else f"train.holdout={holdout}"
            )
            raise ConfigError(
                f"{why}: no row is left to train on, the train set {data_dir} has {manifest.rows} rows (train.holdout must be below that)"
            )
        if not out.census.positive:
            raise ValueError("no training row has a positive sampling weight")
        return out

    def _take_census(self) -> _Census:
        c = _Census()
        for info in self.manifest.shards:
            try:
                shard = Shard(self.root, info)
            except ShardError as e:
                if self.on_bad_shard != "skip":
                    raise
                log.warning("train: a bad shard, skipped (train.bad_shard=skip): %s", e)
                self.skipped.append({"epoch": None, "uri": e.uri, "why": str(e)})
                continue
            for i, w, b in zip(shard.column("id"), shard.column("sampling_weight"), shard.column("bucket")):
                if i in self.held_out:
                    continue
                if not (w >= 0 and np.isfinite(w)):
                    raise ValueError(f"{info.tar}: sampling weights must be finite and >= 0, row {i} has {w}")
                c.rows += 1
                c.weight_min, c.weight_max, c.weight_sum = min(c.weight_min, w), max(c.weight_max, w), c.weight_sum + w
                c.positive |= w > 0
                c.buckets[b] = c.buckets.get(b, 0) + 1
        return c

    @property
    def num_rows(self) -> int:
        """Rows trained on: the set's rows less those held out."""
        return self.census.rows

    @property
    def weighted(self) -> bool:
        """Whether any row's weight differs from 1: only then are an epoch's rows drawn rather than read in pack order."""
        return self.manifest.weighted

    @property
    def buckets(self) -> list[str]:
        return sorted(self.census.buckets)

    def main_bucket(self) -> str:
        """The bucket most rows are in (ties broken by name): the resolution samples are drawn at."""
        return min(self.census.buckets, key=lambda k: (-self.census.buckets[k], k))

    def weight_summary(self) -> dict[str, float]:
        c = self.census
        return {"min": c.weight_min, "mean": c.weight_sum / c.rows, "max": c.weight_max}

    def drawable_forms(self) -> list[str]:
        return sorted(f for f, p in (self.form_probs or {}).items() if p > 0)

    def caption_form(self, row_id: str, seed: int, epoch: int) -> str | None:
        """The caption form this row trains on in `epoch`; None without form probabilities (the long caption)."""
        return None if self.form_probs is None else pick_form(row_id, self.form_probs, seed, epoch)

    def drawable_texts(self, limit: int) -> list[str] | None:
        """Every caption text the stream can draw (each row's forms of positive probability, or its caption),
        sorted; None, without reading anything, when the set has more than `limit` rows."""
        if self.manifest.rows > limit:
            return None
        forms = [f for f, p in (self.form_probs or {}).items() if p > 0]
        texts: set[str] = set()
        for info in self.manifest.shards:
            try:
                shard = Shard(self.root, info)
            except ShardError:
                continue  # the stream stops on it or skips it (on_bad_shard); the cache need not know
            for meta in shard.read_meta(range(shard.rows)):
                if meta["id"] in self.held_out:
                    continue
                if self.form_probs is None:
                    texts.add(meta["caption"])
                else:
                    drawn = json.loads(meta["caption_forms"])
                    texts.update(drawn[f] for f in forms if f in drawn)
        return sorted(texts)

    def caption_text(self, meta: dict, seed: int, epoch: int) -> str:
        form = self.caption_form(meta["id"], seed, epoch)
        if form is None:
            return meta["caption"]
        forms = json.loads(meta["caption_forms"])
        if form not in forms:
            raise ValueError(
                f"caption form {form!r} (probability {self.form_probs[form]}) is missing on row {meta['id']}"  # type: ignore[index]
            )
        return forms[form]

    # -- the plan -------------------------------------------------------------------------------------------

    def shard_order(self, epoch: int, seed: int) -> list[int]:
        n = len(self.manifest.shards)
        return list(range(n)) if epoch == 0 else np.random.default_rng([seed, epoch]).permutation(n).tolist()

    def open_shard(self, k: int) -> Shard:
        if self._shard is None or self._shard[0] != k:
            self._shard = (k, Shard(self.root, self.manifest.shards[k]))
        return self._shard[1]

    def shard_batches(self, k: int, epoch: int, seed: int) -> list[tuple[int, ...]]:
        """Shard k's batches in one epoch, as rows of its index: a pure function of (seed, epoch, k)."""
        shard = self.open_shard(k)
        ids = shard.column("id")
        live = [r for r, i in enumerate(ids) if i not in self.held_out]
        rng = np.random.default_rng([seed, epoch, k])
        if not self.weighted:
            packed = shard.column("batch")
            batches = [
                part[off : off + self.batch_size]
                for _, group in itertools.groupby(live, key=packed.__getitem__)
                for part in [tuple(group)]
                for off in range(0, len(part), self.batch_size)
            ]
            return batches if epoch == 0 else [batches[j] for j in rng.permutation(len(batches))]
        weights, buckets = shard.column("sampling_weight"), shard.column("bucket")
        per_bucket: dict[str, list[int]] = {}
        for r in live:
            per_bucket.setdefault(buckets[r], []).extend([r] * copies_in_epoch(weights[r], ids[r], seed, epoch))
        batches = []
        for bucket in sorted(per_bucket):
            rows = per_bucket[bucket]
            shuffled = [rows[j] for j in rng.permutation(len(rows))]
            batches += [tuple(shuffled[j : j + self.batch_size]) for j in range(0, len(shuffled), self.batch_size)]
        return [batches[j] for j in rng.permutation(len(batches))]

    def _batches_or_skip(self, k: int, epoch: int, seed: int) -> list[tuple[int, ...]]:
        try:
            return self.shard_batches(k, epoch, seed)
        except ShardError as e:
            if self.on_bad_shard != "skip":
                raise
            log.warning("train: epoch %d: skipping a bad shard (train.bad_shard=skip): %s", epoch, e)
            self.skipped.append({"epoch": epoch, "uri": e.uri, "why": str(e)})
            return []

    def planned(self, seed: int, start: DataPosition = DataPosition()) -> Iterator[PlannedBatch]:
        """Endless global batches from `start`, without pixels: the stream's plan."""
        epoch, s, b = start.epoch, start.shard, start.batch
        empty_epochs = 0
        while True:
            order = self.shard_order(epoch, seed)
            yielded = False
            for pos in range(s, len(order)):
                k = order[pos]
                batches = self._batches_or_skip(k, epoch, seed)
                ids = self.open_shard(k).column("id") if batches else []
                buckets = self.open_shard(k).column("bucket") if batches else []
                for j in range(b, len(batches)):
                    rows = batches[j]
                    after = (
                        DataPosition(epoch, pos, j + 1)
                        if j + 1 < len(batches)
                        else DataPosition(epoch, pos + 1, 0)
                        if pos + 1 < len(order)
                        else DataPosition(epoch + 1, 0, 0)
                    )
                    yielded = True
                    yield PlannedBatch(
                        DataPosition(epoch, pos, j), after, k, rows, tuple(ids[r] for r in rows), buckets[rows[0]]
                    )
                b = 0
            empty_epochs = 0 if yielded else empty_epochs + 1
            if empty_epochs >= 100:
                raise ValueError(
                    f"{self.root}: 100 epochs in a row drew no rows (weights too small, or every shard bad)"
                )
            epoch, s = epoch + 1, 0

    def work(
        self, seed: int, start: DataPosition = DataPosition(), dp_rank: int = 0, dp_size: int = 1
    ) -> Iterator[Work]:
        """Endless work items from `start`: this rank's `local_rows` of each global batch, nothing read yet."""
        for plan in self.planned(seed, start):
            mine = local_rows(len(plan.rows), dp_rank, dp_size, allow_empty=True)  # a bucket's last batch may be small
            yield Work(plan, self.open_shard(plan.shard), mine, seed)

    def read(self, w: Work) -> Batch:
        """A work item's rows, read and decoded: what a loader worker does (thread-safe: it touches only `w`)."""
        rows, (h, wd), info = w.plan.rows[w.rows], bucket_size(w.plan.bucket), self.manifest.latents
        metas, pixels, latents = [], None, None
        if info is not None:
            samples = w.shard.read(rows, "latent")
            metas = [meta for meta, _ in samples]
            shape = (0, info.channels, h // info.downsample, wd // info.downsample)
            latents = np.stack([decode_latent(x) for _, x in samples]) if samples else np.zeros(shape, np.float32)
        if self.with_pixels:
            samples = w.shard.read(rows)
            metas = [meta for meta, _ in samples]
            pixels = np.stack([decode_image(x) for _, x in samples]) if samples else np.zeros((0, h, wd, 3), np.uint8)
        captions = tuple(self.caption_text(meta, w.seed, w.plan.position.epoch) for meta in metas)
        p = w.plan
        return Batch(p.ids[w.rows], captions, p.bucket, pixels, p.position, p.after, w.rows, len(p.rows), latents)

    def stream(
        self, seed: int, start: DataPosition = DataPosition(), dp_rank: int = 0, dp_size: int = 1
    ) -> Iterator[Batch]:
        """Endless batches from `start`, read in this thread (the trainer reads them in loader workers)."""
        return map(self.read, self.work(seed, start, dp_rank, dp_size))

    def form_counts(self, seed: int, batches: int) -> dict[str, int]:
        """How many samples drew each caption form over the first `batches` global batches of the stream
        (a run's steps, whether or not it was resumed on the way)."""
        if self.form_probs is None:
            return {}
        counts = dict.fromkeys(sorted(self.form_probs), 0)
        for plan in itertools.islice(self.planned(seed), batches):
            for i in plan.ids:
                counts[pick_form(i, self.form_probs, seed, plan.position.epoch)] += 1
        return counts


def local_rows(batch: int, dp_rank: int, dp_size: int, allow_empty: bool = False) -> slice:
    """This data-parallel rank's contiguous share of a global batch (sizes differ by at most one); with
    `allow_empty`, a batch smaller than dp_size leaves the last ranks no rows (they still take the step)."""
    if batch < dp_size and not allow_empty:
        raise ValueError(f"a batch of {batch} rows cannot feed {dp_size} data-parallel ranks")
    base, extra = divmod(batch, dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return slice(start, start + base + (dp_rank < extra))


def bucket_size(bucket: str) -> tuple[int, int]:
    """(height, width) from a bucket name "HxW"."""
    h, w = bucket.lower().split("x")
    return int(h), int(w)


def dataset_version(data_dir: Path | str) -> str:
    """The train set's content hash: sha256 of its manifest, which lists every shard's and index's sha256.
    A new version of the data gives a new reference set, the same data always the same one."""
    return manifest_version(data_dir)
