"""The semdedup stage: CLUSTERED -> DEDUPED; semantic duplicates removed inside each leaf cluster.

Semantic duplicates (SemDeDup, Abbas et al. 2023) are images whose embeddings are nearly parallel
although their pixels differ too much for the hash dedup. Comparing only rows of the same leaf
cluster keeps the work near-linear: a leaf of m rows costs m^2 / 2 dot products. Rows at cosine
>= `data.clustering.semdedup_threshold` are linked, linked rows form groups (connected components),
and each group keeps one row, chosen as the hash dedup chooses (`assets.dedup.keepers`): the most
pixels, then the largest file, then the smallest id. Every other member is rejected with
`semantic_duplicate`, its cosine to the keeper as value and the keeper's id as detail.

The output has the DEDUPED schema (embedding and cluster columns dropped) so that the caption stage
takes it as it takes the hash dedup's output; cluster assignments stay in the cluster stage's output.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from assets.dedup import components, keepers
from assets.embed import matrix
from kiln.config import KilnConfig
from kiln.reasons import Reason
from kiln.schemas import CLUSTERED, DEDUPED
from kiln.stage import Rejects, Stage, StageOutput


def leaf_pairs(x: np.ndarray, leaf: np.ndarray, threshold: float) -> tuple[np.ndarray, int]:
    """Index pairs (i < j) of one leaf at cosine >= threshold, sorted; and the number of pairs compared."""
    found, compared = [], 0
    order = np.argsort(leaf, kind="stable")  # rows of a leaf in row order, one contiguous block
    xs = np.ascontiguousarray(x[order], np.float32)
    bounds = [0, *(np.flatnonzero(np.diff(leaf[order])) + 1).tolist(), len(order)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b - a < 2:
            continue
        block = xs[a:b]
        i, j = np.nonzero(np.triu(block @ block.T >= threshold, 1))
        compared += (b - a) * (b - a - 1) // 2
        if len(i):
            found.append(np.stack([order[a + i], order[a + j]], 1))
    pairs = np.sort(np.concatenate(found), axis=1) if found else np.empty((0, 2), np.int64)
    return pairs[np.lexsort((pairs[:, 1], pairs[:, 0]))] if len(pairs) else pairs, compared


def semdedup_rows(table: pa.Table, threshold: float, stage: str = "semdedup") -> StageOutput:
    rejects = Rejects(stage)
    n = table.num_rows
    if n == 0:
        return StageOutput(DEDUPED.empty_table(), rejects.table())
    x = matrix(table)
    leaf = np.asarray(table.column("leaf"), np.int64)
    pairs, _ = leaf_pairs(x, leaf, threshold)
    labels = components(n, pairs)
    ids = np.array(table.column("id").to_pylist(), dtype=str)
    pixels = np.asarray(table.column("width"), np.int64) * np.asarray(table.column("height"), np.int64)
    keeper = keepers(labels, pixels, np.asarray(table.column("bytes"), np.int64), ids)
    uris = table.column("uri").to_pylist()
    for r in np.flatnonzero(keeper != np.arange(n)):
        rejects.add(str(ids[r]), uris[r], Reason.SEMANTIC_DUPLICATE, float(x[r] @ x[keeper[r]]), str(ids[keeper[r]]))
    kept = table.take(pa.array(np.flatnonzero(keeper == np.arange(n)))).select(DEDUPED.names)
    return StageOutput(kept, rejects.table())


def semdedup_stage(table: pa.Table, cfg: KilnConfig) -> StageOutput:
    return semdedup_rows(table, cfg.data.clustering.semdedup_threshold)


STAGE = Stage("semdedup", semdedup_stage, input_schema=CLUSTERED, output_schema=DEDUPED, scope="global")
