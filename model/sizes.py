"""The size registry: name -> transformer shape. `ModelConfig.size` picks one.

MLP widths follow the 2/3-adjusted SwiGLU convention (hidden = 2/3 * 4 * width, rounded up to 64), which
keeps the FLOPs of a 4x GELU MLP; with it the Krea-2-class shape (6144 wide, 28 deep) lands at 12.2B.
Expected parameter counts are written (and checked on the meta device) in tests/test_model_sizes.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from model.attention import swiglu_hidden


@dataclass(frozen=True)
class DiTSize:
    width: int
    depth: int
    heads: int
    kv_heads: int
    mlp_hidden: int
    note: str = ""


def _size(width: int, depth: int, heads: int, kv_heads: int, note: str) -> DiTSize:
    return DiTSize(width, depth, heads, kv_heads, swiglu_hidden(width), note)


SIZES: dict[str, DiTSize] = {
    "micro": _size(64, 2, 2, 1, "unit tests: builds and runs in milliseconds"),
    "nano": _size(128, 4, 2, 1, "the CPU demo: ~1M params, 2.4x the steps per second of tiny on 2 cores"),
    "tiny": _size(256, 4, 4, 2, "the CPU demo before nano: ~4M params, 32x32 pixels in minutes on 2 cores"),
    "small": _size(512, 8, 8, 2, "a single-GPU ablation size (~30M)"),
    "prx_1b": _size(2048, 24, 16, 4, "PRX-1.2B class"),
    "krea2_12b": _size(6144, 28, 48, 12, "Krea-2-12B class"),
}


def get_size(name: str) -> DiTSize:
    try:
        return SIZES[name]
    except KeyError:
        raise KeyError(f"unknown model size {name!r}; known: {sorted(SIZES)}") from None
