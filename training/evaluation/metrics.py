"""Distribution metrics between generated and reference image features: FID, CMMD, DINO-MMD.

Pure functions over feature matrices ([N, D] float arrays); the extractors live in training.evaluation.extractors.

  FID       Fréchet distance between Gaussians fitted to the two feature sets (Heusel et al. 2017).
            The trace of sqrt(S1 S2) is computed from the eigenvalues of sqrt(S1) S2 sqrt(S1), which is
            symmetric PSD: no complex square roots, no singular-product retries (pytorch-fid uses
            scipy.linalg.sqrtm; the tests check this against that computation).
  CMMD      the published definition (Jayasumana et al. 2024, google-research/cmmd): squared MMD with
            an RBF kernel, sigma = 10, scaled by 1000, the biased estimator (all pairs, diagonal
            included), on L2-normalised CLIP image embeddings.
  DINO-MMD  the same MMD on L2-normalised DINOv2 features (PRX's third metric).
"""

from __future__ import annotations

import numpy as np

CMMD_SIGMA = 10.0
CMMD_SCALE = 1000.0


def gaussian_stats(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and unbiased covariance (rowvar=False), in float64 as FID needs."""
    f = np.asarray(features, dtype=np.float64)
    if f.ndim != 2 or f.shape[0] < 2:
        raise ValueError(f"need [N >= 2, D] features, got shape {f.shape}")
    return f.mean(axis=0), np.cov(f, rowvar=False)


def _psd_sqrt(m: np.ndarray) -> np.ndarray:
    w, v = np.linalg.eigh((m + m.T) / 2)
    return (v * np.sqrt(np.clip(w, 0, None))) @ v.T


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray) -> float:
    """||mu1 - mu2||^2 + Tr(S1 + S2 - 2 sqrt(S1 S2)) for covariance (PSD) matrices."""
    mu1, mu2 = np.atleast_1d(np.asarray(mu1, np.float64)), np.atleast_1d(np.asarray(mu2, np.float64))
    s1, s2 = np.atleast_2d(np.asarray(sigma1, np.float64)), np.atleast_2d(np.asarray(sigma2, np.float64))
    if mu1.shape != mu2.shape or s1.shape != s2.shape:
        raise ValueError(f"mismatched shapes: mu {mu1.shape} vs {mu2.shape}, sigma {s1.shape} vs {s2.shape}")
    root1 = _psd_sqrt(s1)
    inner = root1 @ s2 @ root1
    tr_covmean = float(np.sqrt(np.clip(np.linalg.eigvalsh((inner + inner.T) / 2), 0, None)).sum())
    diff = mu1 - mu2
    return float(diff @ diff + np.trace(s1) + np.trace(s2) - 2 * tr_covmean)


def fid(generated: np.ndarray, reference: np.ndarray) -> float:
    """FID between two feature sets (whatever extractor produced them: say which next to the number)."""
    return frechet_distance(*gaussian_stats(generated), *gaussian_stats(reference))


def l2_normalise(features: np.ndarray) -> np.ndarray:
    f = np.asarray(features, dtype=np.float64)
    return f / np.maximum(np.linalg.norm(f, axis=-1, keepdims=True), 1e-12)


def _sq_dists(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.clip((a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2 * a @ b.T, 0, None)


def mmd(x: np.ndarray, y: np.ndarray, sigma: float = CMMD_SIGMA, scale: float = CMMD_SCALE) -> float:
    """Biased squared MMD with k(a, b) = exp(-||a - b||^2 / (2 sigma^2)), times `scale`.

    Biased: the means run over all pairs, i == j included, exactly as google-research/cmmd does, so
    identical sets give 0 and the value never goes negative.
    """
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"need [N, D] and [M, D] features, got {x.shape} and {y.shape}")
    gamma = 1.0 / (2 * sigma**2)
    k_xx = np.exp(-gamma * _sq_dists(x, x)).mean()
    k_yy = np.exp(-gamma * _sq_dists(y, y)).mean()
    k_xy = np.exp(-gamma * _sq_dists(x, y)).mean()
    return float(scale * (k_xx + k_yy - 2 * k_xy))


def cmmd(generated_clip: np.ndarray, reference_clip: np.ndarray) -> float:
    """CMMD on CLIP image embeddings (normalised here, so raw projections are fine too)."""
    return mmd(l2_normalise(generated_clip), l2_normalise(reference_clip))


def dino_mmd(generated_dino: np.ndarray, reference_dino: np.ndarray) -> float:
    """The CMMD estimator (sigma 10, scale 1000) on L2-normalised DINOv2 features."""
    return mmd(l2_normalise(generated_dino), l2_normalise(reference_dino))
