"""Grouped-query gated attention: equals plain multi-head attention, masks keys, gates the output."""

import math

import torch

from model.attention import Attention, SwiGLU, swiglu_hidden


def _reference_mha(attn: Attention, h: torch.Tensor, key_mask=None) -> torch.Tensor:
    """Textbook multi-head attention over the module's own weights, written out by hand."""
    b, s, _ = h.shape
    q, k, v, g = attn.qkvg(h).split(attn.split, dim=-1)
    hd, rep = attn.head_dim, attn.heads // attn.kv_heads
    q = attn.q_norm(q.view(b, s, attn.heads, hd)).transpose(1, 2)
    k = attn.k_norm(k.view(b, s, attn.kv_heads, hd)).transpose(1, 2).repeat_interleave(rep, dim=1)
    v = v.view(b, s, attn.kv_heads, hd).transpose(1, 2).repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)
    return attn.out(o * torch.sigmoid(g))


def _randomise(module: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def test_full_kv_heads_is_multi_head_attention():
    attn = Attention(64, heads=4, kv_heads=4)
    _randomise(attn)
    h = torch.randn(2, 7, 64)
    assert torch.allclose(attn(h), _reference_mha(attn, h), atol=1e-5)


def test_grouped_query_attention_equals_mha_with_repeated_kv_heads():
    gqa = Attention(64, heads=4, kv_heads=2)
    _randomise(gqa, seed=1)
    mha = Attention(64, heads=4, kv_heads=4)
    q_w, k_w, v_w, g_w = gqa.qkvg.weight.split(gqa.split, dim=0)
    hd = gqa.head_dim

    def repeat(w):  # [kv_heads*hd, in] -> [heads*hd, in], each kv head serving heads/kv_heads query heads
        return w.view(gqa.kv_heads, hd, -1).repeat_interleave(2, dim=0).reshape(-1, w.shape[1])

    with torch.no_grad():
        mha.qkvg.weight.copy_(torch.cat([q_w, repeat(k_w), repeat(v_w), g_w]))
        mha.out.weight.copy_(gqa.out.weight)
        mha.q_norm.scale.copy_(gqa.q_norm.scale)
        mha.k_norm.scale.copy_(gqa.k_norm.scale)
    h = torch.randn(3, 9, 64)
    assert torch.allclose(gqa(h), mha(h), atol=1e-5)
    assert torch.allclose(gqa(h), _reference_mha(gqa, h), atol=1e-5)


def test_masked_keys_have_no_influence():
    attn = Attention(32, heads=2, kv_heads=1)
    _randomise(attn, seed=2)
    h = torch.randn(1, 6, 32)
    mask = torch.tensor([[True, True, True, True, False, False]])
    garbage = h.clone()
    garbage[:, 4:] = 100 * torch.randn(1, 2, 32)
    assert torch.allclose(attn(h, key_mask=mask)[:, :4], attn(garbage, key_mask=mask)[:, :4], atol=1e-5)
    assert torch.allclose(attn(h, key_mask=mask), _reference_mha(attn, h, mask), atol=1e-5)


def test_the_sigmoid_gate_scales_the_output_before_projection():
    attn = Attention(32, heads=2, kv_heads=2)
    _randomise(attn, seed=3)
    ungated = Attention(32, heads=2, kv_heads=2, gated=False)
    with torch.no_grad():
        ungated.qkvg.weight.copy_(attn.qkvg.weight[: sum(ungated.split)])
        ungated.out.weight.copy_(attn.out.weight)
        ungated.q_norm.scale.copy_(attn.q_norm.scale)
        ungated.k_norm.scale.copy_(attn.k_norm.scale)
        attn.qkvg.weight[sum(ungated.split) :] = 0.0  # gate logits 0 -> sigmoid 1/2
    h = torch.randn(2, 5, 32)
    assert torch.allclose(attn(h), 0.5 * ungated(h), atol=1e-5)


def test_swiglu_uses_the_two_thirds_width_convention():
    assert swiglu_hidden(6144) == 16384  # 2/3 * 4 * 6144
    assert swiglu_hidden(256) == 704  # 682.7 rounded up to a multiple of 64
    mlp = SwiGLU(16, 32)
    x = torch.randn(4, 16)
    gate, up = mlp.gate_up(x).chunk(2, dim=-1)
    assert torch.allclose(mlp(x), mlp.down(torch.nn.functional.silu(gate) * up))


def test_swiglu_gradient_is_bit_identical_to_autograd_through_chunk_and_silu():
    """The hand-written backward is a speed change only: checkpoints trained before it stay reproducible."""
    mlp = SwiGLU(16, 32)
    x1 = torch.randn(3, 5, 16, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    g = torch.randn(3, 5, 16)
    (mlp(x1) * g).sum().backward()
    grads1 = [x1.grad] + [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    gate, up = mlp.gate_up(x2).chunk(2, dim=-1)
    (mlp.down(torch.nn.functional.silu(gate) * up) * g).sum().backward()
    for a, b in zip(grads1, [x2.grad] + [p.grad for p in mlp.parameters()], strict=True):
        assert torch.equal(a, b)
