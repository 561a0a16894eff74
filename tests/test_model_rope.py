"""3-D axial RoPE: attention scores depend only on relative positions; text sits at the origin."""

import torch

from model.rope import apply_rope, axes_dims, image_positions, rope_angles


def _score(q, k, pq, pk, head_dim=32):
    cos, sin = rope_angles(torch.stack([pq, pk]), head_dim)
    rq = apply_rope(q[None, None, None], cos[:1], sin[:1])
    rk = apply_rope(k[None, None, None], cos[1:], sin[1:])
    return (rq * rk).sum().item()


def test_scores_depend_only_on_the_relative_position():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(32, generator=g), torch.randn(32, generator=g)
    a = _score(q, k, torch.tensor([0, 3, 5]), torch.tensor([1, 1, 2]))
    b = _score(q, k, torch.tensor([4, 10, 7]), torch.tensor([5, 8, 4]))  # same offsets, shifted
    c = _score(q, k, torch.tensor([0, 3, 5]), torch.tensor([1, 2, 2]))  # a different offset
    assert abs(a - b) < 1e-4
    assert abs(a - c) > 1e-3


def test_every_axis_moves_the_score():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(32, generator=g), torch.randn(32, generator=g)
    base = _score(q, k, torch.tensor([0, 0, 0]), torch.tensor([0, 0, 0]))
    for axis in range(3):
        p = torch.zeros(3, dtype=torch.long)
        p[axis] = 1
        assert abs(_score(q, k, p, torch.zeros(3, dtype=torch.long)) - base) > 1e-4


def test_origin_is_no_rotation_and_norms_are_preserved():
    x = torch.randn(2, 3, 5, 32)
    cos, sin = rope_angles(torch.zeros(5, 3, dtype=torch.long), 32)
    assert torch.equal(apply_rope(x, cos, sin), x)
    cos, sin = rope_angles(image_positions(1, 1, 5), 32)
    assert torch.allclose(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1), atol=1e-5)


def test_head_dim_splits_into_even_axis_chunks():
    for d in (16, 32, 64, 128):
        dims = axes_dims(d)
        assert sum(dims) == d and all(x % 2 == 0 for x in dims)
    assert axes_dims(128) == (32, 48, 48)


def test_image_positions_are_row_major():
    pos = image_positions(1, 2, 3)
    assert pos.tolist() == [[0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 1, 2]]


def test_the_rotation_backward_is_the_inverse_rotation():
    x = torch.randn(2, 3, 5, 16, dtype=torch.float64, requires_grad=True)
    cos, sin = (t.double() for t in rope_angles(image_positions(1, 1, 5) * 3, 16))
    assert torch.autograd.gradcheck(lambda x: apply_rope(x, cos, sin), (x,))
