"""Ingest: any folder / file list / Parquet of uris / WebDataset tar shards -> the MANIFEST.

`list_inputs` turns the input into (id, uri) rows; the stage reads each file once for its md5 and
parses only its header (PIL's lazy open) for format, size, mode, EXIF orientation and frame count.
Uris keep the input path exactly as given, joined with posix relative paths, so a manifest written
from a relative path reproduces byte for byte on any clone.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from assets.imageio import exif_orientation, open_header
from kiln.config import KilnConfig
from kiln.progress import log
from kiln.reasons import Reason
from kiln.schemas import MANIFEST
from kiln.stage import Rejects, Stage, StageOutput
from kiln.uri import read_bytes, tar_members, tar_uri

INPUTS = pa.schema([pa.field("id", pa.string(), nullable=False), pa.field("uri", pa.string(), nullable=False)])


def uri_id(uri: str) -> str:
    """Stable row id: the first 16 hex chars of sha1(uri)."""
    return hashlib.sha1(uri.encode("utf-8")).hexdigest()[:16]


def _is_tar(path: str) -> bool:
    return path.endswith(".tar")


def _walk(folder: Path) -> list[str]:
    """Every regular file under folder, sorted by posix relative path, joined onto folder as given."""
    rels = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        rel_root = Path(root).relative_to(folder)
        rels.extend((rel_root / f).as_posix() for f in files)
    return [(folder / rel).as_posix() for rel in sorted(rels)]


def _expand_tars(paths: list[str]) -> list[str]:
    """Tar shards become one uri per member (`shard.tar::member`), in archive order."""
    out: list[str] = []
    for p in paths:
        if _is_tar(p) and os.path.isfile(p):
            out.extend(tar_uri(p, m) for m in tar_members(p))
        else:
            out.append(p)
    return out


def _read_list(path: Path) -> list[str]:
    lines = (line.strip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def list_inputs(path: Path | str) -> pa.Table:
    """The (id, uri) rows of an input: folder (recursive, sorted), .txt list, Parquet with `uri`, or tars."""
    path = Path(path)
    if path.is_dir():
        uris = _expand_tars(_walk(path))
    elif path.suffix == ".txt":
        uris = _expand_tars(_read_list(path))
    elif path.suffix == ".parquet":
        uris = pq.read_table(path, columns=["uri"]).column("uri").to_pylist()
    elif _is_tar(path.as_posix()):
        uris = _expand_tars([path.as_posix()])
    else:
        raise ValueError(f"ingest input {path}: expected a folder, a .txt list, a .parquet with a uri column or a .tar")
    unique = list(dict.fromkeys(uris))  # a uri listed twice is one file: keep its first position
    if len(unique) != len(uris):
        log.warning("ingest: %d repeated uris in %s listed once", len(uris) - len(unique), path)
    return pa.table({"id": [uri_id(u) for u in unique], "uri": unique}, schema=INPUTS)


def _n_frames(im) -> int:
    try:
        return int(getattr(im, "n_frames", 1))
    except Exception:  # a broken later frame is the filter's business; the first frame may be fine
        return 1


def describe(id: str, uri: str, data: bytes) -> dict:
    """One MANIFEST row from the bytes and the header. Raises PIL's UnidentifiedImageError."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PIL warns on odd headers; the filter's decode decides
        im = open_header(data)
        return {
            "id": id,
            "uri": uri,
            "bytes": len(data),
            "md5": hashlib.md5(data).hexdigest(),
            "format": im.format,
            "width": im.width,
            "height": im.height,
            "mode": im.mode,
            "exif_orientation": exif_orientation(im),
            "n_frames": _n_frames(im),
        }


def ingest(table: pa.Table, cfg: KilnConfig) -> StageOutput:
    from PIL import UnidentifiedImageError

    rejects = Rejects("ingest")
    rows: list[dict] = []
    for id, uri in zip(table.column("id").to_pylist(), table.column("uri").to_pylist()):
        try:
            data = read_bytes(uri)
        except OSError as e:
            rejects.add(id, uri, Reason.UNREADABLE, None, f"{type(e).__name__}: {e}")
            continue
        if not data:
            rejects.add(id, uri, Reason.EMPTY_FILE, 0.0, "0 bytes")
            continue
        try:
            rows.append(describe(id, uri, data))
        except UnidentifiedImageError:
            rejects.add(id, uri, Reason.NOT_AN_IMAGE, float(len(data)), "PIL cannot identify the header")
        except Exception as e:  # a header PIL recognises but cannot parse
            rejects.add(id, uri, Reason.UNREADABLE, float(len(data)), f"header: {type(e).__name__}: {e}")
    kept = pa.Table.from_pylist(rows, schema=MANIFEST) if rows else MANIFEST.empty_table()
    return StageOutput(kept, rejects.table())


STAGE = Stage(name="ingest", fn=ingest, input_schema=INPUTS, output_schema=MANIFEST, list_inputs=list_inputs)
