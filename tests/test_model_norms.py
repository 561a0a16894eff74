"""Zero-centred RMSNorm: the CPU fast path (hand-written backward) equals F.rms_norm, values and gradients."""

import pytest
import torch
import torch.nn.functional as F

from model.norms import RMSNorm, _RMSNormCPU


@pytest.mark.parametrize("affine", [False, True])
def test_the_cpu_path_matches_f_rms_norm_forward_and_backward(affine):
    norm = RMSNorm(48, affine=affine)
    if affine:
        with torch.no_grad():
            norm.scale.normal_(0, 0.3)
    x = torch.randn(3, 5, 4, 48).transpose(1, 2)  # non-contiguous, as q/k views are
    g = torch.randn(3, 4, 5, 48)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y1 = norm(x1)
    (y1 * g).sum().backward()
    grads1 = [x1.grad] + [p.grad.clone() for p in norm.parameters()]
    norm.zero_grad()
    weight = (1.0 + norm.scale) if affine else None
    y2 = F.rms_norm(x2, (48,), weight=weight, eps=norm.eps)
    (y2 * g).sum().backward()
    grads2 = [x2.grad] + [p.grad for p in norm.parameters()]
    assert torch.allclose(y1, y2, atol=1e-6)
    for a, b in zip(grads1, grads2, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_the_hand_written_backward_passes_gradcheck():
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    w = (1 + 0.3 * torch.randn(8, dtype=torch.float64)).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x, w: _RMSNormCPU.apply(x, w, 1e-6), (x, w))
    assert torch.autograd.gradcheck(lambda x: _RMSNormCPU.apply(x, None, 1e-6), (x,))


def test_a_frozen_input_still_trains_the_gain():
    norm = RMSNorm(16)
    x, g = torch.randn(4, 16), torch.randn(4, 16)
    (norm(x) * g).sum().backward()
    expected = (F.rms_norm(x, (16,), eps=norm.eps) * g).sum(0)
    assert torch.allclose(norm.scale.grad, expected, atol=1e-6)
