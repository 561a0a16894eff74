"""Portable data numerics: the same curation bytes from every x86-64 machine with AVX2, whatever its vector width.

numpy and its OpenBLAS pick their kernels by the CPU they load on, and the kernels round differently: on
an AVX-512 machine the classical descriptor came out other than on the AVX2 machine that pinned dvc.lock,
and with it every stage after `embedded`, so `dvc repro` rewrote the lock. Capping both at their AVX2
kernels gives the AVX2 machine's bytes (both caps are needed; docs/training.md, "What `dvc repro`
reproduces on another machine", has the measurements).

The caps are environment variables each library reads once, when it loads, so kiln sets them when it is
imported (kiln/__init__.py), before numpy, and every process it starts (a DVC stage, a Dagster run
worker) inherits them. torch is not capped: capping ATen and MKL at AVX2 costs the demo's training 18% of
its speed on AVX-512 and still does not give another machine's training bytes (MKL's kernels differ by
vendor and model too), so checkpoints are reproducible byte for byte on the machine kind that trained them.
`KILN_NUMERICS=native` opts out. A machine without AVX2 (or not x86-64) runs native: there is no common
path to cap at.
"""

from __future__ import annotations

import os
import platform
import sys

CAPS = {
    "NPY_ENABLE_CPU_FEATURES": "X86_V3",  # numpy's own loops: dispatch no further than AVX2 / FMA3
    "OPENBLAS_CORETYPE": "Haswell",  # numpy's OpenBLAS: its AVX2 kernels
}
NEEDED_FLAGS = frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})  # x86-64-v3, the path the caps name
NUMPY_LOADED_BEFORE = "numpy" in sys.modules  # then this process's numpy is uncapped (its children are not)


def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def portable_possible() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and NEEDED_FLAGS <= cpu_flags()


def apply() -> None:
    """Set the caps, unless the user opted out, the CPU has no common path, or set numpy's own feature list."""
    if os.environ.get("KILN_NUMERICS", "portable") == "native" or not portable_possible():
        return
    if "NPY_DISABLE_CPU_FEATURES" in os.environ:  # numpy refuses both variables at once: the user's list wins
        return
    for key, value in CAPS.items():
        os.environ.setdefault(key, value)


def mode() -> str:
    """'portable' when the caps are in force in this process, else 'native'."""
    capped = all(os.environ.get(k) == v for k, v in CAPS.items())
    return "portable" if capped and not NUMPY_LOADED_BEFORE else "native"
