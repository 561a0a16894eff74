"""The single-stream DiT: identity at init, any aspect ratio, padding-invariant, deterministic, trainable."""

import pytest
import torch

from model.dit import Block, DiT, DiTConfig, patchify, unpatchify
from model.sizes import get_size


def micro(**kw) -> DiTConfig:
    s = get_size("micro")
    return DiTConfig(width=s.width, depth=s.depth, heads=s.heads, kv_heads=s.kv_heads, mlp_hidden=s.mlp_hidden, **kw)


def inputs(b=2, h=8, w=12, text_len=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 3, h, w, generator=g)
    t = torch.rand(b, generator=g)
    text = torch.randn(b, text_len, 64, generator=g)
    mask = torch.ones(b, text_len, dtype=torch.bool)
    mask[0, 4:] = False
    return x, t, text, mask


def perturb(model: torch.nn.Module, seed: int = 0) -> None:
    """Move every parameter off its initial value, so tests see a trained-like network."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.mark.parametrize("h,w,p", [(8, 8, 2), (8, 12, 2), (12, 8, 4), (6, 10, 2)])
def test_patchify_round_trips_any_aspect_ratio(h, w, p):
    x = torch.randn(2, 3, h, w)
    tokens = patchify(x, p)
    assert tokens.shape == (2, (h // p) * (w // p), 3 * p * p)
    assert torch.equal(unpatchify(tokens, p, 3, h, w), x)
    assert torch.equal(tokens[0, 1], x[0, :, 0:p, p : 2 * p].reshape(-1))  # row-major patches


def test_patchify_refuses_sizes_that_are_not_patch_multiples():
    with pytest.raises(ValueError, match="multiple of the patch size"):
        patchify(torch.randn(1, 3, 7, 8), 2)


@pytest.mark.parametrize("modulation", ["light", "adaln"])
def test_every_residual_block_is_the_identity_at_init_and_the_output_is_zero(modulation):
    model = DiT(micro(modulation=modulation, timestep_tokens=2 if modulation == "adaln" else 0))
    x, t, text, mask = inputs()
    seq = torch.randn(2, 16, 64)
    c = torch.randn(2, 64)
    shared = model.shared_modulation(c).view(2, 6, -1) if model.shared_modulation is not None else None
    for block in model.blocks:
        assert torch.equal(block(seq, None, None, shared, c), seq)
    assert torch.equal(model(x, t, text, mask), torch.zeros_like(x))


def test_refiner_blocks_without_modulation_are_the_identity_at_init():
    block = Block(64, 2, 1, 128, modulation=None)
    block.init_weights()
    seq = torch.randn(2, 5, 64)
    assert torch.equal(block(seq, None, None), seq)


@pytest.mark.parametrize("modulation,timestep_tokens", [("light", 0), ("adaln", 0), ("light", 3)])
def test_forward_is_deterministic_and_keeps_the_input_shape(modulation, timestep_tokens):
    torch.manual_seed(0)
    model = DiT(micro(modulation=modulation, timestep_tokens=timestep_tokens))
    perturb(model)
    x, t, text, mask = inputs()
    a, b = model(x, t, text, mask), model(x, t, text, mask)
    assert a.shape == x.shape and torch.equal(a, b)
    assert a.abs().mean() > 1e-3  # not the init zero any more
    assert not torch.allclose(model(x, t.flip(0), text, mask), a)  # time matters


def test_padded_text_tokens_change_nothing():
    model = DiT(micro())
    perturb(model, seed=1)
    x, t, text, mask = inputs()
    garbage = text.clone()
    garbage[0, 4:] = 1e3 * torch.randn(2, 64)  # sample 0's padding
    assert torch.allclose(model(x, t, text, mask), model(x, t, garbage, mask), atol=1e-5)
    longer = torch.cat([text, torch.randn(2, 5, 64)], dim=1)
    longer_mask = torch.cat([mask, torch.zeros(2, 5, dtype=torch.bool)], dim=1)
    assert torch.allclose(model(x, t, text, mask), model(x, t, longer, longer_mask), atol=1e-5)
    visible = mask.clone()
    visible[0, 4] = True  # un-masking a garbage token does change the result
    assert not torch.allclose(model(x, t, garbage, visible), model(x, t, garbage, mask), atol=1e-3)


def test_sequence_padding_to_a_multiple_changes_nothing():
    x, t, text, mask = inputs()  # 6 text + 24 patches = 30 tokens
    unpadded = DiT(micro(pad_to_multiple=1))
    padded = DiT(micro(pad_to_multiple=64))
    perturb(unpadded, seed=2)
    padded.load_state_dict(unpadded.state_dict())
    assert unpadded.sequence_length(6, 8, 12) == 30 and padded.sequence_length(6, 8, 12) == 64
    assert torch.allclose(unpadded(x, t, text, mask), padded(x, t, text, mask), atol=1e-5)


def test_image_positions_matter_so_the_model_sees_layout():
    model = DiT(micro())
    perturb(model, seed=3)
    x, t, text, mask = inputs(h=8, w=8)
    flipped = model(x.flip(-1), t, text, mask).flip(-1)
    assert not torch.allclose(flipped, model(x, t, text, mask), atol=1e-4)


def test_a_few_steps_of_adam_fit_one_batch():
    torch.manual_seed(0)
    model = DiT(micro())
    x, t, text, mask = inputs()
    target = torch.randn_like(x)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = (model(x, t, text, mask) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    assert all(p.grad is not None for p in model.parameters())


def test_flop_count_matches_two_flops_per_weight_plus_attention():
    cfg = micro(pad_to_multiple=1)
    model = DiT(cfg)
    text_len, h, w = 6, 8, 8
    s, n_img = text_len + 16, 16
    block_weights = sum(p.numel() for n, p in model.blocks.named_parameters() if n.endswith("weight") and p.dim() == 2)
    expected = s * (2 * block_weights + cfg.depth * 4 * s * cfg.width) + 2 * n_img * (12 * 64 + 64 * 12)
    assert model.flops_per_sample(text_len, h, w) == expected


def test_a_meta_built_model_materialises_with_to_empty_then_init_weights():
    with torch.device("meta"):
        model = DiT(micro())
    model.to_empty(device="cpu")
    model.init_weights()
    x, t, text, mask = inputs()
    assert torch.equal(model(x, t, text, mask), torch.zeros_like(x))
    assert model.patch_embed.weight.abs().sum() > 0
