"""Drift checks: has a dataset's distribution of aspect ratios or caption lengths moved since its previous version?

A schema cannot say this and a range check cannot either: every row can be valid while the mix has changed
(a new source of panoramas, a captioner that writes a third as much). Each validated stage output folder gets
a profile, fixed-bin counts of its aspect ratios (max side / min side) and caption lengths (characters).

The previous version is the previous materialization of the same folder: its profile is stored beside the
output, in `<data>/.profiles/<folder>.json` (never inside it: the folder's content hash is its DVC and Dagster
data version). The store holds `current` and `previous`, each a version (a hash of the row ids and the
profile) and its profile. Validating a new version compares it with the stored current one, which becomes
`previous`; validating the same version again (a re-run check) compares it with the stored previous one.
A folder's first version passes, with a note saying there was nothing to compare with.

Measure: the population stability index, PSI = sum over bins (p - q) ln(p / q), shares smoothed by half a row
per bin. It fails above 0.25 (the usual "significant shift"), or, where the row counts are small, above what
sampling alone reaches once in a thousand times: two samples of n and m rows from one distribution give
PSI ~ (1/n + 1/m) chi2(bins - 1), so the limit is that times chi2's 0.999 quantile. A demo of 60 rows is
not flagged for noise; a corpus of thousands is held to 0.25.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from scipy.stats import chi2

from assets.suite_runner import ExpectationOutcome

ASPECT_EDGES = (1.0, 1.1, 1.25, 1.4, 1.6, 1.8, 2.0, 2.5, 3.0)  # the last bin is open: 3 and wider
CAPTION_EDGES = (0, 20, 40, 60, 80, 100, 150, 200, 300, 500, 1000)  # characters; 1000 and longer
PSI_LIMIT = 0.25
NOISE_QUANTILE = 0.999  # two samples of one distribution exceed the noise limit once in a thousand
EXPECTATION = "expect_column_distribution_to_match_previous_version"
MEASURES = {
    "aspect": ("aspect", ASPECT_EDGES),
    "caption_length": ("caption", CAPTION_EDGES),
}  # measure -> (column it reads, bin edges)


def _aspects(table: pa.Table) -> np.ndarray | None:
    if "aspect" in table.column_names:
        return np.asarray(table.column("aspect"), np.float64)
    if {"width", "height"} <= set(table.column_names):  # a train set: the bucket's sides
        w, h = np.asarray(table.column("width"), np.float64), np.asarray(table.column("height"), np.float64)
        return np.maximum(w, h) / np.maximum(np.minimum(w, h), 1)
    return None


def _caption_lengths(table: pa.Table) -> np.ndarray | None:
    if "caption" not in table.column_names:
        return None
    return np.asarray(pc.fill_null(pc.utf8_length(table.column("caption")), 0), np.float64)


def histogram(values: np.ndarray, edges: tuple[float, ...]) -> list[int]:
    """Counts per bin [edges[i], edges[i+1]), the last bin open-ended; values under the first edge count in the first."""
    idx = np.clip(np.searchsorted(np.asarray(edges, np.float64), values, side="right") - 1, 0, len(edges) - 1)
    return np.bincount(idx, minlength=len(edges)).astype(int).tolist()


def profile(table: pa.Table) -> dict:
    """{"rows": n, "aspect": counts, "caption_length": counts}, with only the measures the table has columns for."""
    out: dict = {"rows": table.num_rows}
    for measure, values in (("aspect", _aspects(table)), ("caption_length", _caption_lengths(table))):
        if values is not None:
            out[measure] = histogram(values, MEASURES[measure][1])
    return out


def psi(current: list[int], previous: list[int]) -> tuple[float, float]:
    """(PSI, the limit it is held to) of two count vectors over the same bins; bins empty in both are left out."""
    pairs = [(c, p) for c, p in zip(current, previous) if c or p]
    n, m, k = sum(c for c, _ in pairs), sum(p for _, p in pairs), len(pairs)
    value = 0.0
    for c, p in pairs:
        a, b = (c + 0.5) / (n + 0.5 * k), (p + 0.5) / (m + 0.5 * k)
        value += (a - b) * math.log(a / b)
    return value, max(PSI_LIMIT, (1 / n + 1 / m) * float(chi2.ppf(NOISE_QUANTILE, max(k - 1, 1))))


def drift_outcomes(current: dict, previous: dict | None) -> list[ExpectationOutcome]:
    """One outcome per measure the current profile has: within its limit of the previous version, or a first version."""
    out = []
    for measure, (column, _) in MEASURES.items():
        if measure not in current:
            continue
        if previous is None or measure not in previous or not previous["rows"] or not current["rows"]:
            out.append(
                ExpectationOutcome(
                    EXPECTATION,
                    column,
                    True,
                    f"{measure}: no previous version to compare with; this one is the reference",
                )
            )
            continue
        value, limit = psi(current[measure], previous[measure])
        out.append(
            ExpectationOutcome(
                EXPECTATION,
                column,
                value <= limit,
                f"{measure}: PSI {value:.3f} against the previous version ({previous['rows']} rows), limit {limit:.3f}",
            )
        )
    return out


def store_path(folder: Path) -> Path:
    """Where a stage output folder's profiles live: beside it, under the data root's .profiles/."""
    folder = Path(folder)
    return folder.parent / ".profiles" / f"{folder.name}.json"


def _version(table: pa.Table, prof: dict) -> str:
    ids = sorted(table.column("id").to_pylist()) if "id" in table.column_names else []
    return hashlib.sha1(("\n".join(ids) + json.dumps(prof, sort_keys=True)).encode()).hexdigest()


def check_against_previous(folder: Path, table: pa.Table) -> list[ExpectationOutcome]:
    """Compare a folder's kept rows with its previous version and record this version in the store."""
    prof = profile(table)
    if len(prof) == 1:  # neither measure applies
        return []
    path = store_path(folder)
    store = json.loads(path.read_text()) if path.is_file() else {}
    version, current = _version(table, prof), store.get("current")
    if current and current["version"] == version:
        reference = (store.get("previous") or {}).get("profile")
    else:
        reference = current["profile"] if current else None
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(
            json.dumps(
                {"current": {"version": version, "profile": prof}, "previous": current}, indent=1, sort_keys=True
            )
            + "\n"
        )
        tmp.replace(path)
    return drift_outcomes(prof, reference)
