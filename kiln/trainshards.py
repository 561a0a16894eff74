"""The train set on disk: WebDataset tar shards, an index beside each, and one manifest.

    OUT/trainset.json                     the manifest: format, image codec, rows, buckets, every shard's size and sha256
    OUT/shards/shard-000000.tar           WebDataset samples `<key>.png` (or .webp / .jpg) + `<key>.json`
                                          (+ `<key>.npy`, the autoencoder's latent, in a latent train set)
    OUT/shards/shard-000000.index.parquet one row per sample: id, bucket, weight, packed batch, member offsets and CRCs

Any WebDataset reader streams the tars as they are (`webdataset.WebDataset(urls)`). The trainer reads them by
index instead: a data-parallel rank needs only its rows of each batch, and the index turns those into one
ranged read per run of adjacent members, locally or from object storage (`kiln.uri.read_range`). Memory is one
shard's index and one batch's images, whatever the number of rows.

The bytes depend only on the rows and the settings (tar mtime 0, fixed owner and mode, sorted members), so
`dvc repro` reproduces the train set byte for byte and its version is the manifest's sha256.
"""

from __future__ import annotations

import hashlib
import heapq
import io
import json
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kiln.errors import MissingInput
from kiln.outputs import sha256_file
from kiln.uri import is_local, local_path, object_size, read_bytes, read_range, tar_index

FORMAT = "kiln-trainset/1"
MANIFEST = "trainset.json"
SHARDS = "shards"
ImageFormat = Literal["png", "webp", "jpeg"]
EXTENSION = {"png": "png", "webp": "webp", "jpeg": "jpg"}
INDEX = pa.schema(
    [
        ("key", pa.string()),
        ("id", pa.string()),
        ("bucket", pa.string()),
        ("sampling_weight", pa.float64()),
        ("batch", pa.int32()),
        ("image_offset", pa.int64()),
        ("image_size", pa.int64()),
        ("image_crc", pa.uint32()),
        ("meta_offset", pa.int64()),
        ("meta_size", pa.int64()),
        ("meta_crc", pa.uint32()),
        ("latent_offset", pa.int64()),  # null without latents
        ("latent_size", pa.int64()),
        ("latent_crc", pa.uint32()),
    ]
)
Member = Literal["image", "latent"]
LatentDtype = Literal["float16", "float32"]
MERGE_GAP = 64 << 10  # members closer than this are fetched in one read: one GET beats two round trips


class ShardError(OSError):
    """A shard that is missing, truncated or changed since the manifest listed it; the message names its URI."""

    def __init__(self, uri: str, why: str):
        super().__init__(f"{uri}: {why}")
        self.uri = uri


@dataclass(frozen=True)
class Sample:
    """One row as the pack stage hands it to the writer, in stream order."""

    id: str
    caption: str
    caption_forms: str  # JSON object form -> text
    sampling_weight: float
    bucket: str
    height: int
    width: int
    image: bytes  # encoded in the manifest's codec
    batch: int  # packed batch: all of one bucket, never split across shards
    crop: tuple[int, int] = (0, 0)  # left, top of the bucket's crop in the resized image
    latent: bytes | None = None  # the image's autoencoder latent (encode_latent), in a latent train set

    def meta(self) -> bytes:
        d = asdict(self)
        d.pop("image")
        d.pop("latent")
        d["crop"] = list(self.crop)
        return json.dumps(d, sort_keys=True, ensure_ascii=False).encode()


@dataclass(frozen=True)
class ShardInfo:
    tar: str  # relative to the train set's root
    index: str
    rows: int
    bytes: int
    sha256: str
    index_sha256: str


@dataclass(frozen=True)
class LatentInfo:
    """What a latent train set's latents are: whose (the autoencoder's identity, which the trainer's must
    match), their layout, and how well that autoencoder reconstructed the held-out rows when they were written."""

    autoencoder: str
    channels: int
    downsample: int
    dtype: str
    psnr_db: float  # mean PSNR of decode(encode(x)) over the psnr_rows held-out rows
    psnr_rows: int
    min_psnr_db: float  # the threshold it passed


@dataclass(frozen=True)
class Manifest:
    image_format: str
    rows: int
    buckets: dict[str, int]  # bucket -> rows
    weighted: bool  # any sampling weight other than 1
    shards: list[ShardInfo] = field(default_factory=list)
    format: str = FORMAT
    latents: LatentInfo | None = None  # a latent train set: every sample has a `.npy` member too

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> "Manifest":
        d = json.loads(text)
        if d.get("format") != FORMAT:
            raise ValueError(f"{where}: not a kiln train set of format {FORMAT} (format {d.get('format')!r})")
        d["shards"] = [ShardInfo(**s) for s in d["shards"]]
        d["latents"] = LatentInfo(**d["latents"]) if d.get("latents") else None
        return cls(**d)


# -- images -------------------------------------------------------------------------------------------------


def encode_image(pixels: np.ndarray, fmt: ImageFormat, quality: int = 95) -> bytes:
    """uint8 HxWx3 -> bytes; png and webp are lossless, jpeg at `quality` (4:4:4, no chroma blur)."""
    from PIL import Image

    buf = io.BytesIO()
    im = Image.fromarray(pixels, "RGB")
    if fmt == "png":
        im.save(buf, "PNG", compress_level=6)
    elif fmt == "webp":
        im.save(buf, "WEBP", lossless=True, quality=100, method=4)
    else:
        im.save(buf, "JPEG", quality=quality, subsampling=0)
    return buf.getvalue()


def decode_image(data: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return np.array(im.convert("RGB"), dtype=np.uint8)  # writable: torch.as_tensor warns on read-only arrays


def encode_latent(latent: np.ndarray, dtype: LatentDtype) -> bytes:
    """A [C, h, w] latent as .npy bytes in `dtype` (WebDataset's readers decode `.npy` members as numpy)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(latent, dtype=np.dtype(dtype)), allow_pickle=False)
    return buf.getvalue()


def decode_latent(data: bytes) -> np.ndarray:
    """.npy bytes -> float32 [C, h, w]."""
    return np.load(io.BytesIO(data), allow_pickle=False).astype(np.float32)


def holdout_ids(ids: Iterable[str], n: int) -> set[str]:
    """The `n` rows a train set holds out: the smallest sha1(id), so the choice depends only on which rows
    exist, not on their order or on the pack seed (evaluation's rows, and the pack stage's latent check).
    Streams: memory O(n), not O(rows)."""
    heap: list[tuple[int, str]] = []  # (-rank, id) of the n smallest ranks so far: the largest on top
    kept: set[str] = set()
    for i in ids:
        if n <= 0 or i in kept:
            continue
        rank = int(hashlib.sha1(i.encode()).hexdigest(), 16)
        if len(heap) < n:
            heapq.heappush(heap, (-rank, i))
            kept.add(i)
        elif rank < -heap[0][0]:
            kept.discard(heapq.heapreplace(heap, (-rank, i))[1])
            kept.add(i)
    return kept


# -- writing ------------------------------------------------------------------------------------------------


class _ShardWriter:
    """One shard being written: samples go straight into the tar (memory: the index's columns, not the
    images), and `close` writes the index and says what the manifest lists."""

    def __init__(self, root: Path, n: int, ext: str):
        from webdataset import TarWriter

        self.root, self.ext = root, ext
        self.tar, self.index = f"{SHARDS}/shard-{n:06d}.tar", f"{SHARDS}/shard-{n:06d}.index.parquet"
        self.file = (root / self.tar).open("wb")
        self.writer = TarWriter(self.file, mtime=0, encoder=False, user="kiln", group="kiln")
        self.cols: dict[str, list] = {name: [] for name in ("key", "id", "bucket", "sampling_weight", "batch")}
        self.crcs: dict[str, list] = {"image": [], "meta": [], "latent": []}

    def write(self, s: Sample) -> None:
        key = f"{s.batch:09d}-{len(self.cols['key']):06d}"  # no dots: WebDataset splits the key at the first
        meta = s.meta()
        self.writer.write({"__key__": key, self.ext: s.image, "json": meta} | ({"npy": s.latent} if s.latent else {}))
        for name, value in zip(self.cols, (key, s.id, s.bucket, float(s.sampling_weight), s.batch)):
            self.cols[name].append(value)
        self.crcs["image"].append(zlib.crc32(s.image))
        self.crcs["meta"].append(zlib.crc32(meta))
        self.crcs["latent"].append(zlib.crc32(s.latent) if s.latent else None)

    @property
    def bytes(self) -> int:
        self.file.flush()
        return self.file.tell()

    def close(self) -> ShardInfo:
        self.writer.close()
        self.file.close()
        members, keys = tar_index(str(self.root / self.tar)), self.cols["key"]
        cols = dict(self.cols)
        for part, suffix in (("image", self.ext), ("meta", "json"), ("latent", "npy")):
            entries = [members.get(f"{k}.{suffix}") for k in keys]
            cols[f"{part}_offset"] = [e.offset if e else None for e in entries]
            cols[f"{part}_size"] = [e.size if e else None for e in entries]
            cols[f"{part}_crc"] = self.crcs[part]
        table = pa.table({name: cols[name] for name in INDEX.names}, schema=INDEX)
        pq.write_table(table, self.root / self.index, compression="zstd", write_statistics=False)
        tar, index = self.root / self.tar, self.root / self.index
        return ShardInfo(self.tar, self.index, len(keys), tar.stat().st_size, sha256_file(tar), sha256_file(index))


def train_samples(table: pa.Table) -> Iterator[Sample]:
    """The pack stage's kept rows (kiln.schemas.TRAIN) as Samples in stream order."""
    table = table.sort_by([("order", "ascending")])
    for chunk in table.to_batches(max_chunksize=1024):
        for r in chunk.to_pylist():
            yield Sample(
                r["id"],
                r["caption"],
                r["caption_forms"],
                r["sampling_weight"],
                r["bucket"],
                r["height"],
                r["width"],
                r["image"],
                r["batch"],
                (r["crop_left"], r["crop_top"]),
                r.get("latent"),
            )


def _by_batch(samples: Iterable[Sample]) -> Iterator[list[Sample]]:
    run: list[Sample] = []
    for s in samples:
        if run and s.batch != run[-1].batch:
            yield run
            run = []
        run.append(s)
    if run:
        yield run


def write_train_set(
    samples: Iterable[Sample],
    root: Path,
    image_format: ImageFormat,
    shard_bytes: int,
    latents: LatentInfo | None = None,
) -> Manifest:
    """Write `samples` (in stream order, each packed batch contiguous) as shards of about `shard_bytes`, cut
    only between batches, then the manifest; streams: each sample goes to its tar as it comes. With
    `latents`, every sample must carry its latent."""
    root = Path(root)
    (root / SHARDS).mkdir(parents=True, exist_ok=True)
    ext = EXTENSION[image_format]
    shards: list[ShardInfo] = []
    buckets: dict[str, int] = {}
    weighted, shard = False, None
    for batch in _by_batch(samples):
        if latents is not None and any(s.latent is None for s in batch):
            raise ValueError(
                f"a latent train set, but sample {next(s.id for s in batch if s.latent is None)} has no latent"
            )
        shard = shard or _ShardWriter(root, len(shards), ext)
        for s in batch:
            shard.write(s)
            buckets[s.bucket] = buckets.get(s.bucket, 0) + 1
            weighted |= s.sampling_weight != 1.0
        if shard.bytes >= shard_bytes:
            shards.append(shard.close())
            shard = None
    if shard is not None:
        shards.append(shard.close())
    manifest = Manifest(
        image_format, sum(buckets.values()), dict(sorted(buckets.items())), weighted, shards, latents=latents
    )
    (root / MANIFEST).write_text(manifest.to_json())
    return manifest


# -- reading ------------------------------------------------------------------------------------------------


def join(root: str, rel: str) -> str:
    return f"{root.rstrip('/')}/{rel}"


def is_train_set(root: str | Path) -> bool:
    root = str(root)
    if is_local(root):
        return Path(local_path(root), MANIFEST).is_file()
    try:
        object_size(join(root, MANIFEST))
        return True
    except OSError:
        return False


def _manifest_bytes(root: str | Path) -> bytes:
    try:
        return read_bytes(join(str(root), MANIFEST))
    except FileNotFoundError as e:
        gone = " (no such folder)" if is_local(str(root)) and not Path(local_path(str(root))).exists() else ""
        raise MissingInput(f"no train set at {root}{gone}: no {MANIFEST} (the pack stage writes one)") from e


def read_manifest(root: str | Path) -> Manifest:
    return Manifest.from_json(_manifest_bytes(root).decode(), join(str(root), MANIFEST))


def manifest_version(root: str | Path) -> str:
    """sha256 of the manifest, which holds every shard's and index's sha256: the train set's content hash."""
    return hashlib.sha256(_manifest_bytes(root)).hexdigest()


class Shard:
    """One listed shard, opened: its index read and its size checked against the manifest (a missing or
    truncated shard fails here, on every rank alike); `read(rows)` fetches and checks members."""

    def __init__(self, root: str, info: ShardInfo):
        self.uri = join(root, info.tar)
        self.info = info
        try:
            size = object_size(self.uri)
        except FileNotFoundError as e:
            raise ShardError(self.uri, "missing: the manifest lists it") from e
        if size != info.bytes:
            raise ShardError(self.uri, f"{size} bytes, the manifest lists {info.bytes}: truncated or changed")
        index_uri = join(root, info.index)
        try:
            data = read_bytes(index_uri)
        except FileNotFoundError as e:
            raise ShardError(index_uri, "missing: the manifest lists it") from e
        if hashlib.sha256(data).hexdigest() != info.index_sha256:
            raise ShardError(index_uri, "changed since the manifest listed it (sha256)")
        table = pq.read_table(pa.BufferReader(data), use_threads=False)  # threads here can abort pyarrow at exit
        self.columns = {name: table.column(name).to_pylist() for name in INDEX.names}
        self._spans = {
            part: list(zip(*(self.columns[f"{part}_{c}"] for c in ("offset", "size", "crc")), strict=True))
            for part in ("meta", "image", "latent")
        }

    @property
    def rows(self) -> int:
        return len(self.columns["id"])

    def column(self, name: str) -> list:
        return self.columns[name]

    def read(self, rows: Sequence[int], member: Member = "image") -> list[tuple[dict, bytes]]:
        """(metadata, encoded image or latent) of each index row in `rows`, in that order; adjacent members in
        one read."""
        spans = []
        for r in rows:
            if self._spans[member][r][0] is None:
                raise ShardError(self.uri, f"row {r} has no {member} member: not a latent train set")
            spans += [self._spans["meta"][r], self._spans[member][r]]
        blobs = self._fetch(spans)
        return [(json.loads(blobs[2 * k]), blobs[2 * k + 1]) for k in range(len(rows))]

    def read_meta(self, rows: Sequence[int]) -> list[dict]:
        """Each row's metadata alone (its JSON member), without the images."""
        return [json.loads(b) for b in self._fetch([self._spans["meta"][r] for r in rows])]

    def _fetch(self, spans: list[tuple[int, int, int]]) -> list[bytes]:
        order = sorted(range(len(spans)), key=lambda k: spans[k][0])
        got: dict[int, bytes] = {}
        k = 0
        while k < len(order):
            first = spans[order[k]][0]
            j, end = k, first + spans[order[k]][1]
            while j + 1 < len(order) and spans[order[j + 1]][0] - end <= MERGE_GAP:
                j += 1
                end = max(end, spans[order[j]][0] + spans[order[j]][1])
            block = read_range(self.uri, first, end - first)
            if len(block) != end - first:
                raise ShardError(self.uri, f"short read at {first}: {len(block)} of {end - first} bytes: truncated")
            for i in order[k : j + 1]:
                off, size, crc = spans[i]
                data = block[off - first : off - first + size]
                if zlib.crc32(data) != crc:
                    raise ShardError(self.uri, f"the member at byte {off} changed since the shard was indexed (CRC)")
                got[i] = data
            k = j + 1
        return [got[i] for i in range(len(spans))]


META_COLUMNS = ("id", "caption", "caption_forms", "sampling_weight", "bucket", "height", "width")


def metadata_table(root: str | Path) -> pa.Table:
    """Every sample's metadata, in stream order, with its packed batch, crop and position (`order`): what the
    train set's data-quality suite checks. Reads the JSON members only, one shard at a time."""
    manifest = read_manifest(root)
    cols: dict[str, list] = {c: [] for c in (*META_COLUMNS, "crop_left", "crop_top", "batch", "order")}
    for info in manifest.shards:
        shard = Shard(str(root), info)
        for meta, batch in zip(shard.read_meta(range(shard.rows)), shard.column("batch")):
            for c in META_COLUMNS:
                cols[c].append(meta[c])
            cols["crop_left"].append(meta["crop"][0])
            cols["crop_top"].append(meta["crop"][1])
            cols["batch"].append(batch)
            cols["order"].append(len(cols["order"]))
    return pa.table(cols)


def verify_shard(root: str, info: ShardInfo) -> None:
    """The whole shard against its sha256: what `kiln` checks before trusting a copy (a full read)."""
    uri = join(root, info.tar)
    h = hashlib.sha256()
    offset = 0
    while offset < info.bytes:
        block = read_range(uri, offset, min(1 << 24, info.bytes - offset))
        if not block:
            raise ShardError(uri, f"truncated at {offset} of {info.bytes} bytes")
        h.update(block)
        offset += len(block)
    if h.hexdigest() != info.sha256:
        raise ShardError(uri, "changed since the manifest listed it (sha256)")
