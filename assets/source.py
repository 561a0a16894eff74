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

Nothing the lister meets vanishes: what cannot be an image row (a FIFO or device, a folder it may not list, a
file name that is not UTF-8, a null or non-string entry in a list, a `.tar` that is no tar, a looping or
refused symlink) is a row carrying that `problem`, which ingest turns into a reject with its reason. Each
row also carries its `root`, the folder or prefix it was listed from (for a list's entries: the list's folder,
or its bucket / host), which ingest confines the uri to.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import posixpath
import stat
import tarfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.parquet as pq

from kiln.progress import log, progress
from kiln.reasons import Reason, detail_of
from kiln.uri import (
    NotARegularFile,
    RemoteError,
    file_kind,
    filesystem,
    is_local,
    local_path,
    read_bytes,
    remote_call,
    split_uri,
    tar_entries,
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
        pa.field("root", pa.string()),  # the folder or prefix the uri was listed from: ingest refuses a uri outside it
        pa.field("symlink", pa.string()),  # the symlink the walk followed to reach this uri, if any
        pa.field(
            "problem", pa.string()
        ),  # a reject reason the lister already knows (kiln.reasons); None for a file to read
        pa.field("problem_detail", pa.string()),
    ],
    metadata={b"kiln.listing": b"1"},
)
CARRIED = ["source_caption", "license", "source_name", "source_meta"]
TEXT_MEMBER_MAX = 16 * 2**20  # a caption or .json member larger than this is not read (the image row stays)
IMAGE_EXTENSIONS = {
    "jpg",
    "jpeg",
    "png",
    "webp",
    "gif",
    "bmp",
    "tif",
    "tiff",
    "ppm",
    "pgm",
    "tga",
    "jp2",
    "avif",
    "mpo",
}
CAPTION_EXTENSIONS = ("txt", "caption")
COLUMN_ALIASES = {"caption": "source_caption", "text": "source_caption", "license": "license", "source": "source_name"}


class SourceError(ValueError):
    """A source that cannot be listed: unreachable, missing, denied, empty or of an unknown form."""


def uri_id(uri: str) -> str:
    """Stable row id: the first 16 hex chars of sha1(uri)."""
    return hashlib.sha1(uri.encode("utf-8")).hexdigest()[:16]


def _row(
    uri: str,
    size: int | None = None,
    version: str | None = None,
    *,
    root: str | None = None,
    symlink: str | None = None,
    problem: Reason | None = None,
    detail: str | None = None,
    **carried,
) -> dict:
    return {
        "uri": uri, "size": size, "version": version, **{k: carried.get(k) for k in CARRIED},
        "root": root, "symlink": symlink, "problem": None if problem is None else str(problem), "problem_detail": detail,
    }  # fmt: skip


def _is_utf8(name: str) -> bool:
    """False for a name holding bytes that are not UTF-8 (Python keeps them as lone surrogates), which no uri can carry."""
    try:
        name.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _shown(name: str) -> str:
    """A name that is not UTF-8, printable: its odd bytes as `\\xff`."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def as_listing(table: pa.Table) -> pa.Table:
    """A listing in this schema: columns an older listing lacks (root, problem, ...) are added as nulls."""
    cols = [table.column(f.name) if f.name in table.column_names else pa.nulls(table.num_rows, f.type) for f in LISTING]
    return pa.Table.from_arrays(cols, schema=LISTING.remove_metadata()).cast(LISTING)


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


def _member_text(tar_path: str, member: str) -> str | None:
    """A caption / metadata member's text; None when it cannot be read (the image row stays, without it)."""
    try:
        return read_bytes(tar_uri(tar_path, member), TEXT_MEMBER_MAX).decode("utf-8", errors="replace").strip()
    except OSError:
        return None


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


def list_tar(
    tar_path: str, version: str | None = None, root: str | None = None, symlink: str | None = None
) -> list[dict]:
    """A shard's samples: each image member a row carrying its sample's caption and metadata members.

    A member that belongs to no image (a stray file, a sample without an image), a member that is no regular file
    (a symlink, a device) and a member whose name is not UTF-8 are rows of their own, so ingest rejects them with a
    reason rather than dropping them. A file that is no tar is one row, rejected `unreadable`.
    """
    where = {"root": root if root is not None else tar_path, "symlink": symlink}
    try:
        entries = tar_entries(tar_path)
    except NotARegularFile as e:
        return [_row(tar_path, **where, problem=Reason.NOT_A_FILE, detail=str(e))]
    except RemoteError:
        raise  # the store did not answer: the source cannot be listed
    except (tarfile.TarError, OSError, EOFError) as e:
        return [
            _row(
                tar_path,
                version=version,
                **where,
                problem=Reason.UNREADABLE,
                detail=f"not a readable tar shard: {detail_of(e)}",
            )
        ]
    members = [m for m, e in entries.items() if e.kind == "file" and _is_utf8(m)]
    by_key: dict[str, dict[str, str]] = {}
    for m in members:
        key, ext = _sample_key(m)
        by_key.setdefault(key, {})[ext] = m
    rows = []
    for m, entry in entries.items():
        if not _is_utf8(m):
            rows.append(
                _row(
                    tar_uri(tar_path, _shown(m)),
                    **where,
                    problem=Reason.BAD_URI,
                    detail="the member's name is not UTF-8",
                )
            )
            continue
        if entry.kind != "file":
            rows.append(
                _row(
                    tar_uri(tar_path, m),
                    **where,
                    problem=Reason.NOT_A_FILE,
                    detail=f"a tar {entry.kind}, not a regular member",
                )
            )
            continue
        key, ext = _sample_key(m)
        sample = by_key[key]
        images = [e for e in sample if _ext("x." + e) in IMAGE_EXTENSIONS]
        if ext in IMAGE_EXTENSIONS or not images:
            carried: dict = {}
            if ext in IMAGE_EXTENSIONS:
                if cap := next((sample[e] for e in CAPTION_EXTENSIONS if e in sample), None):
                    carried["source_caption"] = _member_text(tar_path, cap) or None
                if "json" in sample and (text := _member_text(tar_path, sample["json"])) is not None:
                    carried.update(_carried_from_json(text))
            size = entry.size if entry.offset >= 0 else None
            rows.append(_row(tar_uri(tar_path, m), size, version, **where, **carried))
    return rows


# ------------------------------------------------------------------------------------------- lists
def list_root(list_uri: str) -> str:
    """Where a list's entries may point by default: the folder holding a local list, the bucket or host of a remote one."""
    if is_local(list_uri):
        prefix = "file://" if list_uri.startswith("file://") else ""
        return prefix + (os.path.dirname(local_path(list_uri)) or ".")
    parts = urlsplit(list_uri)
    return f"{parts.scheme}://{parts.netloc}/"


def _through_symlink(path: str, root: str) -> bool:
    """Whether a local path passes through a symlink below root (or anywhere, when it lies outside root)."""
    lexical, real = os.path.abspath(path), os.path.realpath(path)
    base = os.path.abspath(local_path(root))
    if os.path.commonpath([lexical, base]) != base:
        return lexical != real
    return os.path.relpath(lexical, base) != os.path.relpath(real, os.path.realpath(base))


def _entry(value, where: str, root: str, **carried) -> dict:
    """One list entry as a row; what is no usable uri (null, empty, not a string, a NUL byte) is a `bad_uri` row
    named after its place in the list."""
    bad = None
    if value is None:
        bad = "the uri is null"
    elif not isinstance(value, str):
        bad = f"the uri is {type(value).__name__} {str(value)[:80]!r}, not a string"
    elif not value.strip():
        bad = "the uri is empty"
    elif "\0" in value:
        bad = "the uri holds a NUL byte"
    if bad:
        return _row(where, root=root, problem=Reason.BAD_URI, detail=bad, **carried)
    local = is_local(value) and is_local(root) and split_uri(value)[1] is None
    symlink = value if local and _through_symlink(local_path(value), root) else None
    return _row(value, root=root, symlink=symlink, **carried)


def _read_text_list(uri: str) -> list[dict]:
    root, rows = list_root(uri), []
    for n, raw in enumerate(read_bytes(uri).split(b"\n"), start=1):
        raw = raw.strip()
        if not raw or raw.startswith(b"#"):
            continue
        try:
            rows.append(_entry(raw.decode("utf-8"), f"{uri} [line {n}]", root))
        except UnicodeDecodeError:
            shown = raw.decode("utf-8", "backslashreplace")
            rows.append(
                _row(
                    f"{uri} [line {n}]",
                    root=root,
                    problem=Reason.BAD_URI,
                    detail=f"line {n} is not UTF-8: {shown[:200]}",
                )
            )
    return rows


def _read_parquet_list(uri: str) -> list[dict]:
    try:
        table = pq.read_table(io.BytesIO(read_bytes(uri)))
    except pa.ArrowException as e:
        raise SourceError(f"{uri}: not a readable Parquet list ({detail_of(e)})") from e
    col = "uri" if "uri" in table.column_names else "url" if "url" in table.column_names else None
    if col is None:
        raise SourceError(f"{uri}: a Parquet list needs a `uri` (or `url`) column; it has {table.column_names}")
    root, rows = list_root(uri), []
    for i, rec in enumerate(table.to_pylist()):
        u = rec.pop(col)
        carried: dict = {}
        for key, target in COLUMN_ALIASES.items():
            if key in rec and target not in carried:
                v = rec.pop(key)
                carried[target] = None if v is None else str(v)
        rest = {k: v for k, v in rec.items() if v is not None}
        if rest:
            carried["source_meta"] = json.dumps(rest, sort_keys=True, default=str)
        rows.append(_entry(u, f"{uri} [row {i}]", root, **carried))
    return rows


def _expand(rows: list[dict]) -> list[dict]:
    """Tar shards named in a list or found under a prefix become their samples."""
    out: list[dict] = []
    for r in rows:
        shard = _is_tar(r["uri"]) and r["problem"] is None
        out.extend(list_tar(r["uri"], r["version"], r["root"], r["symlink"]) if shard else [r])
    return out


# ------------------------------------------------------------------------------------ folders, prefixes
def _join(root: str, rel: str) -> str:
    return f"{root}{rel}" if root.endswith("/") else f"{root}/{rel}"


def _walk_local(folder: str, symlinks: str = "follow") -> list[dict]:
    """Every entry under folder, sorted by posix relative path, joined onto folder as given.

    A regular file is a row to read. Anything else the walk meets is a row with the reason it cannot be read:
    a FIFO, socket or device (`not_a_file`), a folder it may not list (`unreadable`), a name that is not UTF-8
    (`bad_uri`), a symlink refused by `symlinks="refuse"` or one that loops back into a folder above it
    (`symlink`). Followed symlinks are recorded on the rows they lead to.
    """
    prefix = "file://" if folder.startswith("file://") else ""
    root = prefix + Path(local_path(folder)).as_posix()
    found: list[tuple[str, dict]] = []

    def add(rel: str, **kw) -> None:
        found.append((rel, _row(_join(root, rel), root=root, **kw)))

    def visit(path: str, rel: str, via: str | None, ancestors: frozenset[tuple[int, int]]) -> None:
        try:
            with os.scandir(path) as it:
                entries = list(it)
        except OSError as e:
            if not rel:
                raise
            add(rel, symlink=via, problem=Reason.UNREADABLE, detail=f"a folder that cannot be listed: {detail_of(e)}")
            return
        for entry in entries:
            r = f"{rel}/{entry.name}" if rel else entry.name
            if not _is_utf8(r):
                add(
                    _shown(r),
                    symlink=via,
                    problem=Reason.BAD_URI,
                    detail="the name is not UTF-8: no uri can name it; rename it",
                )
                continue
            link = via
            try:
                if entry.is_symlink():
                    target = os.readlink(entry.path)
                    if symlinks == "refuse":
                        add(
                            r,
                            symlink=_join(root, r),
                            problem=Reason.SYMLINK,
                            detail=f"a symlink to {target} (data.ingest.symlinks=refuse)",
                        )
                        continue
                    link = via or _join(root, r)
                    try:
                        st = os.stat(entry.path)
                    except OSError as e:
                        add(
                            r,
                            symlink=link,
                            problem=Reason.UNREADABLE,
                            detail=f"a broken symlink to {target}: {detail_of(e)}",
                        )
                        continue
                else:
                    st = entry.stat(follow_symlinks=False)
            except OSError as e:
                add(r, symlink=link, problem=Reason.UNREADABLE, detail=detail_of(e))
                continue
            if stat.S_ISDIR(st.st_mode):
                key = (st.st_dev, st.st_ino)
                if key in ancestors:
                    add(
                        r,
                        symlink=link,
                        problem=Reason.SYMLINK,
                        detail="a symlink loop: it leads back into a folder above it",
                    )
                else:
                    visit(entry.path, r, link, ancestors | {key})
            elif stat.S_ISREG(st.st_mode):
                add(r, size=st.st_size, version=str(st.st_mtime_ns), symlink=link)
            else:
                add(r, symlink=link, problem=Reason.NOT_A_FILE, detail=f"a {file_kind(st.st_mode)}, not a regular file")

    top = local_path(folder)
    st = os.stat(top)
    visit(top, "", None, frozenset({(st.st_dev, st.st_ino)}))
    return [row for _, row in sorted(found, key=lambda f: f[0])]


def _walk_remote(uri: str, pattern: bool = False) -> list[dict]:
    fs, path = filesystem(uri)
    found = remote_call(uri, fs.glob if pattern else fs.find, path, detail=True)
    root = uri[: min(uri.find(c) for c in "*?[" if c in uri)].rsplit("/", 1)[0] + "/" if pattern else uri
    return [
        _row(fs.unstrip_protocol(name), info.get("size"), _version(info), root=root)
        for name, info in sorted(found.items())
        if info.get("type", "file") == "file" and not name.endswith("/")
    ]


def _remote_kind(uri: str) -> str:
    """`dir` or `file` for a remote uri; a clear error for a missing bucket, denied access or no answer."""
    fs, path = filesystem(uri)
    if uri.endswith("/"):
        return "dir"
    try:
        return "dir" if remote_call(uri, fs.isdir, path) else "file"
    except FileNotFoundError:
        return "file"


def _list_one(uri: str, symlinks: str = "follow") -> list[dict]:
    if any(c in uri for c in "*?[") and not is_local(uri):
        return _expand(_walk_remote(uri, pattern=True))
    if is_local(uri):
        p = local_path(uri)
        if os.path.isdir(p):
            return _expand(_walk_local(uri.rstrip("/") if uri != "/" else uri, symlinks))
        if not os.path.exists(p):
            raise SourceError(f"source {uri}: no such file or folder")
        st = os.stat(p)
        if not stat.S_ISREG(st.st_mode):
            return [
                _row(uri, root=uri, problem=Reason.NOT_A_FILE, detail=f"a {file_kind(st.st_mode)}, not a regular file")
            ]
        size, version = st.st_size, str(st.st_mtime_ns)
    else:
        if _remote_kind(uri) == "dir":
            return _expand(_walk_remote(uri.rstrip("/") + "/"))
        fs, path = filesystem(uri)
        info = remote_call(uri, fs.info, path)
        size, version = info.get("size"), _version(info)
    if uri.endswith((".txt", ".lst")):
        return _expand(_read_text_list(uri))
    if uri.endswith(".parquet"):
        return _expand(_read_parquet_list(uri))
    if _is_tar(uri):
        return list_tar(uri, version, uri)
    return [_row(uri, size, version, root=uri)]  # a single object


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


def list_source(source: str | Sequence[str], symlinks: str = "follow") -> pa.Table:
    """The LISTING of one or more source uris, in the order given (each sorted); a uri listed twice is one row.

    `symlinks` (data.ingest.symlinks): "follow" walks into symlinked folders, "refuse" lists each symlink as a
    row rejected `symlink`. Raises SourceError naming the uri when a store cannot be reached, a bucket or
    object is missing, access is denied, or a source lists no objects.
    """
    rows: list[dict] = []
    for uri in progress(source_uris(source), desc="listing", unit="source"):
        try:
            found = _list_one(uri, symlinks)
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
    rows = sorted(
        zip(
            listing.column("uri").to_pylist(),
            listing.column("size").to_pylist(),
            listing.column("version").to_pylist(),
            strict=True,
        )
    )
    for uri, size, version in rows:
        h.update(f"{uri}\t{size}\t{version}\n".encode())
    return h.hexdigest()


# ------------------------------------------------------------------------------------ the raw_images door
def demo_folder(raw: Path, cfg) -> str:
    """`source: demo` is the demo corpus in `raw/images`, written there when missing or made with other settings."""
    from assets.demo_corpus import demo_stamp, write_demo_corpus

    demo, stamp = cfg.data.demo, raw / "demo.json"
    if not (
        stamp.is_file() and stamp.read_text() == demo_stamp(demo.n, demo.seed, demo.size) and (raw / "images").is_dir()
    ):
        write_demo_corpus(raw, n=demo.n, seed=demo.seed, size=demo.size)
    return (raw / "images").as_posix()


def resolve_source(cfg, raw: Path) -> list[str]:
    """The configured source as uris; `demo` becomes its folder."""
    uris = source_uris(cfg.data.source)
    return [demo_folder(raw, cfg) if u == "demo" else u for u in uris]


def write_listing(cfg, out: Path, raw: Path) -> dict:
    """List the configured source into out/listing.parquet and out/source.json (version, counts); return the report."""
    from kiln.stage import write_table

    listing = list_source(resolve_source(cfg, raw), cfg.data.ingest.symlinks)
    sizes = [s for s in listing.column("size").to_pylist() if s is not None]
    report = {
        "source": cfg.data.source,
        "objects": listing.num_rows,
        "listed_bytes": sum(sizes),
        "unknown_sizes": listing.num_rows - len(sizes),
        "with_source_caption": listing.num_rows - listing.column("source_caption").null_count,
        "version": listing_version(listing),
        "problems": dict(
            sorted(Counter(p for p in listing.column("problem").to_pylist() if p).items())
        ),  # rejected at ingest
    }
    out.mkdir(parents=True, exist_ok=True)
    write_table(listing, out / "listing.parquet")
    (out / "source.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return report


def source_listing(out: Path, cfg, raw: Path | None = None) -> dict:
    """`kiln source` (the `raw_images` node): the listing under `out`; `raw`, where `source: demo` writes the
    demo corpus (default: data/raw)."""
    from kiln.paths import artifact

    return write_listing(cfg, Path(out), Path(raw) if raw else artifact("raw"))
