"""Portable data numerics: importing kiln caps numpy and its OpenBLAS at their AVX2 kernels, so the curation
stages give the same bytes on an AVX2 machine and an AVX-512 one (kiln/numerics.py).

Each check runs in a fresh interpreter, because the caps only act on a numpy that loads after them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kiln.numerics import portable_possible
from kiln.paths import REPO_ROOT

pytestmark = pytest.mark.skipif(not portable_possible(), reason="no x86-64-v3 CPU: kiln runs native numerics here")

# The classical descriptor of three demo renders, as float32 bytes (sha256, first 16 hex digits), as the AVX2
# path computes it: measured on an AVX-512 machine with the caps, and without them under QEMU's Haswell
# (Intel) and EPYC-Rome (AMD) CPU models; the same machine without the caps gives a74be2aba148b695.
AVX2_DESCRIPTOR = "d18530595329ea92"

DESCRIPTOR = """
import hashlib
import kiln
from components.demo_scenes import Background, Scene, Shape, render
from model.image_encoders import classical_descriptor
scenes = [Scene("single_shape", Background(bg), (Shape(c, s, "large", p),)) for c, s, p, bg in
          [("red", "circle", "left", "blue"), ("yellow", "triangle", "top", "purple"), ("white", "diamond", "center", "green")]]
print(hashlib.sha256(b"".join(classical_descriptor(render(sc, 96, 96)).astype("<f4").tobytes() for sc in scenes)).hexdigest()[:16])
"""

RUNTIME = """
import kiln
import numpy as np
from threadpoolctl import threadpool_info
from kiln import numerics
wide = np._core._multiarray_umath.__cpu_features__.get("X86_V4", False)  # False where numpy stops at AVX2
blas = [i.get("architecture") for i in threadpool_info() if i.get("internal_api") == "openblas"]
print(numerics.mode(), "avx512" if wide else "avx2", blas[0] if blas else "-")
"""


def _python(code: str, **env: str) -> str:
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NPY_ENABLE_CPU_FEATURES", "OPENBLAS_CORETYPE", "KILN_NUMERICS")
    }
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env={**clean, **env}, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_importing_kiln_caps_numpy_and_openblas_at_their_avx2_kernels():
    mode, simd, blas = _python(RUNTIME).split(" ")
    assert mode == "portable"
    assert simd == "avx2"
    assert blas == "Haswell"  # OpenBLAS's AVX2 kernels, on an AVX-512 Intel or a Zen alike


def test_the_classical_descriptor_gives_the_avx2_bytes_on_any_x86_64_v3_machine():
    assert _python(DESCRIPTOR) == AVX2_DESCRIPTOR


def test_kiln_numerics_native_opts_out_and_says_so():
    mode, _, _ = _python(RUNTIME, KILN_NUMERICS="native").split(" ")
    assert mode == "native"
