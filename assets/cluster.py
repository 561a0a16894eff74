"""The cluster stage: EMBEDDED -> CLUSTERED; hierarchical k-means (FAISS), named clusters, human review.

Hierarchy, top-down: k-means on all rows gives `levels[0]` clusters, each is split by k-means into
its share of `levels[1]`, and so on; the last level holds the leaf clusters. Every cluster nests
inside one parent, so `balanced_sample` can draw evenly across clusters level by level (the balanced
sampling of Vo et al. 2024, which the Krea 2 report's curation follows). Top-down rather than their
bottom-up build because on the demo it keeps the top level aligned with the scene families
(docs/curation-models.md has the figures).

Each cluster is named by a `Namer` from the rows nearest its centroid (captions for the demo; a VLM
elsewhere). Clusters of the review level that are flagged (all, or outliers: small or loose ones)
are written to a review table in DuckDB (`cluster_review`), where a person marks each one approve or
reject, from `kiln review` (assets/cluster_review.py, which holds the table) or by editing it. The stage honours those decisions on its next
run: every row of a rejected cluster is rejected with `cluster_rejected`, so it disappears from the
next training set with the reason recorded. A decision sticks to the cluster whose centroid it was
made on (cosine >= assets.cluster_review.CENTROID_MATCH); when re-clustering moves a centroid, the cluster goes back to
pending instead of silently inheriting a verdict about other images.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import pyarrow as pa

from assets.cluster_review import sync_review
from assets.embed import matrix
from kiln.config import ClusteringConfig, KilnConfig
from kiln.reasons import Reason
from kiln.schemas import CLUSTERED, EMBEDDED
from kiln.stage import Rejects, Stage, StageOutput
from model.image_encoders import l2_normalise


# ----------------------------------------------------------------------------------------- k-means
def kmeans(
    x: np.ndarray,
    k: int,
    niter: int,
    seed: int,
    weights: np.ndarray | None = None,
    threads: int = 1,
    nredo: int = 5,
    tol: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Spherical FAISS k-means: (centroids (k, d), label of each row). k is capped at the row count.

    Each of the `nredo` restarts stops before `niter` iterations once the objective changes by less than
    `tol` (relative) from one iteration to the next; `tol=0` stops only at a fixed point, where further
    iterations would change nothing (benchmarks/bench_kmeans.py measures the trade)."""
    import faiss

    faiss.omp_set_num_threads(threads)
    x = np.ascontiguousarray(x, np.float32)
    k = max(1, min(k, len(x)))
    km = faiss.Kmeans(
        x.shape[1],
        k,
        niter=niter,
        nredo=nredo,
        seed=seed,
        spherical=True,
        verbose=False,
        min_points_per_centroid=1,
        max_points_per_centroid=1 << 30,
    )
    if hasattr(km.cp, "early_stop_threshold"):
        km.cp.early_stop_threshold = tol
    elif tol > 0:
        raise RuntimeError(
            f"k-means tol={tol} needs FAISS's early stop (faiss-cpu 1.15 has it, this is {faiss.__version__}); set data.clustering.kmeans_tol=0"
        )
    km.train(x, weights=None if weights is None else np.ascontiguousarray(weights, np.float32))
    _, labels = km.index.search(x, 1)
    return km.centroids, labels[:, 0].astype(np.int64)


def canonical(labels: np.ndarray) -> np.ndarray:
    """Renumber labels 0.. in order of each cluster's first row, dropping empty ones: stable ids."""
    _, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
    rank = np.empty(len(first), np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    return rank[inverse]


def hierarchical_kmeans(
    x: np.ndarray, levels: list[int], niter: int = 25, seed: int = 0, threads: int = 1, tol: float = 0.0
) -> list[np.ndarray]:
    """One label array per level, coarse to fine; each finer cluster lies inside one coarser cluster.

    Top-down: k-means with levels[0] clusters over all rows, then each cluster is split again, into
    a share of the next level's clusters proportional to its size (at least one)."""
    x = l2_normalise(x)
    _, top = kmeans(x, levels[0], niter, seed, threads=threads, tol=tol)
    out = [canonical(top)]
    for k in levels[1:]:
        parent = out[-1]
        child = np.zeros(len(x), np.int64)
        base = 0
        for p in range(int(parent.max()) + 1):
            rows = np.flatnonzero(parent == p)
            k_p = max(1, min(len(rows), int(round(k * len(rows) / len(x)))))
            _, lab = (
                kmeans(x[rows], k_p, niter, seed, threads=threads, tol=tol)
                if k_p > 1
                else (None, np.zeros(len(rows), np.int64))
            )
            child[rows] = base + canonical(lab)
            base = int(child[rows].max()) + 1
        out.append(canonical(child))
    return out


# ------------------------------------------------------------------------------------------ namers
@runtime_checkable
class Namer(Protocol):
    name: str

    def name_cluster(self, rows: pa.Table) -> str:
        """A short human name for a cluster, from the rows nearest its centroid."""
        ...


STOPWORDS = frozenset(
    ["a", "an", "the", "on", "in", "at", "of", "and", "with", "to", "is", "two", "three", "background"]
)


class CaptionNamer:
    """Names a cluster by the words most shared by descriptions of its nearest rows: the configured
    captioner's captions (the demo's namer), or a VLM's short answers to a naming prompt (`vlm`)."""

    def __init__(self, captioner, words: int = 4, name: str | None = None):
        self.captioner = captioner
        self.name = name or f"captions:{captioner.name}"
        self.words = words

    def name_cluster(self, rows: pa.Table) -> str:
        captions = [c for c in self.captioner.caption(rows) if c]
        if not captions:
            return "(no captions)"
        counts = Counter(
            w for c in captions for w in sorted(set(c.lower().replace(",", " ").split())) if w not in STOPWORDS
        )
        top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: self.words]
        return " ".join(w for w, _ in top)


def make_namer(cfg: KilnConfig) -> Namer:
    c = cfg.data.clustering
    if c.namer == "captions":
        from assets.caption import make_captioner

        return CaptionNamer(make_captioner(cfg.data.caption))
    if c.namer == "vlm":
        from components.vlm import GenerationSettings, VLMCaptioner

        if not c.namer_vlm_path:
            raise ValueError(
                "data.clustering.namer=vlm needs data.clustering.namer_vlm_path (a local model + processor folder)"
            )
        asker = VLMCaptioner(
            c.namer_vlm_path, c.namer_prompt, batch_size=c.name_n, settings=GenerationSettings(max_new_tokens=12)
        )
        return CaptionNamer(asker, name=f"vlm:{c.namer_vlm_path}")
    raise ValueError(f"unknown namer {c.namer!r}")


# --------------------------------------------------------------------------------------- summaries
@dataclass(frozen=True)
class ClusterInfo:
    level: int
    cluster: int
    size: int
    cohesion: float  # mean cosine of members to the centroid
    centroid: np.ndarray
    nearest: list[str]  # ids nearest the centroid, nearest first
    name: str = ""
    flag_reason: str = ""


def summarise(x: np.ndarray, ids: list[str], labels: np.ndarray, level: int, n_nearest: int) -> list[ClusterInfo]:
    out = []
    for c in range(int(labels.max()) + 1 if len(labels) else 0):
        members = np.flatnonzero(labels == c)
        cent = l2_normalise(x[members].mean(0))
        cos = x[members] @ cent
        order = np.lexsort((np.array([ids[m] for m in members]), -cos))[:n_nearest]
        out.append(ClusterInfo(level, c, len(members), float(cos.mean()), cent, [ids[members[o]] for o in order]))
    return out


def flag_reason(info: ClusterInfo, cfg: ClusteringConfig) -> str:
    if cfg.flag == "all":
        return "review all"
    if info.size < cfg.flag_min_size:
        return f"small: {info.size} < {cfg.flag_min_size}"
    if info.cohesion < cfg.flag_max_cohesion:
        return f"loose: cohesion {info.cohesion:.3f} < {cfg.flag_max_cohesion}"
    return ""


# ------------------------------------------------------------------------------------------- stage
def cluster_rows(
    table: pa.Table, cfg: KilnConfig, namer: Namer | None = None, stage: str = "cluster"
) -> tuple[StageOutput, list[list[ClusterInfo]]]:
    """Cluster, name, sync the review table, reject rows of rejected clusters. Also returns the summaries."""
    c = cfg.data.clustering
    if c.review_level >= len(c.levels):
        raise ValueError(f"data.clustering.review_level={c.review_level} but there are {len(c.levels)} levels")
    rejects = Rejects(stage)
    if table.num_rows == 0:
        return StageOutput(CLUSTERED.empty_table(), rejects.table()), []
    x = matrix(table)
    ids, uris = table.column("id").to_pylist(), table.column("uri").to_pylist()
    labels = hierarchical_kmeans(x, c.levels, c.niter, c.seed, c.threads, c.kmeans_tol)
    namer = namer or make_namer(cfg)
    row_of = {id_: i for i, id_ in enumerate(ids)}
    summaries = []
    for level, lab in enumerate(labels):
        infos = summarise(x, ids, lab, level, c.name_n)
        infos = [
            ClusterInfo(
                **{
                    **i.__dict__,
                    "name": namer.name_cluster(table.take(pa.array([row_of[n] for n in i.nearest]))),
                    "flag_reason": flag_reason(i, c) if level == c.review_level else "",
                }
            )
            for i in infos
        ]
        summaries.append(infos)
    decisions = sync_review(c.review_db, summaries[c.review_level])
    review_lab = labels[c.review_level]
    keep = []
    for r in range(table.num_rows):
        decision, name = decisions.get(int(review_lab[r]), ("", ""))
        if decision == "reject":
            rejects.add(
                ids[r],
                uris[r],
                Reason.CLUSTER_REJECTED,
                float(review_lab[r]),
                f"level {c.review_level} cluster {review_lab[r]}: {name}",
            )
        else:
            keep.append(r)
    leaf = labels[-1]
    leaf_cent = l2_normalise(np.stack([x[leaf == k].mean(0) for k in range(int(leaf.max()) + 1)]))
    path = [".".join(str(int(lab[r])) for lab in labels) for r in range(table.num_rows)]
    cos = np.einsum("nd,nd->n", x, leaf_cent[leaf])
    kept = table.take(pa.array(keep, pa.int64()))
    idx = np.array(keep, np.int64)
    kept = kept.append_column(
        pa.field("cluster_path", pa.string(), nullable=False), pa.array([path[i] for i in keep], pa.string())
    )
    kept = kept.append_column(
        pa.field("leaf", pa.int32(), nullable=False), pa.array(leaf[idx].astype(np.int32), pa.int32())
    )
    kept = kept.append_column(
        pa.field("leaf_cosine", pa.float32(), nullable=False), pa.array(cos[idx].astype(np.float32), pa.float32())
    )
    return StageOutput(kept, rejects.table()), summaries


def cluster_stage(table: pa.Table, cfg: KilnConfig) -> StageOutput:
    return cluster_rows(table, cfg)[0]


STAGE = Stage("cluster", cluster_stage, input_schema=EMBEDDED, output_schema=CLUSTERED, scope="global")


# --------------------------------------------------------------------------------- sampling, views
def level_labels(table: pa.Table, level: int) -> np.ndarray:
    return np.array([int(p.split(".")[level]) for p in table.column("cluster_path").to_pylist()], np.int64)


def _share(n: int, sizes: list[int]) -> list[int]:
    """Split n as evenly as possible across groups capped at their sizes (water filling)."""
    take = [0] * len(sizes)
    left = min(n, sum(sizes))
    while left:
        open_ = [i for i, s in enumerate(sizes) if take[i] < s]
        each = max(1, left // len(open_))
        for i in open_:
            step = min(each, sizes[i] - take[i], left)
            take[i] += step
            left -= step
            if not left:
                break
    return take


def balanced_sample(table: pa.Table, n: int, seed: int = 0) -> pa.Table:
    """n rows spread evenly over the clusters of every level in turn (a CLUSTERED table), deterministic."""
    import hashlib

    paths = [p.split(".") for p in table.column("cluster_path").to_pylist()]
    ids = table.column("id").to_pylist()
    key = [hashlib.sha1(f"{seed}:{i}".encode()).hexdigest() for i in ids]
    n_levels = len(paths[0]) if paths else 0

    def pick(rows: list[int], depth: int, k: int) -> list[int]:
        if depth == n_levels:
            return sorted(rows, key=lambda r: key[r])[:k]
        groups: dict[int, list[int]] = {}
        for r in rows:
            groups.setdefault(int(paths[r][depth]), []).append(r)
        order = sorted(groups)
        shares = _share(k, [len(groups[g]) for g in order])
        return [r for g, s in zip(order, shares) for r in pick(groups[g], depth + 1, s)]

    chosen = sorted(pick(list(range(table.num_rows)), 0, n))
    return table.take(pa.array(chosen, pa.int64()))


def cluster_grid(table: pa.Table, level: int, cluster: int, n: int = 16, cell: int = 64, cols: int = 8):
    """The cluster's rows nearest its centroid as one image grid (for Dagster metadata and review)."""
    from kiln.imageio import open_rgb
    from kiln.uri import read_bytes
    from kiln.viz import image_grid

    members = np.flatnonzero(level_labels(table, level) == cluster)
    if not len(members):
        raise KeyError(f"no rows in level {level} cluster {cluster}")
    x = matrix(table.take(pa.array(members)))
    cos = x @ l2_normalise(x.mean(0))
    order = members[np.argsort(-cos, kind="stable")[:n]]
    uris = table.column("uri").to_pylist()
    return image_grid([open_rgb(read_bytes(uris[i])) for i in order], cols=min(cols, len(order)), cell=cell)


def purity(labels: np.ndarray, truth: list) -> float:
    """Share of rows whose cluster's majority truth label is their own."""
    truth = np.asarray(truth, dtype=object)
    return float(sum(Counter(truth[labels == c]).most_common(1)[0][1] for c in np.unique(labels)) / len(labels))
