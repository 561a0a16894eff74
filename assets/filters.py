"""The filter stage: MANIFEST -> FILTERED, cheap CPU checks, cheapest first, one reason per row.

Checks that need only the manifest (format, pixel count, size, aspect) run before the file is read,
so decompression bombs and thumbnails never reach a decoder. The manifest is not trusted beyond that: the
same checks run again on the header the file really has (a bomb declared small is still `too_many_pixels`),
and a file whose bytes (md5, size) or header no longer match its row is `changed_since_ingest`. Then one
decode (assets/decode.py) gives every statistic; the first threshold an image fails is its reason, with
the measured value.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pyarrow as pa

from assets.decode import DecodeFailure, Measures, UnsupportedFormat, aspect_of, measure
from kiln.config import FilterConfig, KilnConfig
from kiln.imageio import open_header
from kiln.reasons import Reason, detail_of
from kiln.schemas import FILTERED, MANIFEST
from kiln.stage import Rejects, Stage, StageOutput
from kiln.uri import NotARegularFile, TooLarge, read_bytes

Failure = tuple[Reason, float | None, str]


def header_failure(row: dict, f: FilterConfig) -> Failure | None:
    """Checks on the manifest alone, before any I/O."""
    if row["format"] not in f.formats:
        return Reason.UNSUPPORTED_FORMAT, None, f"format {row['format']} not in {f.formats}"
    w, h = row["width"], row["height"]
    if w * h > f.max_pixels:
        return Reason.TOO_MANY_PIXELS, float(w * h), f"{w}x{h} > {f.max_pixels} pixels"
    if min(w, h) < f.min_side:
        return Reason.TOO_SMALL, float(min(w, h)), f"{w}x{h}: min side < {f.min_side}"
    aspect = aspect_of(w, h)
    if aspect > f.max_aspect:
        return Reason.BAD_ASPECT, aspect, f"{w}x{h}: aspect > {f.max_aspect}"
    return None


# (reason, statistic, fails(value, cfg), threshold text): the order decides which reason a row gets.
# Most specific first: all-white / all-black and edge bands also lower entropy and the Laplacian.
STAT_CHECKS: list[tuple[Reason, str, Callable[[float, FilterConfig], bool], str]] = [
    (Reason.TOO_WHITE, "white_ratio", lambda v, f: v > f.max_white_ratio, "max_white_ratio"),
    (Reason.TOO_BLACK, "black_ratio", lambda v, f: v > f.max_black_ratio, "max_black_ratio"),
    (Reason.BORDER, "border_share", lambda v, f: v > f.max_border_share, "max_border_share"),
    (Reason.LOW_ENTROPY, "entropy", lambda v, f: v < f.min_entropy, "min_entropy"),
    (Reason.LOW_LAPLACIAN, "laplacian_var", lambda v, f: v < f.min_laplacian_var, "min_laplacian_var"),
    (Reason.HIGH_LAPLACIAN, "laplacian_var", lambda v, f: v > f.max_laplacian_var, "max_laplacian_var"),
]


def stats_failure(m: Measures, f: FilterConfig) -> Failure | None:
    for reason, stat, fails, threshold in STAT_CHECKS:
        value = getattr(m, stat)
        if fails(value, f):
            return reason, float(value), f"{stat}={value:.4g} vs {threshold}={getattr(f, threshold)}"
    return None


HEADER_KEYS = ("format", "width", "height")


def real_header(data: bytes) -> dict | None:
    """Format and size from the file's own header, or None when PIL cannot parse it."""
    try:
        im = open_header(data)
        return {"format": im.format, "width": im.width, "height": im.height}
    except Exception:  # noqa: BLE001 - an unparseable header is judged by the md5 check and then the decode
        return None


def changed_since_ingest(row: dict, data: bytes) -> str | None:
    """What differs between the bytes read now and the manifest row: the size, else the md5."""
    if len(data) != row["bytes"]:
        return f"the manifest says {row['bytes']} bytes, the file has {len(data)}"
    if (md5 := hashlib.md5(data).hexdigest()) != row["md5"]:
        return f"the manifest says md5 {row['md5']}, the file has {md5}"
    return None


def read_failure(row: dict, data: bytes, f: FilterConfig) -> tuple[dict, Failure | None]:
    """The checks on what was read, before the decode: the manifest's header checks on the real header, then
    the bytes and the header against the row. Returns the real header (the row's where unparseable)."""
    real = real_header(data)
    if real is not None and (failed := header_failure({**row, **real}, f)):
        reason, value, detail = failed
        said = {k: row[k] for k in HEADER_KEYS}
        return real, (
            reason,
            value,
            detail
            if said == real
            else f"{detail} (the manifest said {said['format']} {said['width']}x{said['height']})",
        )
    if changed := changed_since_ingest(row, data):
        return real or row, (Reason.CHANGED_SINCE_INGEST, float(len(data)), changed)
    if real is not None and any(real[k] != row[k] for k in HEADER_KEYS):
        said, now = (f"{h['format']} {h['width']}x{h['height']}" for h in (row, real))
        return real, (Reason.CHANGED_SINCE_INGEST, None, f"the manifest says {said}, the header {now}")
    return real or row, None


def filter_row(row: dict, f: FilterConfig, max_bytes: int | None = None) -> tuple[Measures | None, Failure | None]:
    """Measure one manifest row; exactly one of the two results is set."""
    failed = header_failure(row, f)
    if failed:
        return None, failed
    try:
        data = read_bytes(row["uri"], max_bytes)
    except TooLarge as e:
        return None, (Reason.TOO_LARGE, None if e.size is None else float(e.size), str(e))
    except NotARegularFile as e:
        return None, (Reason.NOT_A_FILE, None, str(e))
    except FileNotFoundError as e:
        return None, (Reason.CHANGED_SINCE_INGEST, None, f"gone since ingest: {detail_of(e)}")
    except OSError as e:
        return None, (Reason.DECODE_ERROR, None, detail_of(e))
    real, failed = read_failure(row, data, f)
    if failed:
        return None, failed
    try:
        m = measure(data, real["width"], real["height"], row["exif_orientation"], f.decode_size, f.stats_size)
    except UnsupportedFormat as e:
        return None, (Reason.UNSUPPORTED_FORMAT, None, str(e))
    except DecodeFailure as e:
        return None, (Reason.DECODE_ERROR, None, str(e))
    failed = stats_failure(m, f)
    return (None, failed) if failed else (m, None)


def filter_stage(table: pa.Table, cfg: KilnConfig) -> StageOutput:
    f = cfg.data.filters
    rejects = Rejects("filter")
    kept: list[dict] = []
    for row in table.to_pylist():
        m, failed = filter_row(row, f, cfg.data.ingest.max_bytes)
        if failed:
            reason, value, detail = failed
            rejects.add(row["id"], row["uri"], reason, value, detail)
        else:
            kept.append({**row, **m.as_row()})
    out = pa.Table.from_pylist(kept, schema=FILTERED) if kept else FILTERED.empty_table()
    return StageOutput(out, rejects.table())


STAGE = Stage(name="filter", fn=filter_stage, input_schema=MANIFEST, output_schema=FILTERED)
