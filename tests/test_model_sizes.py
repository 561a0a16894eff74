"""Every registered size builds on the meta device (no memory) with the parameter count its shape implies."""

import math

import pytest
import torch

from kiln.config import ModelConfig
from model.dit import DiT
from model.generator import resolve_dit_config
from model.sizes import SIZES, get_size


def swiglu_width(width: int) -> int:
    """The MLP width the registry promises (model/sizes.py): 2/3 of a 4x MLP, rounded up to a multiple of 64."""
    return math.ceil(8 * width / 3 / 64) * 64


def dit_parameters(
    width, depth, heads, kv_heads, mlp_hidden, patch=2, channels=3, modulation="light", timestep_tokens=0
) -> int:
    """The DiT's parameter count written out from its shape, module by module (model/dit.py's design):

    per block: fused q, k, v and gate projection (no bias), output projection (no bias), two learned
    qk-norm scales of one head each, SwiGLU gate+up and down (no bias), and the modulation (light: a
    learned 6 x width bias; adaLN: its own width -> 6 width projection); the block's two pre-norms have
    no parameters (modulation scales them). Outside the blocks: patch embedding, a two-layer timestep MLP
    over 256 sinusoidal features, the shared light modulation (no bias), optional timestep tokens, the
    final modulation (shift and scale) and the output projection back to patch pixels."""
    head_dim = width // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = width * (q + kv + kv + q) + q * width + 2 * head_dim
    mlp = width * 2 * mlp_hidden + mlp_hidden * width
    block_modulation = 6 * width if modulation == "light" else width * 6 * width + 6 * width
    blocks = depth * (attention + mlp + block_modulation)
    pixels = channels * patch * patch
    patch_embed = pixels * width + width
    time_embed = (256 * width + width) + (width * width + width)
    shared_modulation = width * 6 * width if modulation == "light" else 0
    tokens = (width * timestep_tokens * width + timestep_tokens * width) if timestep_tokens else 0
    final = (width * 2 * width + 2 * width) + (width * pixels + pixels)
    return blocks + patch_embed + time_embed + shared_modulation + tokens + final


def built(**model) -> int:
    with torch.device("meta"):
        dit = DiT(resolve_dit_config(ModelConfig(**model)))
    assert all(p.is_meta for p in dit.parameters())
    return sum(p.numel() for p in dit.parameters())


@pytest.mark.parametrize("name", sorted(SIZES))
def test_size_builds_on_meta_with_the_parameter_count_its_shape_implies(name):
    s = get_size(name)
    assert s.mlp_hidden == swiglu_width(s.width)
    assert built(size=name) == dit_parameters(s.width, s.depth, s.heads, s.kv_heads, swiglu_width(s.width))


@pytest.mark.parametrize(
    "variant", [{"modulation": "adaln"}, {"timestep_tokens": 4}, {"patch_size": 4}, {"in_channels": 4}]
)
def test_the_count_follows_the_modulation_timestep_tokens_patch_and_channels(variant):
    s = get_size("micro")
    shape = {
        "patch": variant.get("patch_size", 2),
        "channels": variant.get("in_channels", 3),
        "modulation": variant.get("modulation", "light"),
        "timestep_tokens": variant.get("timestep_tokens", 0),
    }
    assert built(size="micro", **variant) == dit_parameters(
        s.width, s.depth, s.heads, s.kv_heads, s.mlp_hidden, **shape
    )


def test_the_named_sizes_land_where_their_notes_say():
    krea = get_size("krea2_12b")
    assert (krea.width, krea.depth, krea.heads, krea.kv_heads, krea.mlp_hidden) == (6144, 28, 48, 12, 16384)
    assert 0.8e6 <= built(size="nano") <= 1.3e6  # "~1M parameters in the blocks" (conf/model/nano.yaml)
    assert 3e6 <= built(size="tiny") <= 6e6  # "~4M params"
    assert 2e7 <= built(size="small") <= 4e7  # "~30M"
    assert 1.1e9 <= built(size="prx_1b") <= 1.3e9  # "PRX-1.2B class"
    assert 1.2e10 <= built(size="krea2_12b") <= 1.25e10  # "lands at 12.2B" (model/sizes.py)


def test_unknown_size_names_the_known_ones():
    with pytest.raises(KeyError, match="tiny"):
        get_size("huge")
