"""The Generator: frozen text backbone by reference, trainable fusion + DiT, exact save/load round trip."""

import json

import pytest
import torch
from safetensors.torch import load_file

from model.generator import Generator
from model.testing import micro_model_config
from model.text_encoder import TextBatch

PROMPTS = ["a red circle", "two blue squares on the left", ""]


def trained_like(gen: Generator, seed: int = 0) -> Generator:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in gen.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return gen


def test_text_batch_has_the_configured_layers_and_a_padding_mask(text_encoder_dir):
    gen = Generator.build(micro_model_config(text_encoder_dir))
    text = gen.encode_text(PROMPTS)
    assert text.hidden.shape == (3, 3, 16, 32)  # [B, n_layers, max_length, backbone width]
    assert text.mask.dtype == torch.bool and text.mask.sum(1).tolist() == [5, 8, 2]  # [CLS] ... [SEP]
    assert not text.hidden.requires_grad
    states = gen.backbone.model(
        **gen.backbone.tokenizer(PROMPTS[:1], return_tensors="pt"), output_hidden_states=True
    ).hidden_states
    assert torch.allclose(text.hidden[0, 0, :5], states[-1][0], atol=1e-5)


def test_the_backbone_is_frozen_and_outside_the_trainable_parameters(text_encoder_dir):
    gen = Generator.build(micro_model_config(text_encoder_dir))
    backbone_params = sum(p.numel() for p in gen.backbone.model.parameters())
    assert not any(k.startswith("backbone") for k in gen.state_dict())
    assert gen.num_params(trainable_only=False) == gen.num_params() + backbone_params
    assert not any(p.requires_grad for p in gen.backbone.model.parameters())
    x, t = torch.randn(2, 3, 8, 8), torch.rand(2)
    trained_like(gen)(x, t, gen.encode_text(PROMPTS[:2])).sum().backward()
    assert all(p.grad is not None for p in gen.parameters())


def test_null_text_is_the_empty_prompt_repeated(text_encoder_dir):
    gen = Generator.build(micro_model_config(text_encoder_dir))
    null = gen.null_text(4)
    empty = gen.encode_text([""])
    assert null.hidden.shape[0] == 4 and torch.equal(null.hidden[3], empty.hidden[0])
    kept = gen.encode_text(PROMPTS[:2]).where(torch.tensor([True, False]), gen.null_text(2))
    assert torch.equal(kept.hidden[0], gen.encode_text(PROMPTS[:1]).hidden[0])
    assert torch.equal(kept.mask[1], empty.mask[0])


def test_prompt_and_padding_length_do_not_leak_into_the_prediction(text_encoder_dir):
    short = trained_like(Generator.build(micro_model_config(text_encoder_dir)))
    long_cfg = micro_model_config(text_encoder_dir)
    long_cfg = long_cfg.model_copy(update={"text_encoder": long_cfg.text_encoder.model_copy(update={"max_length": 24})})
    long = Generator.build(long_cfg)
    long.load_state_dict(short.state_dict())
    x, t = torch.randn(2, 3, 8, 8), torch.rand(2)
    a = short(x, t, short.encode_text(PROMPTS[:2]))
    b = long(x, t, long.encode_text(PROMPTS[:2]))
    assert torch.allclose(a, b, atol=1e-5)
    assert not torch.allclose(a[0], short(x, t, short.encode_text(PROMPTS[1:2] * 2))[0], atol=1e-4)


def test_save_and_load_round_trip_exactly(text_encoder_dir, tmp_path):
    gen = trained_like(Generator.build(micro_model_config(text_encoder_dir, modulation="adaln", timestep_tokens=2)))
    gen.save_pretrained(tmp_path / "ckpt")
    meta = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert meta["dit"]["width"] == 64 and meta["model"]["modulation"] == "adaln"
    assert meta["text_encoder_path"] == str(text_encoder_dir)
    assert set(load_file(str(tmp_path / "ckpt" / "model.safetensors"))) == set(gen.state_dict())
    loaded = Generator.from_pretrained(tmp_path / "ckpt")
    for (k, a), (k2, b) in zip(gen.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b)
    x, t = torch.randn(2, 3, 8, 12), torch.rand(2)
    text = gen.encode_text(PROMPTS[:2])
    assert torch.equal(gen(x, t, text), loaded(x, t, text))


def test_from_pretrained_refuses_a_folder_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text('{"format": "something-else"}')
    with pytest.raises(ValueError, match="not a kiln generator"):
        Generator.from_pretrained(tmp_path)


def test_text_embeddings_are_cached_on_disk_by_prompt(text_encoder_dir, tmp_path):
    cfg = micro_model_config(text_encoder_dir)
    cfg = cfg.model_copy(update={"text_encoder": cfg.text_encoder.model_copy(update={"cache_dir": str(tmp_path)})})
    gen = Generator.build(cfg)
    first = gen.encode_text(PROMPTS)
    files = sorted(tmp_path.rglob("*.safetensors"))
    assert len(files) == 3
    with torch.no_grad():  # a cache hit must not touch the backbone: break it and read again
        for p in gen.backbone.model.parameters():
            p.fill_(float("nan"))
    again = gen.encode_text(PROMPTS[::-1])
    assert torch.equal(again.hidden, first.hidden.flip(0)) and torch.equal(again.mask, first.mask.flip(0))
    assert TextBatch.load(files[0]).hidden.shape == (1, 3, 16, 32)


def test_flops_and_tokens_are_counted_for_mfu(text_encoder_dir):
    gen = Generator.build(micro_model_config(text_encoder_dir))
    assert gen.tokens_per_sample(16, 16) == 16 + 64  # text + patches, already a multiple of 16
    fwd = gen.flops_per_sample(16, 16, training=False)
    assert gen.flops_per_sample(16, 16) == 3 * fwd
    weights = sum(p.numel() for n, p in gen.dit.blocks.named_parameters() if p.dim() == 2)
    assert fwd > 2 * weights * 80  # at least two FLOPs per block weight per token
    assert gen.flops_per_token(16, 16) == 3 * fwd / 64


def test_in_channels_must_match_the_autoencoder(text_encoder_dir):
    with pytest.raises(ValueError, match="latent channels"):
        Generator.build(micro_model_config(text_encoder_dir, in_channels=4))
