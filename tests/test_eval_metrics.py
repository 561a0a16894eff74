"""FID, CMMD and DINO-MMD against independent reference computations, and the HF feature extractors.

References, written here independently of training.evaluation.metrics:
  * pytorch-fid's `calculate_frechet_distance` (pytorch_fid/fid_score.py, v0.3.0), transcribed: its
    module imports torchvision at the top, which this environment does not install, so it cannot be
    imported; it uses scipy.linalg.sqrtm where training.evaluation.metrics uses a symmetric eigendecomposition;
  * the closed form for diagonal covariances;
  * a naive double loop over all pairs for the biased RBF MMD (google-research/cmmd's estimator).
"""

import numpy as np
import pytest
import torch
from scipy import linalg

from training.evaluation.extractors import load_extractor, write_tiny_extractor
from training.evaluation.metrics import (
    CMMD_SCALE,
    CMMD_SIGMA,
    cmmd,
    dino_mmd,
    fid,
    frechet_distance,
    gaussian_stats,
    l2_normalise,
    mmd,
)


def pytorch_fid_frechet_distance(mu1, sigma1, mu2, sigma2, eps=1e-6):
    """pytorch-fid 0.3.0's calculate_frechet_distance, line for line (print and shape asserts removed)."""
    mu1, mu2 = np.atleast_1d(mu1), np.atleast_1d(mu2)
    sigma1, sigma2 = np.atleast_2d(sigma1), np.atleast_2d(sigma2)
    diff = mu1 - mu2
    covmean = linalg.sqrtm(sigma1.dot(sigma2))  # pytorch-fid passes disp=False (same matrix), deprecated in SciPy 1.17
    if not np.isfinite(covmean).all():
        offset = np.eye(sigma1.shape[0]) * eps
        covmean = linalg.sqrtm((sigma1 + offset).dot(sigma2 + offset))
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            raise ValueError(f"Imaginary component {np.max(np.abs(covmean.imag))}")
        covmean = covmean.real
    return diff.dot(diff) + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean)


def naive_mmd(x, y, sigma=CMMD_SIGMA, scale=CMMD_SCALE):
    """Biased MMD^2: mean of k over all pairs (i == j included), one pair at a time."""
    k = lambda a, b: np.exp(-np.sum((a - b) ** 2) / (2 * sigma**2))
    kxx = sum(k(a, b) for a in x for b in x) / len(x) ** 2
    kyy = sum(k(a, b) for a in y for b in y) / len(y) ** 2
    kxy = sum(k(a, b) for a in x for b in y) / (len(x) * len(y))
    return scale * (kxx + kyy - 2 * kxy)


def features(seed, n, d, shift=0.0, spread=1.0):
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((d, d)) / np.sqrt(d)  # correlated dimensions: a non-diagonal covariance
    return (rng.standard_normal((n, d)) @ mix) * spread + shift


@pytest.mark.parametrize(("n", "d", "shift", "spread"), [(200, 8, 0.5, 1.0), (300, 32, 0.0, 2.0), (120, 64, 1.0, 0.5)])
def test_frechet_distance_matches_pytorch_fids_computation(n, d, shift, spread):
    a, b = features(0, n, d), features(1, n + 17, d, shift, spread)
    ours = fid(a, b)
    ref = pytorch_fid_frechet_distance(*gaussian_stats(a), *gaussian_stats(b))
    assert ours == pytest.approx(ref, rel=1e-6, abs=1e-8)
    assert ours == pytest.approx(fid(b, a), rel=1e-9)  # symmetric


def test_frechet_distance_with_fewer_samples_than_dimensions_matches_pytorch_fid():
    """N < D, as on the demo: singular covariances, where sqrtm returns tiny imaginary parts."""
    a, b = features(2, 40, 64), features(3, 40, 64, shift=0.3)
    assert fid(a, b) == pytest.approx(pytorch_fid_frechet_distance(*gaussian_stats(a), *gaussian_stats(b)), rel=1e-5)


def test_frechet_distance_of_diagonal_gaussians_has_a_closed_form():
    mu1, mu2 = np.array([0.0, 1.0, -2.0]), np.array([1.0, 1.0, 0.0])
    v1, v2 = np.array([1.0, 4.0, 9.0]), np.array([4.0, 1.0, 9.0])
    expected = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(v1) - np.sqrt(v2)) ** 2)  # 5 + 1 + 1 + 0
    assert frechet_distance(mu1, np.diag(v1), mu2, np.diag(v2)) == pytest.approx(expected) == 7.0


def test_fid_of_a_set_with_itself_is_zero_and_a_shift_adds_its_squared_length():
    a = features(4, 150, 16)
    assert fid(a, a) == pytest.approx(0.0, abs=1e-8)
    assert fid(a, a + 0.5) == pytest.approx(16 * 0.25, rel=1e-8)


@pytest.mark.parametrize(("n", "m", "d", "shift"), [(20, 25, 4, 0.0), (15, 30, 8, 3.0), (10, 10, 3, 20.0)])
def test_mmd_matches_a_naive_loop_over_all_pairs(n, m, d, shift):
    x, y = features(5, n, d) * 5, features(6, m, d) * 5 + shift
    assert mmd(x, y) == pytest.approx(naive_mmd(x, y), rel=1e-9, abs=1e-12)
    assert mmd(x, y, sigma=1.5, scale=1.0) == pytest.approx(naive_mmd(x, y, sigma=1.5, scale=1.0), rel=1e-9, abs=1e-12)


def test_the_biased_mmd_is_zero_on_identical_sets_and_grows_with_the_gap():
    x = features(7, 30, 6) * 4
    assert mmd(x, x) == pytest.approx(0.0, abs=1e-9)
    gaps = [mmd(x, x + s) for s in (1.0, 5.0, 20.0)]
    assert 0 < gaps[0] < gaps[1] < gaps[2]


def test_cmmd_and_dino_mmd_are_the_mmd_of_l2_normalised_features():
    x, y = features(8, 25, 12), features(9, 20, 12, shift=0.4)
    expected = naive_mmd(l2_normalise(x), l2_normalise(y))
    assert cmmd(x, y) == pytest.approx(expected, rel=1e-9) and dino_mmd(x, y) == pytest.approx(expected, rel=1e-9)
    assert cmmd(3.0 * x, 0.1 * y) == pytest.approx(cmmd(x, y), rel=1e-9)  # only directions count
    assert np.allclose(np.linalg.norm(l2_normalise(x), axis=1), 1.0)


def test_metrics_refuse_mismatched_features():
    with pytest.raises(ValueError):
        mmd(np.zeros((4, 3)), np.zeros((4, 5)))
    with pytest.raises(ValueError):
        fid(np.zeros((1, 3)), np.zeros((4, 3)))


# ------------------------------------------------------------------------------------------ extractors
@pytest.fixture(scope="module")
def extractor_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("extractors")
    return {
        kind: write_tiny_extractor(kind, root / kind, seed=i) for i, kind in enumerate(("clip", "dino", "backbone"))
    }


def images(seed, n=6, size=32):
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


@pytest.mark.parametrize(
    ("kind", "model_type", "dim"),
    [("clip", "clip_vision_model", 16), ("dino", "dinov2", 32), ("backbone", "resnet", 32)],
)
def test_extractors_load_by_path_and_give_one_deterministic_vector_per_image(extractor_dirs, kind, model_type, dim):
    ex = load_extractor(kind, extractor_dirs[kind])
    assert ex.model_type == model_type and not ex.model.training
    imgs = images(0)
    feats = ex(imgs, batch_size=4)
    assert feats.shape == (6, dim) and feats.dtype == np.float32
    np.testing.assert_allclose(ex(imgs, batch_size=6), feats, atol=1e-5)  # batching does not change features
    assert np.array_equal(load_extractor(kind, extractor_dirs[kind])(imgs, batch_size=4), feats)  # reloaded: same bytes
    assert not np.allclose(feats[0], feats[1])  # different images, different features


def test_clip_features_are_the_projected_image_embeddings_of_the_models_own_processor(extractor_dirs):
    from transformers import AutoImageProcessor, CLIPVisionModelWithProjection

    model = CLIPVisionModelWithProjection.from_pretrained(str(extractor_dirs["clip"])).eval()
    pixels = AutoImageProcessor.from_pretrained(str(extractor_dirs["clip"]))(
        images=list(images(1)), return_tensors="pt"
    )["pixel_values"]
    with torch.no_grad():
        expected = model(pixel_values=pixels).image_embeds.numpy()
    np.testing.assert_allclose(load_extractor("clip", extractor_dirs["clip"])(images(1)), expected, atol=1e-6)


def test_an_extractor_folder_without_its_image_processor_is_refused(tmp_path, extractor_dirs):
    (tmp_path / "config.json").write_text((extractor_dirs["dino"] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="preprocessor_config.json"):
        load_extractor("dino", tmp_path)


def test_metrics_on_real_extractor_features_separate_same_from_different_images(extractor_dirs):
    same, other = images(2, n=12), np.clip(images(3, n=12).astype(int) // 4 + 180, 0, 255).astype(np.uint8)
    clip, dino = load_extractor("clip", extractor_dirs["clip"]), load_extractor("dino", extractor_dirs["dino"])
    assert cmmd(clip(same), clip(same)) == pytest.approx(0.0, abs=1e-9)
    assert cmmd(clip(same), clip(other)) > 0 and dino_mmd(dino(same), dino(other)) > 0
