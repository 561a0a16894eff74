"""The filter stage: MANIFEST -> FILTERED, cheap CPU checks, cheapest first, one reason per row.

Checks that need only the manifest (format, pixel count, size, aspect) run before the file is read,
so decompression bombs and thumbnails never reach a decoder. Then one decode (assets/decode.py)
gives every statistic; the first threshold an image fails is its reason, with the measured value.
"""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa

from assets.decode import DecodeFailure, Measures, UnsupportedFormat, aspect_of, measure
from kiln.config import FilterConfig, KilnConfig
from kiln.reasons import Reason
from kiln.schemas import FILTERED, MANIFEST
from kiln.stage import Rejects, Stage, StageOutput
from kiln.uri import read_bytes

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


def filter_row(row: dict, f: FilterConfig) -> tuple[Measures | None, Failure | None]:
    """Measure one manifest row; exactly one of the two results is set."""
    failed = header_failure(row, f)
    if failed:
        return None, failed
    try:
        data = read_bytes(row["uri"])
        m = measure(data, row["width"], row["height"], row["exif_orientation"], f.decode_size, f.stats_size)
    except UnsupportedFormat as e:
        return None, (Reason.UNSUPPORTED_FORMAT, None, str(e))
    except (DecodeFailure, OSError) as e:
        return None, (Reason.DECODE_ERROR, None, str(e))
    failed = stats_failure(m, f)
    return (None, failed) if failed else (m, None)


def filter_stage(table: pa.Table, cfg: KilnConfig) -> StageOutput:
    f = cfg.data.filters
    rejects = Rejects("filter")
    kept: list[dict] = []
    for row in table.to_pylist():
        m, failed = filter_row(row, f)
        if failed:
            reason, value, detail = failed
            rejects.add(row["id"], row["uri"], reason, value, detail)
        else:
            kept.append({**row, **m.as_row()})
    out = pa.Table.from_pylist(kept, schema=FILTERED) if kept else FILTERED.empty_table()
    return StageOutput(out, rejects.table())


STAGE = Stage(name="filter", fn=filter_stage, input_schema=MANIFEST, output_schema=FILTERED)
