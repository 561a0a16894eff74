"""Muon: Newton-Schulz orthogonalises, hidden 2-D weights go to Muon and the rest to AdamW; the AdamW
half is torch's AdamW and the Muon half is torch's Muon (with Moonshot's AdamW-matched learning rate)."""

import torch

from training.core.muon import Muon, newton_schulz, param_groups, uses_muon


def test_newton_schulz_maps_a_matrix_close_to_its_orthogonal_polar_factor():
    g = torch.randn(32, 48, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(newton_schulz(g, steps=5))
    assert s.min() > 0.6 and s.max() < 1.25  # the quintic's band around 1, independent of g's scale
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    cos = torch.nn.functional.cosine_similarity(newton_schulz(g).flatten(), (u @ vh).flatten(), dim=0)
    assert cos > 0.95


def test_hidden_block_weights_use_muon_and_first_last_and_1d_parameters_adamw(text_encoder_dir):
    from model.generator import Generator
    from model.testing import micro_model_config

    gen = Generator.build(micro_model_config(text_encoder_dir))
    names = {n for n, p in gen.named_parameters() if uses_muon(n, p)}
    assert "dit.blocks.0.attn.qkvg.weight" in names and "dit.blocks.1.mlp.down.weight" in names
    assert "text_fusion.refiner.0.mlp.gate_up.weight" in names
    for adamw in (
        "dit.patch_embed.weight",
        "dit.final.weight",
        "dit.final_modulation.weight",
        "text_fusion.proj.weight",
        "dit.blocks.0.modulation.bias",
    ):
        assert adamw not in names
    groups = param_groups(gen, 0.1)
    assert sum(len(g["params"]) for g in groups) == len(list(gen.parameters()))
    assert all(p.dim() == 1 for p in groups[2]["params"]) and groups[2]["weight_decay"] == 0.0


def test_the_adamw_half_is_torch_adamw():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(5, 3)), None
    b = torch.nn.Parameter(a.detach().clone())
    ours = Muon([{"params": [a], "use_muon": False, "weight_decay": 0.1}], lr=1e-2)
    ref = torch.optim.AdamW([b], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(5):
        g = torch.randn(5, 3, generator=torch.Generator().manual_seed(step))
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_muon_step_moves_a_matrix_by_an_adamw_sized_orthogonal_update():
    w = torch.nn.Parameter(torch.zeros(64, 32))
    opt = Muon([{"params": [w], "use_muon": True, "weight_decay": 0.0}], lr=1.0, momentum=0.0, nesterov=False)
    w.grad = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    opt.step()
    rms = float(w.detach().pow(2).mean().sqrt())
    assert 0.1 < rms < 0.3  # 0.2 sqrt(max dim) * an orthogonal matrix's RMS sqrt(1/max dim) ~ 0.2
    assert float(torch.nn.functional.cosine_similarity(-w.detach().flatten(), w.grad.flatten(), dim=0)) > 0.5


def test_a_muon_step_is_torch_muon_with_the_adamw_matched_learning_rate():
    """torch.optim.Muon is an independent implementation of the same update when adjust_lr_fn="match_rms_adamw"
    (its lr times 0.2 sqrt(max(rows, cols)), Moonshot's rule, which ours uses; torch's default "original",
    sqrt(max(1, rows / cols)), is Keller Jordan's and would not match). Two differences cancel or stay small:
    torch keeps the momentum as an average ((1 - mu) times our sum), a scale Newton-Schulz normalises away, and
    it runs Newton-Schulz in bfloat16 where ours runs in float32, so updates agree to bfloat16 precision."""
    for shape, nesterov in (((64, 32), True), ((32, 64), True), ((48, 48), False)):
        ours_w = torch.nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(7)))
        ref_w = torch.nn.Parameter(ours_w.detach().clone())
        ours = Muon(
            [{"params": [ours_w], "use_muon": True, "weight_decay": 0.1}], lr=0.02, momentum=0.9, nesterov=nesterov
        )
        ref = torch.optim.Muon(
            [ref_w], lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn="match_rms_adamw"
        )
        for step in range(6):
            g = torch.randn(*shape, generator=torch.Generator().manual_seed(100 + step))
            before = ours_w.detach().clone()
            ours_w.grad, ref_w.grad = g.clone(), g.clone()
            ours.step()
            ref.step()
            ours_update, ref_update = ours_w.detach() - before, ref_w.detach() - before
            rel = float((ours_update - ref_update).norm() / ref_update.norm())
            assert rel < 0.03, (
                shape,
                nesterov,
                step,
                rel,
            )  # bfloat16 Newton-Schulz; a wrong scale or momentum is >= 0.2
            ref_w.data.copy_(ours_w.detach())  # compare each step from the same weights: differences do not compound
