"""A source of raw images, listed: one row per image with what the source says about it.

A source is `demo` (the procedural corpus, written to a folder first) or one or more uris:
- a folder or object-store prefix (`s3://`, `gs://`, `file://`, a local path): every object under it;
- a glob (`s3://bucket/shards/*.tar`);
- WebDataset `.tar` shards: one row per sample's image, its `.txt` / `.caption` member as the caption
  and its `.json` member as metadata;
- a `.txt` list of uris, one a line;
- a `.parquet` list with a `uri` (or `url`) column, whose other columns travel with each row: `caption`
  (or `text`), `license` and `source` by name, any other column inside `source_meta` (JSON).

The listing records each object's size and version (ETag, generation or mtime) as the store reports
them. Its hash over the sorted (uri, size, version) rows is the source's data version: adding,
removing or replacing an object changes it. Ingest re-checks each size and rejects an object that
changed or disappeared after listing as `unreadable`.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kiln.progress import log, progress
from kiln.uri import (
    RemoteError,
    filesystem,
    is_local,
    local_path,
    read_bytes,
    remote_call,
    tar_index,
    tar_members,
    tar_uri,
)

LISTING = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("uri", pa.string(), nullable=False),
        pa.field("size", pa.int64()),  # bytes as listed; None where the source did not say (a .txt list)
        pa.field("version", pa.string()),  # ETag / generation / mtime as listed
        pa.field("source_caption", pa.string()),
        pa.field("license", pa.string()),
        pa.field("source_name", pa.string()),
        pa.field("source_meta", pa.string()),  # JSON object of any other column the source carried
    ],
    metadata={b"kiln.listing": b"1"},
)
CARRIED = ["source_caption", "license", "source_name", "source_meta"]
IMAGE_EXTENSIONS = {"jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff", "ppm", "pgm", "tga", "jp2", "avif", "mpo"}
CAPTION_EXTENSIONS = ("txt", "caption")
COLUMN_ALIASES = {"caption": "source_caption", "text": "source_caption", "license": "license", "source": "source_name"}


class SourceError(ValueError):
    """A source that cannot be listed: unreachable, missing, denied, empty or of an unknown form."""


def uri_id(uri: str) -> str:
    """Stable row id: the first 16 hex chars of sha1(uri)."""
    return hashlib.sha1(uri.encode("utf-8")).hexdigest()[:16]


def _row(uri: str, size: int | None = None, version: str | None = None, **carried) -> dict:
    return {"uri": uri, "size": size, "version": version, **{k: carried.get(k) for k in CARRIED}}


def _version(info: dict) -> str | None:
    """What changes when the object is replaced, in the order stores report it."""
    for key in ("ETag", "etag", "generation", "md5Hash", "mtime", "LastModified", "updated", "last_modified"):
        if info.get(key) not in (None, ""):
            return str(info[key]).strip('"')
    return None


def _is_tar(uri: str) -> bool:
    return uri.endswith(".tar")


def _ext(name: str) -> str:
    return posixpath.basename(name).rsplit(".", 1)[-1].lower() if "." in posixpath.basename(name) else ""


# --------------------------------------------------------------------------------------- WebDataset
def _sample_key(member: str) -> tuple[str, str]:
    """WebDataset's grouping: the key is the path up to the first dot of the basename."""
    head, base = posixpath.split(member)
    stem, _, ext = base.partition(".")
    return posixpath.join(head, stem), ext.lower()


def _member_text(tar_path: str, member: str) -> str:
    return read_bytes(tar_uri(tar_path, member)).decode("utf-8", errors="replace").strip()


def _carried_from_json(text: str) -> dict:
    try:
        meta = json.loads(text)
    except json.JSONDecodeError:
        return {"source_meta": json.dumps({"json": text})}
    if not isinstance(meta, dict):
        return {"source_meta": json.dumps({"json": meta}, sort_keys=True)}
    out = {col: str(meta.pop(key)) for key, col in COLUMN_ALIASES.items() if meta.get(key) not in (None, "")}
    if meta:
        out["source_meta"] = json.dumps(meta, sort_keys=True, default=str)
    return out


def list_tar(tar_path: str, version: str | None = None) -> list[dict]:
    """A shard's samples: each image member a row carrying its sample's caption and metadata members.

    A member that belongs to no image (a stray file, a sample without an image) is a row of its own, so
    ingest rejects it with a reason rather than dropping it.
    """
    members = tar_members(tar_path)
    try:
        sizes = {m: size for m, (_, size) in tar_index(tar_path).items()}
    except Exception:  # noqa: BLE001 - a compressed shard has no offsets; its sizes stay unknown
        sizes = {}
    by_key: dict[str, dict[str, str]] = {}
    for m in members:
        key, ext = _sample_key(m)
        by_key.setdefault(key, {})[ext] = m
    rows = []
    for m in members:
        key, ext = _sample_key(m)
        sample = by_key[key]
        images = [e for e in sample if _ext("x." + e) in IMAGE_EXTENSIONS]
        if ext in IMAGE_EXTENSIONS or not images:
            carried: dict = {}
            if ext in IMAGE_EXTENSIONS:
                if cap := next((sample[e] for e in CAPTION_EXTENSIONS if e in sample), None):
                    carried["source_caption"] = _member_text(tar_path, cap) or None
                if "json" in sample:
                    carried.update(_carried_from_json(_member_text(tar_path, sample["json"])))
            rows.append(_row(tar_uri(tar_path, m), sizes.get(m), version, **carried))
    return rows


# ------------------------------------------------------------------------------------------- lists
def _read_text_list(uri: str) -> list[str]:
    lines = (line.strip() for line in read_bytes(uri).decode("utf-8").splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _read_parquet_list(uri: str) -> list[dict]:
    import io

    table = pq.read_table(io.BytesIO(read_bytes(uri)))
    col = "uri" if "uri" in table.column_names else "url" if "url" in table.column_names else None
    if col is None:
        raise SourceError(f"{uri}: a Parquet list needs a `uri` (or `url`) column; it has {table.column_names}")
    rows = []
    for rec in table.to_pylist():
        u = rec.pop(col)
        if not u:
            continue
        carried: dict = {}
        for key, target in COLUMN_ALIASES.items():
            if key in rec and target not in carried:
                v = rec.pop(key)
                carried[target] = None if v is None else str(v)
        rest = {k: v for k, v in rec.items() if v is not None}
        if rest:
            carried["source_meta"] = json.dumps(rest, sort_keys=True, default=str)
        rows.append(_row(str(u), **carried))
    return rows


def _expand(rows: list[dict]) -> list[dict]:
    """Tar shards named in a list or found under a prefix become their samples."""
    out: list[dict] = []
    for r in rows:
        out.extend(list_tar(r["uri"], r["version"]) if _is_tar(r["uri"]) else [r])
    return out


# ------------------------------------------------------------------------------------ folders, prefixes
def _walk_local(folder: str) -> list[dict]:
    """Every regular file under folder, sorted by posix relative path, joined onto folder as given."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        rel_root = Path(root).relative_to(folder)
        for f in files:
            st = os.stat(os.path.join(root, f))
            found.append(((rel_root / f).as_posix(), st.st_size, str(st.st_mtime_ns)))
    prefix = "file://" if folder.startswith("file://") else ""
    base = Path(local_path(folder)).as_posix()
    return [_row(f"{prefix}{base}/{rel}", size, v) for rel, size, v in sorted(found)]


def _walk_remote(uri: str, pattern: bool = False) -> list[dict]:
    fs, path = filesystem(uri)
    found = remote_call(uri, fs.glob if pattern else fs.find, path, detail=True)
    rows = [
        _row(fs.unstrip_protocol(name), info.get("size"), _version(info))
        for name, info in sorted(found.items())
        if info.get("type", "file") == "file" and not name.endswith("/")
    ]
    return rows


def _remote_kind(uri: str) -> str:
    """`dir` or `file` for a remote uri; a clear error for a missing bucket, denied access or no answer."""
    fs, path = filesystem(uri)
    if uri.endswith("/"):
        return "dir"
    try:
        return "dir" if remote_call(uri, fs.isdir, path) else "file"
    except FileNotFoundError:
        return "file"


def _list_one(uri: str) -> list[dict]:
    if any(c in uri for c in "*?[") and not is_local(uri):
        return _expand(_walk_remote(uri, pattern=True))
    if is_local(uri):
        p = local_path(uri)
        if os.path.isdir(p):
            return _expand(_walk_local(uri.rstrip("/") if uri != "/" else uri))
        if not os.path.exists(p):
            raise SourceError(f"source {uri}: no such file or folder")
        st = os.stat(p)
        size, version = st.st_size, str(st.st_mtime_ns)
    else:
        if _remote_kind(uri) == "dir":
            return _expand(_walk_remote(uri.rstrip("/") + "/"))
        fs, path = filesystem(uri)
        info = remote_call(uri, fs.info, path)
        size, version = info.get("size"), _version(info)
    if uri.endswith((".txt", ".lst")):
        return _expand([_row(u) for u in _read_text_list(uri)])
    if uri.endswith(".parquet"):
        return _expand(_read_parquet_list(uri))
    if _is_tar(uri):
        return list_tar(uri, version)
    return [_row(uri, size, version)]  # a single object


def _check_one(uri: str) -> None:
    if is_local(uri):
        if not os.path.exists(local_path(uri)):
            raise SourceError(f"source {uri}: no such file or folder")
        return
    if any(c in uri for c in "*?["):  # a glob: its folder must be there
        uri = uri[: min(uri.find(c) for c in "*?[" if c in uri)].rsplit("/", 1)[0] + "/"
    fs, path = filesystem(uri)
    remote_call(uri, fs.info, path.rstrip("/"))  # an object, or a prefix (s3fs, gcsfs: type directory)


def check_source(source: str | Sequence[str]) -> None:
    """One cheap request per uri, so that an unreachable store, a missing bucket or denied access is a clear
    error naming the uri before any stage starts, not a failure hours into a listing."""
    for uri in source_uris(source):
        try:
            _check_one(uri)
        except SourceError:
            raise
        except (OSError, RemoteError) as e:
            raise SourceError(_naming(uri, e)) from e


def _naming(uri: str, e: Exception) -> str:
    return f"source {e}" if str(e).startswith(uri) else f"source {uri}: {e}"


def source_uris(source: str | Sequence[str]) -> list[str]:
    return [source] if isinstance(source, str) else list(source)


def list_source(source: str | Sequence[str]) -> pa.Table:
    """The LISTING of one or more source uris, in the order given (each sorted); a uri listed twice is one row.

    Raises SourceError naming the uri when a store cannot be reached, a bucket or object is missing,
    access is denied, or a source lists no objects.
    """
    rows: list[dict] = []
    for uri in progress(source_uris(source), desc="listing", unit="source"):
        try:
            found = _list_one(uri)
        except SourceError:
            raise
        except (OSError, RemoteError) as e:
            raise SourceError(_naming(uri, e)) from e
        if not found:
            raise SourceError(f"source {uri}: lists no objects")
        rows.extend(found)
    seen: set[str] = set()
    unique = [r for r in rows if not (r["uri"] in seen or seen.add(r["uri"]))]  # first position wins
    if len(unique) != len(rows):
        log.warning("source: %d repeated uris listed once", len(rows) - len(unique))
    for r in unique:
        r["id"] = uri_id(r["uri"])
    return pa.Table.from_pylist(unique, schema=LISTING)


def is_listing(table_or_schema: pa.Table | pa.Schema) -> bool:
    schema = table_or_schema.schema if isinstance(table_or_schema, pa.Table) else table_or_schema
    return (schema.metadata or {}).get(b"kiln.listing") == b"1"


def listing_version(listing: pa.Table) -> str:
    """The source's data version: sha256 over the sorted (uri, size, version) rows."""
    h = hashlib.sha256()
    rows = sorted(zip(listing.column("uri").to_pylist(), listing.column("size").to_pylist(), listing.column("version").to_pylist(), strict=True))
    for uri, size, version in rows:
        h.update(f"{uri}\t{size}\t{version}\n".encode())
    return h.hexdigest()


# ------------------------------------------------------------------------------------ the raw_images door
def demo_folder(raw: Path, cfg) -> str:
    """`source: demo` is the demo corpus in `raw/images`, written there when missing or made with other settings."""
    from assets.demo_corpus import demo_stamp, write_demo_corpus

    demo, stamp = cfg.data.demo, raw / "demo.json"
    if not (stamp.is_file() and stamp.read_text() == demo_stamp(demo.n, demo.seed, demo.size) and (raw / "images").is_dir()):
        write_demo_corpus(raw, n=demo.n, seed=demo.seed, size=demo.size)
    return (raw / "images").as_posix()


def resolve_source(cfg, raw: Path) -> list[str]:
    """The configured source as uris; `demo` becomes its folder."""
    uris = source_uris(cfg.data.source)
    return [demo_folder(raw, cfg) if u == "demo" else u for u in uris]


def write_listing(cfg, out: Path, raw: Path) -> dict:
    """List the configured source into out/listing.parquet and out/source.json (version, counts); return the report."""
    from kiln.stage import write_table

    listing = list_source(resolve_source(cfg, raw))
    sizes = [s for s in listing.column("size").to_pylist() if s is not None]
    report = {
        "source": cfg.data.source,
        "objects": listing.num_rows,
        "listed_bytes": sum(sizes),
        "unknown_sizes": listing.num_rows - len(sizes),
        "with_source_caption": listing.num_rows - listing.column("source_caption").null_count,
        "version": listing_version(listing),
    }
    out.mkdir(parents=True, exist_ok=True)
    write_table(listing, out / "listing.parquet")
    (out / "source.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return report
