"""PRX's ablation knobs are config (docs/ablations.md, "Knobs"): each builds, trains one step to a finite
loss, and really changes the model or the run (a parameter count from an independent formula, a parameter
that is gone, an output that differs, an export equal to a hand-computed average, a routed token count).

The micro DiT (width 64, 2 blocks, 2 heads of 32 dims, 1 kv head, SwiGLU hidden 192, one refiner layer)
trains on demo scenes in one process with one thread."""

from __future__ import annotations

import json
import math

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from kiln.config import KilnConfig, TrainConfig
from model.generator import Generator, resolve_dit_config
from model.testing import micro_model_config
from training.core.telemetry import read_metrics
from training.core.trainer import Learner, Runtime, StepBatch, init_generator, step_generator, train, train_step
from training.testing import scene_rows, tiny_config, write_pack_output

WIDTH, DEPTH, HEADS, HEAD_DIM, REFINER_LAYERS = 64, 2, 2, 32, 1


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_pack_output(tmp_path_factory.mktemp("knobs") / "pack", scene_rows(24, seed=3, batch_size=8))


def _cfg(te, model: dict | None = None, **train) -> KilnConfig:
    cfg = tiny_config(te, **({"steps": 1, "warmup_steps": 0} | train))
    return cfg.model_copy(update={"model": micro_model_config(te, **(model or {}))})


def _params(te, **model) -> dict[str, torch.Tensor]:
    return dict(init_generator(micro_model_config(te, **model), 0).named_parameters())


def _count(params: dict[str, torch.Tensor]) -> int:
    return sum(p.numel() for p in params.values())


def _trains_one_step(data, out, cfg: KilnConfig) -> None:
    train(data, out, cfg)
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl")]
    assert len(losses) == cfg.train.steps and all(math.isfinite(x) for x in losses)


def _perturbed(gen: Generator, seed: int = 0) -> Generator:
    """Every weight moved off its zero-closing init, so every branch contributes to the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in gen.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return gen.eval()


def _inputs(gen: Generator, t: float = 0.5):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 16, 16, generator=g)
    return x, torch.full((2,), t), gen.encode_text(["a red circle on the left", "two blue squares"])


# ------------------------------------------------------------------------------------- architecture
KNOBS = {  # name -> model overrides, each a non-default value
    "mha": {"kv_heads": 2},
    "no_gate": {"attention_gate": False},
    "no_qk_norm": {"qk_norm": False},
    "adaln": {"modulation": "adaln"},
    "timestep_tokens_only": {"modulation": "none", "timestep_tokens": 2},
    "partial_rope": {"rope_fraction": 0.5},
    "gelu": {"mlp": "gelu"},
    "abs_pos": {"abs_pos": True},
    "x_prediction": {"prediction": "x"},
    "pixel_head": {"pixel_head": 8},
}


@pytest.mark.parametrize("knob", sorted(KNOBS))
def test_each_architecture_knob_trains_one_step_and_round_trips_through_its_checkpoint(
    data, text_encoder_dir, tmp_path, knob
):
    cfg = _cfg(text_encoder_dir, KNOBS[knob])
    out = tmp_path / knob
    _trains_one_step(data, out, cfg)
    gen = Generator.from_pretrained(out)  # strict load: the rebuilt architecture has exactly the saved weights
    assert gen.dit_cfg == resolve_dit_config(cfg.model)
    assert gen.dit_cfg != resolve_dit_config(micro_model_config(text_encoder_dir))  # the knob reached the DiT


def test_kv_heads_sets_the_key_value_projections_mha_or_gqa(text_encoder_dir):
    gqa, mha = _params(text_encoder_dir), _params(text_encoder_dir, kv_heads=HEADS)
    # one more kv head adds a key and a value projection (2 x head_dim x width) to every attention layer:
    # the DiT's blocks and the text refiner's
    assert _count(mha) - _count(gqa) == (DEPTH + REFINER_LAYERS) * 2 * HEAD_DIM * WIDTH
    with pytest.raises(ValueError, match="kv_heads=3 does not divide"):
        resolve_dit_config(micro_model_config(text_encoder_dir, kv_heads=3))


def test_the_attention_gate_off_removes_its_projection_rows(text_encoder_dir):
    gated, plain = _params(text_encoder_dir), _params(text_encoder_dir, attention_gate=False)
    assert (
        _count(gated) - _count(plain) == DEPTH * HEADS * HEAD_DIM * WIDTH
    )  # the DiT's gate rows; the refiner keeps its own
    assert plain["dit.blocks.0.attn.qkvg.weight"].shape[0] == (HEADS + 2 * 1) * HEAD_DIM


def test_qk_norm_off_removes_the_query_and_key_norms(text_encoder_dir):
    normed, plain = _params(text_encoder_dir), _params(text_encoder_dir, qk_norm=False)
    assert "dit.blocks.0.attn.q_norm.scale" in normed
    assert not any(".attn.q_norm." in k or ".attn.k_norm." in k for k in plain if k.startswith("dit."))
    assert _count(normed) - _count(plain) == DEPTH * 2 * HEAD_DIM


def test_adaln_gives_every_block_its_own_timestep_projection(text_encoder_dir):
    light, adaln = _params(text_encoder_dir), _params(text_encoder_dir, modulation="adaln")
    assert "dit.shared_modulation.weight" in light and "dit.shared_modulation.weight" not in adaln
    per_block = 6 * WIDTH * WIDTH + 6 * WIDTH  # Linear(width, 6 width) with bias, against light's 6 x width bias
    assert _count(adaln) - _count(light) == DEPTH * (per_block - 6 * WIDTH) - 6 * WIDTH * WIDTH


def test_modulation_none_feeds_the_timestep_only_as_tokens(text_encoder_dir):
    with pytest.raises(ValidationError, match="modulation=none needs timestep_tokens > 0"):
        micro_model_config(text_encoder_dir, modulation="none")
    from model.dit import DiTConfig

    with pytest.raises(ValueError, match="needs timestep_tokens > 0"):  # a config.json edited by hand
        DiTConfig(width=WIDTH, depth=DEPTH, heads=HEADS, kv_heads=1, mlp_hidden=192, modulation="none")
    gen = _perturbed(init_generator(micro_model_config(text_encoder_dir, modulation="none", timestep_tokens=2), 0))
    assert not any("modulation" in name for name, _ in gen.named_parameters())
    x, t, text = _inputs(gen)
    with torch.no_grad():
        early, late = gen(x, t, text), gen(x, 1 - 0.8 * t, text)
        gen.dit.timestep_tokens.weight.zero_()
        gen.dit.timestep_tokens.bias.zero_()
        blind_early, blind_late = gen(x, t, text), gen(x, 1 - 0.8 * t, text)
    assert not torch.allclose(early, late)  # the timestep reaches the output...
    assert torch.equal(blind_early, blind_late)  # ...through the tokens and nothing else


def test_partial_rope_rotates_that_share_of_each_head(text_encoder_dir):
    from model.rope import image_positions, rope_angles, rotated_dims

    pos = image_positions(2, 4, 4)
    for fraction, rotated in ((1.0, HEAD_DIM), (0.5, HEAD_DIM // 2), (0.25, HEAD_DIM // 4), (0.0, 0)):
        cos, sin = rope_angles(pos, HEAD_DIM, fraction=fraction)
        turned = (sin != 0).any(0)  # channels some position turns
        assert int(turned.sum()) == rotated == rotated_dims(HEAD_DIM, fraction)
        assert torch.equal(cos[:, ~turned], torch.ones_like(cos[:, ~turned]))  # the rest pass through unchanged
    # in the DiT a single image sits in frame 0, so only the height and width channels turn: 12 + 12 of a
    # 32-dim head's (8, 12, 12) split, 6 + 6 of the 16 rotated dims' (4, 6, 6) split
    for fraction, turning in ((1.0, 24), (0.5, 12)):
        dit = init_generator(micro_model_config(text_encoder_dir, rope_fraction=fraction), 0).dit
        assert int((dit._rope(16, 8, 8, 96, torch.device("cpu"))[1] != 0).any(0).sum()) == turning


def test_absolute_positions_tell_the_tokens_where_they_are_without_new_weights(text_encoder_dir):
    from model.dit import sincos_2d

    emb = sincos_2d(4, 4, WIDTH)
    assert emb.shape == (16, WIDTH) and len({tuple(r.tolist()) for r in emb}) == 16  # one code per patch
    # a row's code depends on its row only, a column's on its column only (first half: rows, second: columns)
    assert torch.equal(emb[0, : WIDTH // 2], emb[3, : WIDTH // 2]) and torch.equal(
        emb[0, WIDTH // 2 :], emb[12, WIDTH // 2 :]
    )
    plain = _perturbed(init_generator(micro_model_config(text_encoder_dir), 0))
    placed = init_generator(micro_model_config(text_encoder_dir, abs_pos=True), 0)
    placed.load_state_dict(plain.state_dict())  # the same weights: the positions are fixed, not learned
    x, t, text = _inputs(plain)
    with torch.no_grad():
        assert not torch.allclose(plain.eval()(x, t, text), placed.eval()(x, t, text), atol=1e-4)


@pytest.mark.parametrize("t", [0.02, 0.3, 0.9])
def test_x_prediction_turns_the_heads_clean_image_into_the_velocity(text_encoder_dir, t):
    """With the same weights, the v-model's output is what the x-model's head predicts as the clean image;
    the x-model returns the velocity (x_t - x0) / t that leads from x_t to it, with t clipped at 0.05."""
    v_model = _perturbed(init_generator(micro_model_config(text_encoder_dir), 0))
    x_model = init_generator(micro_model_config(text_encoder_dir, prediction="x"), 0).eval()
    x_model.load_state_dict(v_model.state_dict())  # no new weights
    x_t, times, text = _inputs(v_model, t)
    with torch.no_grad():
        clean = v_model(x_t, times, text)
        velocity = x_model(x_t, times, text)
    assert torch.allclose(velocity, (x_t - clean) / max(t, 0.05), atol=1e-4)
    if t >= 0.05:  # one Euler step of the whole remaining time lands on the predicted clean image
        assert torch.allclose(x_t - t * velocity, clean, atol=1e-4)


def _pixels_moved_by_one_patch(gen: Generator) -> torch.Tensor:
    """[H, W] bool: the output pixels that change when the final layer's output for the first (top-left)
    patch alone is perturbed."""
    x, t, text = _inputs(gen)
    with torch.no_grad():
        plain = gen(x, t, text)
        hook = gen.dit.final.register_forward_hook(lambda mod, args, out: torch.cat([out[:, :1] + 1.0, out[:, 1:]], 1))
        nudged = gen(x, t, text)
        hook.remove()
    return (nudged - plain).abs().amax(dim=(0, 1)) > 1e-6


def test_the_pixel_head_lets_each_patch_reach_across_its_seams(text_encoder_dir):
    """The linear head writes each patch's pixels from that patch's token alone, so neighbouring patches
    can disagree at their shared edge (the blocky seams of the demo's samples); the pixel head's 3x3 conv
    reads one pixel across every seam. Both start closed: the output is zero at initialisation."""
    p = micro_model_config(text_encoder_dir).patch_size
    linear = _perturbed(init_generator(micro_model_config(text_encoder_dir), 0))
    conv = _perturbed(init_generator(micro_model_config(text_encoder_dir, pixel_head=8), 0))
    assert tuple(conv.dit.final.weight.shape) == (8 * p * p, WIDTH) and tuple(conv.dit.pixel_conv.weight.shape) == (
        3,
        8,
        3,
        3,
    )
    moved = _pixels_moved_by_one_patch(linear)
    assert moved[:p, :p].all() and moved.sum() == p * p  # its own patch and nothing else
    moved = _pixels_moved_by_one_patch(conv)
    assert moved[: p + 1, : p + 1].all() and moved.sum() == (p + 1) ** 2  # one pixel into the neighbours
    fresh = init_generator(micro_model_config(text_encoder_dir, pixel_head=8), 0).eval()
    x, t, text = _inputs(fresh)
    with torch.no_grad():
        assert torch.equal(fresh(x, t, text), torch.zeros_like(x))


def test_the_gelu_mlp_is_4x_wide_at_the_flops_of_swiglu(text_encoder_dir):
    from model.attention import GeluMLP, SwiGLU
    from model.dit import DiT

    gelu = init_generator(micro_model_config(text_encoder_dir, mlp="gelu"), 0).dit.blocks[0].mlp
    assert isinstance(gelu, GeluMLP) and gelu.up.out_features == 4 * WIDTH
    # at the demo's size the two MLPs cost the same FLOPs up to SwiGLU's rounding of its width to 64
    swiglu_tiny, gelu_tiny = (
        DiT(resolve_dit_config(micro_model_config(text_encoder_dir, size="tiny", mlp=m))).blocks[0].mlp
        for m in ("swiglu", "gelu")
    )
    assert isinstance(swiglu_tiny, SwiGLU)
    assert abs(gelu_tiny.flops_per_token() / swiglu_tiny.flops_per_token() - 1) < 0.05


# --------------------------------------------------------------------------------- optimiser, weights
def test_adamw_eps_is_the_configured_one(data, text_encoder_dir, tmp_path):
    from training.core.muon import make_optimizer

    tc = TrainConfig(optim={"adam_eps": 1e-6})
    opt = make_optimizer(init_generator(micro_model_config(text_encoder_dir), 0), tc)
    assert {g["eps"] for g in opt.param_groups} == {1e-6}
    with pytest.raises(ValidationError):
        TrainConfig(optim={"adam_eps": 0.5})
    _trains_one_step(data, tmp_path / "eps", _cfg(text_encoder_dir, optim={"adam_eps": 1e-6}))


def _step_weights(out, step: int, gen) -> dict[str, torch.Tensor]:
    from training.core.pma import dcp_step_weights

    return dcp_step_weights(out / "dcp" / f"step-{step:06d}", gen)


def test_the_ema_export_is_the_hand_computed_ema_of_the_steps_weights(data, text_encoder_dir, tmp_path):
    decay = 0.75  # not 0.5: a decay applied the wrong way round would give the same average
    cfg = _cfg(text_encoder_dir, steps=2, ema_decay=decay, final_weights="ema", dcp={"every": 1, "keep": 3})
    out = tmp_path / "ema"
    _trains_one_step(data, out, cfg)
    gen = Generator.from_pretrained(out)
    w0 = init_generator(cfg.model, cfg.train.seed).state_dict()
    w1, w2 = _step_weights(out, 1, gen), _step_weights(out, 2, gen)  # the step checkpoints hold the raw weights
    exported = load_file(str(out / "model.safetensors"))
    for name in w0:
        ema = w0[name]
        for w in (w1[name], w2[name]):
            ema = decay * ema + (1 - decay) * w
        torch.testing.assert_close(exported[name], ema, rtol=0, atol=1e-6)
    assert any(not torch.equal(exported[n], w2[n]) for n in w2)  # not the last weights


def test_the_ema_resumes_from_the_step_checkpoint(data, text_encoder_dir, tmp_path):
    cfg = _cfg(text_encoder_dir, steps=3, ema_decay=0.9, final_weights="ema")
    whole = train(data, tmp_path / "whole", cfg)
    train(data, tmp_path / "split", cfg, stop_at=2)
    split = train(data, tmp_path / "split", cfg, resume=True)
    a, b = load_file(str(whole / "model.safetensors")), load_file(str(split / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_final_weights_pma_exports_the_average_of_the_last_k_steps(data, text_encoder_dir, tmp_path):
    cfg = _cfg(text_encoder_dir, steps=3, pma_k=2, final_weights="pma", dcp={"every": 1, "keep": 2})
    out = tmp_path / "pma"
    _trains_one_step(data, out, cfg)
    gen = Generator.from_pretrained(out)
    w2, w3 = _step_weights(out, 2, gen), _step_weights(out, 3, gen)
    exported = load_file(str(out / "model.safetensors"))
    for name in w3:
        torch.testing.assert_close(exported[name], (w2[name] + w3[name]) / 2, rtol=0, atol=1e-6)
    assert json.loads((out / "pma.json").read_text())["steps"] == [2, 3]
    from training.core.checkpoint import verify_export

    assert verify_export(out)  # the checksums cover the averaged weights


def test_final_weights_need_their_average(text_encoder_dir):
    with pytest.raises(ValidationError, match="final_weights=ema needs ema_decay > 0"):
        TrainConfig(final_weights="ema")
    with pytest.raises(ValidationError, match="final_weights=pma needs pma_k > 0"):
        TrainConfig(final_weights="pma")


# ----------------------------------------------------------------------------------------- sampling
def test_the_inference_shift_defaults_to_the_training_shift(text_encoder_dir):
    from training.core.objective import timestep_shift
    from training.evaluation.sampling import sampling_shift

    gen = init_generator(micro_model_config(text_encoder_dir), 0)
    trained = TrainConfig(timestep_shift=1.5, timestep_max_shift=4.0)
    assert sampling_shift(gen, 64, 64, trained) == timestep_shift(32 * 32, 1.5, 4.0)
    apart = trained.model_copy(update={"sample": trained.sample.model_copy(update={"shift": 6.0})})
    assert sampling_shift(gen, 64, 64, apart) == 6.0


# ------------------------------------------------------------------------------------------ routing
def _tokens_into_blocks(gen: Generator) -> list[int]:
    seen: list[int] = []
    for block in gen.dit.blocks:
        block.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    return seen


def test_token_routing_sends_a_share_of_the_image_tokens_around_the_span_in_training_only(text_encoder_dir):
    from training.core.muon import make_optimizer

    gen = init_generator(micro_model_config(text_encoder_dir), 0)
    seen = _tokens_into_blocks(gen)
    x, _, text = _inputs(gen)
    tc = TrainConfig(route={"frac": 0.5, "start": 1, "end": 2}, caption_dropout=0.0)
    cpu = Runtime(torch.device("cpu"), None)
    result = train_step(
        Learner(gen, make_optimizer(gen, tc), tc, cpu),
        StepBatch(x, text, gen.null_text(2)),
        step_generator(0, 0),
        1e-3,
        1.0,
    )
    assert math.isfinite(result.loss)
    seq = gen.tokens_per_sample(16, 16)  # 16 text + 64 image tokens, no padding
    image = (16 // 2) ** 2
    assert seen == [seq, seq - image // 2]  # block 1 saw the text and half of the image tokens
    seen.clear()
    with torch.no_grad():
        gen.eval()(x, torch.full((2,), 0.5), text)
    assert seen == [seq, seq]  # inference: every token through every block


def test_a_route_is_a_function_of_the_step_rng_and_an_empty_route_changes_nothing(text_encoder_dir):
    from model.routing import TokenRoute

    a, b = (TokenRoute.draw(64, 0.25, 1, 2, step_generator(0, 5)) for _ in range(2))
    assert torch.equal(a.routed, b.routed) and len(a.routed) == 16
    assert not torch.equal(a.routed, TokenRoute.draw(64, 0.25, 1, 2, step_generator(0, 6)).routed)
    gen = _perturbed(init_generator(micro_model_config(text_encoder_dir), 0))
    x, t, text = _inputs(gen)
    with torch.no_grad():
        plain = gen(x, t, text)
        empty = gen(x, t, text, route=TokenRoute.draw(64, 0.0, 1, 2, step_generator(0, 5)))
        routed = gen(x, t, text, route=a)
    assert torch.equal(plain, empty)
    assert not torch.allclose(plain, routed)
    with pytest.raises(ValueError, match="not inside the DiT's 2 blocks"):
        gen(x, t, text, route=TokenRoute.draw(64, 0.25, 1, 3, step_generator(0, 5)))


def test_token_routing_trains_through_the_trainer(data, text_encoder_dir, tmp_path):
    _trains_one_step(data, tmp_path / "route", _cfg(text_encoder_dir, route={"frac": 0.5, "start": 1, "end": 2}))
    with pytest.raises(ValidationError, match="sequence_parallel"):
        TrainConfig(route={"frac": 0.5}, parallel={"sequence_parallel": True})
