"""k-means stops at convergence: the cluster stage's k-means (assets.cluster.kmeans) does not spend its
whole iteration budget once the objective has settled, and stopping changes nothing that matters.

- tol=0 stops only at a fixed point, so a larger iteration budget gives the very same clusters;
- a positive tol stops earlier, and the objective it reaches is within a hair of the fixed point's;
- either way the same seed gives the same clusters, and the stage passes data.clustering.kmeans_tol through.
"""

from __future__ import annotations

import numpy as np
import pytest

from assets.cluster import kmeans
from kiln.config import load_config


def blobs(n: int = 3000, dim: int = 32, centres: int = 12, seed: int = 0) -> np.ndarray:
    """Unit vectors around a few random directions: embeddings with a cluster structure."""
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((centres, dim)).astype(np.float32)
    x = c[rng.integers(0, centres, n)] + 0.8 * rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def mean_cosine(x: np.ndarray, centroids: np.ndarray) -> float:
    """The spherical k-means objective: each row's cosine to its nearest (unit) centroid, averaged."""
    c = centroids / np.linalg.norm(centroids, axis=1, keepdims=True)
    return float((x @ c.T).max(axis=1).mean())


def test_at_a_fixed_point_more_iterations_change_nothing():
    x = blobs()
    c25, lab25 = kmeans(x, 24, niter=25, seed=3, tol=0.0)
    c500, lab500 = kmeans(x, 24, niter=500, seed=3, tol=0.0)
    assert np.array_equal(lab25, lab500) and np.array_equal(c25, c500)


def test_a_tolerance_stops_early_at_nearly_the_same_objective():
    x = blobs()
    exact = mean_cosine(x, kmeans(x, 24, niter=25, seed=3, tol=0.0)[0])
    one_step = mean_cosine(x, kmeans(x, 24, niter=1, seed=3, tol=0.0)[0])
    early = mean_cosine(x, kmeans(x, 24, niter=25, seed=3, tol=1e-4)[0])
    loose = mean_cosine(x, kmeans(x, 24, niter=25, seed=3, tol=0.1)[0])
    assert one_step < exact - 1e-3  # the data needs several iterations: stopping at once would show
    assert one_step < loose < exact - 1e-4  # a tolerance of 10% stops after a few iterations, far from the fixed point
    assert early == pytest.approx(exact, rel=1e-3)


def test_the_same_seed_gives_the_same_clusters_with_a_tolerance():
    x = blobs(seed=1)
    a = kmeans(x, 16, niter=25, seed=5, tol=1e-4)
    b = kmeans(x, 16, niter=25, seed=5, tol=1e-4)
    assert np.array_equal(a[1], b[1]) and np.array_equal(a[0], b[0])


def test_the_tolerance_is_a_bounded_setting():
    assert load_config([]).data.clustering.kmeans_tol == 1e-4
    with pytest.raises(ValueError):
        load_config(["data.clustering.kmeans_tol=0.5"])
