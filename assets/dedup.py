"""The dedup stage: FILTERED -> DEDUPED over all rows at once; exact by md5, then near by pHash + colour.

Near-duplicate search never compares all pairs. The 144 pHash bits (in a fixed, seeded order that
mixes frequencies) are split into `bands` bands. By the generalised pigeonhole principle, two hashes
within `phash_radius` = r differ in at most s = r // bands bits in at least one band, because
bands * (s + 1) > r. Each band is indexed once (counting sort over its key); every hash probes its own
key and each key within s bit flips of it, so every pair within the radius becomes a candidate
(recall 1.0 by construction). Candidates are verified by exact Hamming distance on uint64 words,
pHash AND colour hash, and the verified pairs joined into groups by connected components.

With `mirror`, every hash also probes with its mirrored pHash (`assets.hashes.mirror_phash`, a fixed
bit mask), so a left-right flipped copy is found too; the distance of a pair is then the smaller of
d(a, b) and d(mirror(a), b) (= d(a, mirror(b))), and the same pigeonhole argument keeps the search exact.

Each group keeps one row: the largest width * height, then the largest file, then the smallest id. Every other member is
rejected with the keeper's id as detail and its pHash distance to the keeper as value: EXACT_DUPLICATE when it is a
byte copy of the keeper (the same md5), NEAR_DUPLICATE otherwise. So all copies of one file get one reason: when a
larger picture outranks them, every copy is a near duplicate of it, none an "exact" duplicate of other bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

import numpy as np
import pyarrow as pa
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from assets.hashes import COLOR_BYTES, PHASH_BYTES, hamming_rows, mirror_phash, to_words
from kiln.config import KilnConfig
from kiln.reasons import Reason
from kiln.schemas import DEDUPED, FILTERED
from kiln.stage import Rejects, Stage, StageOutput

PHASH_BITS = PHASH_BYTES * 8
BAND_SEED = 0  # the bit order of the bands; fixed so candidate sets (and timings) reproduce
DENSE_KEY_BITS = 24  # bands up to this many bits are indexed with a dense counting table
MAX_PAIRS_PER_CHUNK = 4_000_000  # bounds memory on skewed data: candidates are expanded in chunks


# ------------------------------------------------------------------------------------------ bands
def band_bits(bands: int, n_bits: int = PHASH_BITS, seed: int = BAND_SEED) -> list[np.ndarray]:
    """Bit positions of each band: a seeded permutation cut into `bands` near-equal parts."""
    if not 1 <= bands <= n_bits:
        raise ValueError(f"bands must be in 1..{n_bits}, got {bands}")
    return np.array_split(np.random.default_rng(seed).permutation(n_bits), bands)


def band_keys(bits: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """(n, n_bits) 0/1 array -> one int64 key per row from the bits at `positions`."""
    weights = np.left_shift(np.int64(1), np.arange(len(positions), dtype=np.int64))
    return bits[:, positions].astype(np.int64) @ weights


def flip_masks(n_bits: int, max_flips: int) -> np.ndarray:
    """Every mask of weight <= max_flips over n_bits bits (0 first)."""
    masks = [0]
    for w in range(1, max_flips + 1):
        masks.extend(sum(1 << b for b in c) for c in combinations(range(n_bits), w))
    return np.array(masks, dtype=np.int64)


@dataclass
class BandIndex:
    """Rows grouped by band key: `order[start[k] : start[k] + count[k]]` are the rows with key k."""

    order: np.ndarray
    keys: np.ndarray  # distinct keys, sorted (sparse tables only)
    start: np.ndarray
    count: np.ndarray
    dense: bool

    @classmethod
    def build(cls, keys: np.ndarray, key_bits: int) -> "BandIndex":
        order = np.argsort(keys, kind="stable")
        if key_bits <= DENSE_KEY_BITS:
            count = np.bincount(keys, minlength=1 << key_bits)
            start = np.concatenate([[0], np.cumsum(count)[:-1]])
            return cls(order, np.empty(0, np.int64), start, count, True)
        distinct, first, count = np.unique(keys[order], return_index=True, return_counts=True)
        return cls(order, distinct, first, count, False)

    def lookup(self, probes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(start, count) of each probe key; count 0 where no row has it."""
        if self.dense:
            return self.start[probes], self.count[probes]
        pos = np.minimum(np.searchsorted(self.keys, probes), max(len(self.keys) - 1, 0))
        hit = self.keys[pos] == probes if len(self.keys) else np.zeros(len(probes), bool)
        return self.start[pos], np.where(hit, self.count[pos], 0)


def _expand(
    query: np.ndarray, start: np.ndarray, count: np.ndarray, order: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Ragged join: each query row against the `count` rows of its bucket."""
    total = int(count.sum())
    q = np.repeat(query, count)
    offsets = np.arange(total) - np.repeat(np.cumsum(count) - count, count)
    return q, order[np.repeat(start, count) + offsets]


def _chunks(count: np.ndarray, cap: int) -> list[slice]:
    """Cut query rows into runs whose candidate counts sum to about `cap` (a heavier single row stands alone)."""
    csum = np.cumsum(count)
    if not len(csum) or csum[-1] <= cap:
        return [slice(0, len(count))]
    cuts = np.searchsorted(csum, np.arange(cap, int(csum[-1]), cap)) + 1
    bounds = np.unique(np.concatenate([[0], cuts, [len(count)]]).clip(0, len(count)))
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def near_pairs(
    phash: np.ndarray, color: np.ndarray, phash_radius: int, color_radius: int, bands: int, mirror: bool = False
) -> np.ndarray:
    """All index pairs (i < j) within both radii, as a sorted unique (k, 2) int64 array.

    phash: (n, 18) uint8, color: (n, 8) uint8. Exact: every pair within the radii is returned. With
    `mirror`, so is every pair with d(mirror(phash[i]), phash[j]) within the radius (a flipped copy).
    """
    n = len(phash)
    if n < 2:
        return np.empty((0, 2), np.int64)
    phash = phash.reshape(n, PHASH_BYTES)
    pw, cw = to_words(phash, PHASH_BYTES), to_words(color, COLOR_BYTES)
    bits = np.unpackbits(phash, axis=1)
    queries = [(bits, pw)]  # (query bits, query words): the hashes themselves, then their mirrors
    if mirror:
        mirrored = mirror_phash(phash)
        queries.append((np.unpackbits(mirrored, axis=1), to_words(mirrored, PHASH_BYTES)))
    flips_per_band = phash_radius // bands
    found: list[np.ndarray] = []
    rows = np.arange(n, dtype=np.int64)
    for positions in band_bits(bands):
        index = BandIndex.build(band_keys(bits, positions), len(positions))
        for qbits, qw in queries:
            keys = band_keys(qbits, positions)
            for mask in flip_masks(len(positions), flips_per_band):
                start, count = index.lookup(keys ^ mask)
                for part in _chunks(count, MAX_PAIRS_PER_CHUNK):
                    i, j = _expand(rows[part], start[part], count[part], index.order)
                    keep = i < j  # d(mirror(a), b) = d(a, mirror(b)): each unordered pair is found from both ends
                    i, j = i[keep], j[keep]
                    ok = np.bitwise_count(cw[i, 0] ^ cw[j, 0]) <= color_radius  # one word: the cheap test first
                    i, j = i[ok], j[ok]
                    ok = hamming_rows(qw[i], pw[j]) <= phash_radius
                    if ok.any():
                        found.append(i[ok] * n + j[ok])
    codes = np.unique(np.concatenate(found)) if found else np.empty(0, np.int64)
    return np.stack([codes // n, codes % n], axis=1)


def components(n: int, pairs: np.ndarray) -> np.ndarray:
    """Connected-component label of each of n rows given undirected edges (union-find in C, via scipy)."""
    if not len(pairs):
        return np.arange(n)
    graph = coo_matrix((np.ones(len(pairs), np.int8), (pairs[:, 0], pairs[:, 1])), shape=(n, n))
    return connected_components(graph, directed=False)[1]


def keepers(labels: np.ndarray, pixels: np.ndarray, sizes: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """For each row, the row index of its group's keeper: largest pixels, then largest file, then smallest id.

    The file size breaks ties between same-size copies in favour of the least compressed one.
    labels: non-negative group labels; ids: a numpy string array.
    """
    order = np.lexsort((ids, -sizes, -pixels, labels))
    first = np.ones(len(order), bool)
    first[1:] = labels[order][1:] != labels[order][:-1]
    keeper_of_label = np.full(int(labels.max()) + 1 if len(labels) else 0, -1, np.int64)
    keeper_of_label[labels[order][first]] = order[first]
    return keeper_of_label[labels]


# ------------------------------------------------------------------------------------------- stage
@dataclass(frozen=True)
class Groups:
    keeper: np.ndarray  # row index of each row's keeper (itself for kept rows)
    exact: np.ndarray  # bool: a byte copy of its keeper (the same md5), not the keeper itself
    distance: np.ndarray  # pHash distance to the keeper (to its mirror when that is nearer and mirror is on)


def find_groups(table: pa.Table, phash_radius: int, color_radius: int, bands: int, mirror: bool = False) -> Groups:
    n = table.num_rows
    ids = np.array(table.column("id").to_pylist(), dtype=str)
    pixels = np.asarray(table.column("width"), np.int64) * np.asarray(table.column("height"), np.int64)
    md5_class = np.unique(np.array(table.column("md5").to_pylist(), dtype=str), return_inverse=True)[1]
    sizes = np.asarray(table.column("bytes"), np.int64)
    rep = keepers(md5_class, pixels, sizes, ids)
    reps = np.flatnonzero(rep == np.arange(n))
    phash = np.frombuffer(b"".join(table.column("phash").to_pylist()), np.uint8).reshape(n, PHASH_BYTES)
    color = np.frombuffer(b"".join(table.column("colorhash").to_pylist()), np.uint8).reshape(n, COLOR_BYTES)
    pairs = near_pairs(phash[reps], color[reps], phash_radius, color_radius, bands, mirror)
    rep_label = np.empty(n, np.int64)
    rep_label[reps] = components(len(reps), pairs)
    label = rep_label[rep]
    keeper = keepers(label, pixels, sizes, ids)
    pw = to_words(phash, PHASH_BYTES)
    distance = hamming_rows(pw, pw[keeper])
    if mirror:
        distance = np.minimum(distance, hamming_rows(to_words(mirror_phash(phash), PHASH_BYTES), pw[keeper]))
    return Groups(keeper, (md5_class == md5_class[keeper]) & (keeper != np.arange(n)), distance)


def dedup(table: pa.Table, cfg: KilnConfig) -> StageOutput:
    d = cfg.data.dedup
    rejects = Rejects("dedup")
    if table.num_rows == 0:
        return StageOutput(DEDUPED.empty_table(), rejects.table())
    g = find_groups(table, d.phash_radius, d.color_radius, d.bands, d.mirror)
    ids, uris = table.column("id").to_pylist(), table.column("uri").to_pylist()
    kept_rows = np.flatnonzero(g.keeper == np.arange(table.num_rows))
    for r in np.flatnonzero(g.keeper != np.arange(table.num_rows)):
        reason = Reason.EXACT_DUPLICATE if g.exact[r] else Reason.NEAR_DUPLICATE
        rejects.add(ids[r], uris[r], reason, float(g.distance[r]), ids[g.keeper[r]])
    kept = table.take(pa.array(kept_rows)).append_column(
        "dup_group", pa.array([ids[r] for r in kept_rows], pa.string())
    )
    return StageOutput(kept, rejects.table())


# ------------------------------------------------------------------------------------------ groups
GROUPS = pa.schema(
    [
        pa.field("dup_group", pa.string(), nullable=False),
        pa.field("id", pa.string(), nullable=False),
        pa.field("uri", pa.string(), nullable=False),
        pa.field("role", pa.string(), nullable=False),  # keeper / exact_duplicate / near_duplicate
        pa.field("phash_distance", pa.float64()),
    ]
)


def groups_table(kept: pa.Table, rejected: pa.Table) -> pa.Table:
    """Duplicate groups of two or more members, keeper first, from the dedup stage's kept + rejected rows."""
    dup_reasons = {Reason.EXACT_DUPLICATE.value, Reason.NEAR_DUPLICATE.value}
    members = [
        (detail, id, uri, reason, value)
        for id, uri, reason, value, detail in zip(
            *(rejected.column(c).to_pylist() for c in ("id", "uri", "reason", "value", "detail"))
        )
        if reason in dup_reasons
    ]
    grouped = {m[0] for m in members}
    keeper_rows = [
        (g, id, uri, "keeper", 0.0)
        for g, id, uri in zip(*(kept.column(c).to_pylist() for c in ("dup_group", "id", "uri")))
        if g in grouped
    ]
    rows = sorted(keeper_rows + members, key=lambda r: (r[0], r[3] != "keeper", r[1]))
    return pa.table(
        {name: list(col) for name, col in zip(GROUPS.names, zip(*rows))} if rows else {n: [] for n in GROUPS.names},
        schema=GROUPS,
    )


STAGE = Stage(name="dedup", fn=dedup, input_schema=FILTERED, output_schema=DEDUPED, scope="global")
