"""Every registered size builds on the meta device (no memory) with its expected parameter count."""

import pytest
import torch

from kiln.config import ModelConfig
from model.dit import DiT
from model.generator import resolve_dit_config
from model.sizes import SIZES, get_size

# DiT parameters (patch 2, pixel space, light modulation), without the text fusion.
EXPECTED = {
    "micro": 162_508,
    "tiny": 3_880_716,
    "small": 27_172_364,
    "prx_1b": 1_202_552_844,
    "krea2_12b": 12_497_622_028,
}


@pytest.mark.parametrize("name", sorted(SIZES))
def test_size_builds_on_meta_with_its_expected_parameter_count(name):
    with torch.device("meta"):
        model = DiT(resolve_dit_config(ModelConfig(size=name)))
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == EXPECTED[name]


def test_the_registry_and_the_expectations_name_the_same_sizes():
    assert set(SIZES) == set(EXPECTED)


def test_named_shapes():
    krea = get_size("krea2_12b")
    assert (krea.width, krea.depth, krea.heads, krea.kv_heads, krea.mlp_hidden) == (6144, 28, 48, 12, 16384)
    assert 3e6 <= EXPECTED["tiny"] <= 6e6
    assert 1.1e9 <= EXPECTED["prx_1b"] <= 1.3e9


def test_unknown_size_names_the_known_ones():
    with pytest.raises(KeyError, match="tiny"):
        get_size("huge")
