"""Ingest: a source's listing (assets.source) -> the MANIFEST.

The stage reads each object once, in chunks, for its md5, and parses only its header (PIL's lazy open) for
format, size, mode, EXIF orientation and frame count; the columns the source carried (caption,
licence, source name, metadata) travel with the row. An object whose size differs from its listing,
or that is gone, is rejected `unreadable` with what changed in `detail`.
Local uris keep the input path as given, so a manifest written from a relative path
reproduces byte for byte on any clone.

No input can crash or hang the stage: before anything is read, a row the lister marked (`problem`) is rejected
with its reason, a uri outside the folder or prefix it was listed from (and `data.ingest.roots`) is
`outside_roots`, a row reached through a symlink is `symlink` under `data.ingest.symlinks=refuse`, and a file
over `data.ingest.max_bytes` is `too_large`; a FIFO or device is `not_a_file` (never opened for reading).
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from assets.source import CARRIED, LISTING, as_listing, is_listing, list_source, uri_id
from kiln.config import IngestConfig, KilnConfig
from kiln.imageio import exif_orientation, open_header
from kiln.reasons import Reason, detail_of
from kiln.schemas import MANIFEST
from kiln.stage import Rejects, Stage, StageOutput
from kiln.uri import NotARegularFile, TooLarge, md5_of, open_uri, split_uri, within

INPUTS = LISTING
__all__ = ["INPUTS", "ingest", "list_inputs", "uri_id"]

Failure = tuple[Reason, float | None, str]


def list_inputs(path: Path | str) -> pa.Table:
    """The listing a stage run ingests: a listing kiln wrote (`kiln source`), else the source listed now."""
    path = str(path)
    if path.endswith(".parquet") and "://" not in path and Path(path).is_file() and is_listing(pq.read_schema(path)):
        return as_listing(pq.read_table(path))
    return list_source(path)


def _n_frames(im) -> int:
    try:
        return int(getattr(im, "n_frames", 1))
    except Exception:  # noqa: BLE001 - a broken later frame is the filter's business; the first frame may be fine
        return 1


def header_of(src: bytes | BinaryIO) -> dict:
    """Format, size, mode, EXIF orientation and frame count from the header. Raises PIL's UnidentifiedImageError."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PIL warns on odd headers; the filter's decode decides
        im = open_header(src)
        return {
            "format": im.format,
            "width": im.width,
            "height": im.height,
            "mode": im.mode,
            "exif_orientation": exif_orientation(im),
            "n_frames": _n_frames(im),
        }


def describe(id: str, uri: str, data: bytes) -> dict:
    """One MANIFEST row from the bytes and the header. Raises PIL's UnidentifiedImageError."""
    return {"id": id, "uri": uri, "bytes": len(data), "md5": hashlib.md5(data).hexdigest(), **header_of(data)}


def changed_since_listing(listed: dict, size: int, md5: str) -> str | None:
    """What differs between the listed object and the bytes read: the size, or an MD5 ETag (S3 single-part)."""
    if listed["size"] is not None and size != listed["size"]:
        return f"listed {listed['size']} bytes, read {size}"
    etag = (listed["version"] or "").lower()
    md5_etag = len(etag) == 32 and all(c in "0123456789abcdef" for c in etag) and split_uri(listed["uri"])[1] is None
    if md5_etag and md5 != etag:
        return f"listed ETag {etag}, read md5 {md5}"
    return None


def refusal(listed: dict, ic: IngestConfig) -> Failure | None:
    """Why a listed row is rejected before anything is read, or None."""
    if listed.get("problem"):
        return Reason(listed["problem"]), None, listed.get("problem_detail") or ""
    uri, root = listed["uri"], listed.get("root")
    roots = ([root] if root else []) + list(ic.roots)
    if roots and not any(within(uri, r) for r in roots):
        return Reason.OUTSIDE_ROOTS, None, f"not under {' or '.join(roots)} (data.ingest.roots names more)"
    if listed.get("symlink") and ic.symlinks == "refuse":
        return Reason.SYMLINK, None, f"reached through the symlink {listed['symlink']} (data.ingest.symlinks=refuse)"
    if listed["size"] is not None and listed["size"] > ic.max_bytes:
        return Reason.TOO_LARGE, float(listed["size"]), f"listed {listed['size']} bytes > max_bytes={ic.max_bytes}"
    return None


def read_row(listed: dict, max_bytes: int) -> dict | Failure:
    """The MANIFEST row of one listed object (hashed in chunks, header only), or why it has none."""
    from PIL import UnidentifiedImageError

    uri = listed["uri"]
    try:
        with open_uri(uri, max_bytes) as f:
            md5, size = md5_of(f, uri, max_bytes)
            if changed := changed_since_listing(listed, size, md5):
                return Reason.UNREADABLE, float(size), f"changed since listing: {changed}"
            if not size:
                return Reason.EMPTY_FILE, 0.0, "0 bytes"
            f.seek(0)
            try:
                header = header_of(f)
            except UnidentifiedImageError:
                return Reason.NOT_AN_IMAGE, float(size), "PIL cannot identify the header"
            except Exception as e:  # noqa: BLE001 - a header PIL recognises but cannot parse
                return Reason.UNREADABLE, float(size), f"header: {detail_of(e)}"
    except NotARegularFile as e:
        return Reason.NOT_A_FILE, None, str(e)
    except TooLarge as e:
        return Reason.TOO_LARGE, None if e.size is None else float(e.size), str(e)
    except OSError as e:
        return Reason.UNREADABLE, None, detail_of(e)
    return {"id": listed["id"], "uri": uri, "bytes": size, "md5": md5, **header} | {k: listed[k] for k in CARRIED}


def ingest(table: pa.Table, cfg: KilnConfig) -> StageOutput:
    ic = cfg.data.ingest
    rejects = Rejects("ingest")
    rows: list[dict] = []
    for listed in table.to_pylist():
        id, uri = listed["id"], listed["uri"]
        try:
            got = refusal(listed, ic) or read_row(listed, ic.max_bytes)
        except Exception as e:  # noqa: BLE001 - whatever a hostile file does to a reader is this row's reject, not the stage's end
            got = Reason.UNREADABLE, None, detail_of(e)
        if isinstance(got, dict):
            rows.append(got)
        else:
            rejects.add(id, uri, *got)
    kept = pa.Table.from_pylist(rows, schema=MANIFEST) if rows else MANIFEST.empty_table()
    return StageOutput(kept, rejects.table())


STAGE = Stage(name="ingest", fn=ingest, input_schema=INPUTS, output_schema=MANIFEST, list_inputs=list_inputs)
