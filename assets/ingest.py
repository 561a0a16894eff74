"""Ingest: a source's listing (assets.source) -> the MANIFEST.

The stage reads each object once for its md5 and parses only its header (PIL's lazy open) for
format, size, mode, EXIF orientation and frame count; the columns the source carried (caption,
licence, source name, metadata) travel with the row. An object whose size differs from its listing,
or that is gone, is rejected `unreadable` with what changed in `detail`.
Local uris keep the input path exactly as given, so a manifest written from a relative path
reproduces byte for byte on any clone.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from assets.imageio import exif_orientation, open_header
from assets.source import CARRIED, LISTING, is_listing, list_source, uri_id
from kiln.config import KilnConfig
from kiln.reasons import Reason
from kiln.schemas import MANIFEST
from kiln.stage import Rejects, Stage, StageOutput
from kiln.uri import read_bytes

INPUTS = LISTING
__all__ = ["INPUTS", "ingest", "list_inputs", "uri_id"]


def list_inputs(path: Path | str) -> pa.Table:
    """The listing a stage run ingests: a listing kiln wrote (`kiln source`), else the source listed now."""
    path = str(path)
    if path.endswith(".parquet") and "://" not in path and Path(path).is_file() and is_listing(pq.read_schema(path)):
        return pq.read_table(path).cast(LISTING)
    return list_source(path)


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


def changed_since_listing(listed: dict, data: bytes) -> str | None:
    """What differs between the listed object and the bytes read: the size, or an MD5 ETag (S3 single-part)."""
    if listed["size"] is not None and len(data) != listed["size"]:
        return f"listed {listed['size']} bytes, read {len(data)}"
    etag = (listed["version"] or "").lower()
    md5_etag = len(etag) == 32 and all(c in "0123456789abcdef" for c in etag) and "::" not in listed["uri"]
    if md5_etag and (md5 := hashlib.md5(data).hexdigest()) != etag:
        return f"listed ETag {etag}, read md5 {md5}"
    return None


def ingest(table: pa.Table, cfg: KilnConfig) -> StageOutput:
    from PIL import UnidentifiedImageError

    rejects = Rejects("ingest")
    rows: list[dict] = []
    for listed in table.to_pylist():
        id, uri = listed["id"], listed["uri"]
        try:
            data = read_bytes(uri)
        except OSError as e:
            rejects.add(id, uri, Reason.UNREADABLE, None, f"{type(e).__name__}: {e}")
            continue
        if changed := changed_since_listing(listed, data):
            rejects.add(id, uri, Reason.UNREADABLE, float(len(data)), f"changed since listing: {changed}")
            continue
        if not data:
            rejects.add(id, uri, Reason.EMPTY_FILE, 0.0, "0 bytes")
            continue
        try:
            rows.append(describe(id, uri, data) | {k: listed[k] for k in CARRIED})
        except UnidentifiedImageError:
            rejects.add(id, uri, Reason.NOT_AN_IMAGE, float(len(data)), "PIL cannot identify the header")
        except Exception as e:  # a header PIL recognises but cannot parse
            rejects.add(id, uri, Reason.UNREADABLE, float(len(data)), f"header: {type(e).__name__}: {e}")
    kept = pa.Table.from_pylist(rows, schema=MANIFEST) if rows else MANIFEST.empty_table()
    return StageOutput(kept, rejects.table())


STAGE = Stage(name="ingest", fn=ingest, input_schema=INPUTS, output_schema=MANIFEST, list_inputs=list_inputs)
