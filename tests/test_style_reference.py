"""The style-reference pathway (model/reference.py): reference tokens in the DiT's sequence, weighted by a
strength in [0, 1] through an attention-logit bias log(strength) on their keys.

Strength 0 is exactly no reference; influence grows with strength; several references mix; a checkpoint
written before the pathway existed loads and samples as before."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kiln.config import ReferenceConfig
from model.generator import Generator
from model.sampler import denoise, initial_noise, sample
from model.testing import micro_model_config, write_tiny_text_encoder

PROMPTS = ["a large red circle on the left", "a small blue square at the top"]


@pytest.fixture(scope="module")
def text_encoder(tmp_path_factory):
    return write_tiny_text_encoder(tmp_path_factory.mktemp("style") / "te")


def randomised(gen: Generator, seed: int = 0) -> Generator:
    """Every weight drawn at random: the zero-initialised output layers would otherwise hide any effect."""
    torch.manual_seed(seed)
    for p in gen.parameters():
        p.data.normal_(0.0, 0.2)
    return gen.eval()


def styled(text_encoder, encoder: str = "conv") -> Generator:
    cfg = micro_model_config(text_encoder, reference=ReferenceConfig(enabled=True, encoder=encoder))
    return randomised(Generator.build(cfg))


def reference_image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (24, 24, 3), dtype=np.uint8)


def run(gen: Generator, refs=None, cfg_scale: float = 1.0) -> torch.Tensor:
    noise = initial_noise(len(PROMPTS), 3, 16, 16, seed=7)
    return denoise(gen, noise, gen.encode_text(PROMPTS), steps=4, cfg_scale=cfg_scale, shift=1.0, refs=refs)


@pytest.mark.parametrize("encoder", ["conv", "classical"])
@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_strength_zero_is_no_reference_bit_for_bit(text_encoder, encoder, cfg_scale):
    gen = styled(text_encoder, encoder)
    without = run(gen, cfg_scale=cfg_scale)
    refs = gen.encode_references([[reference_image(1)], [reference_image(2), reference_image(3)]], [[0.0], [0.0, 0.0]])
    assert torch.equal(run(gen, refs, cfg_scale), without)


def test_a_sample_at_strength_zero_is_untouched_by_its_neighbours_references(text_encoder):
    gen = styled(text_encoder)
    without = run(gen)
    refs = gen.encode_references([[reference_image(1)], [reference_image(2)]], [[0.0], [1.0]])
    with_refs = run(gen, refs)
    assert torch.equal(with_refs[0], without[0])
    assert not torch.equal(with_refs[1], without[1])


def test_the_output_moves_away_from_the_unreferenced_one_monotonically_with_strength(text_encoder):
    gen = styled(text_encoder)
    without = run(gen)
    strengths = [0.0, 0.1, 0.25, 0.5, 0.75, 1.0]
    distances = []
    for s in strengths:
        refs = gen.encode_references([[reference_image(1)], [reference_image(2)]], [[s], [s]])
        distances.append((run(gen, refs) - without).flatten(1).norm(dim=1))
    d = torch.stack(distances)  # [strength, sample]
    assert (d[0] == 0).all()
    assert (d[1:] > d[:-1]).all(), d


def test_several_references_mix_smoothly_by_strength(text_encoder):
    """References a and b at strengths (1 - w, w): w = 0 is a alone, w = 1 is b alone, and as w rises the
    sample leaves a's and approaches b's."""
    gen = styled(text_encoder)
    a, b = reference_image(1), reference_image(2)

    def mixed(w):
        return run(gen, gen.encode_references([[a, b], [a, b]], [[1 - w, w], [1 - w, w]]))

    only_a = run(gen, gen.encode_references([[a], [a]], [[1.0], [1.0]]))
    only_b = run(gen, gen.encode_references([[b], [b]], [[1.0], [1.0]]))
    torch.testing.assert_close(mixed(0.0), only_a, rtol=0, atol=1e-5)
    torch.testing.assert_close(mixed(1.0), only_b, rtol=0, atol=1e-5)
    mixes = [mixed(w) for w in (0.0, 0.25, 0.5, 0.75, 1.0)]
    to_a = [(m - only_a).norm().item() for m in mixes]
    to_b = [(m - only_b).norm().item() for m in mixes]
    assert to_a == sorted(to_a) and to_b == sorted(to_b, reverse=True)


def test_without_references_an_enabled_pathway_computes_what_the_plain_model_does(text_encoder):
    plain = randomised(Generator.build(micro_model_config(text_encoder)))
    enabled = plain.with_references(ReferenceConfig(grid=2)).eval()
    assert torch.equal(run(enabled), run(plain))
    assert set(enabled.state_dict()) - set(plain.state_dict()) == {
        k for k in enabled.state_dict() if k.startswith("reference.")
    }


def test_a_checkpoint_written_before_the_pathway_loads_and_samples_unchanged(text_encoder, tmp_path):
    gen = randomised(Generator.build(micro_model_config(text_encoder)))
    gen.save_pretrained(tmp_path / "old")
    meta = json.loads((tmp_path / "old" / "config.json").read_text())
    del meta["model"]["reference"]  # what config.json held before the pathway existed
    (tmp_path / "old" / "config.json").write_text(json.dumps(meta))
    loaded = Generator.from_pretrained(tmp_path / "old")
    assert loaded.reference is None and not loaded.cfg.reference.enabled
    kwargs = {"height": 16, "width": 16, "steps": 3, "cfg_scale": 2.0, "seed": 3}
    assert np.array_equal(sample(loaded, PROMPTS, **kwargs), sample(gen, PROMPTS, **kwargs))


def test_a_styled_checkpoint_round_trips(text_encoder, tmp_path):
    gen = styled(text_encoder)
    gen.save_pretrained(tmp_path / "styled")
    loaded = Generator.from_pretrained(tmp_path / "styled").eval()
    refs = gen.encode_references([[reference_image(1)], [reference_image(2)]], [[0.6], [0.3]])
    assert torch.equal(run(loaded, refs), run(gen, refs))


def test_bad_references_get_clear_errors(text_encoder):
    gen = styled(text_encoder)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        gen.encode_references([[reference_image(1)]], [[1.5]])
    with pytest.raises(ValueError, match="exactly one strength"):
        gen.encode_references([[reference_image(1)]], [[]])
    with pytest.raises(ValueError, match="max_references"):
        gen.encode_references([[reference_image(i) for i in range(5)]], [[0.5] * 5])
    plain = Generator.build(micro_model_config(gen.cfg.text_encoder.path))
    with pytest.raises(ValueError, match="no reference pathway"):
        plain.encode_references([[reference_image(1)]], [[0.5]])
