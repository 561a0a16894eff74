"""GPU-only training settings: whether this machine can run them, and the switches that turn them on.

The schema (kiln.config.TrainConfig) refuses contradictions any machine can see (float8 or async TP with
device=cpu). Whether *this* machine has what a setting needs (a CUDA device of capability 8.9+ and torchao
for float8, an SDPA backend that has a kernel here) is checked by `check_gpu_settings`, the trainer's first
act (`setup_runtime`), before any data or model is touched: a setting that cannot run refuses the run
with the key named; it never degrades quietly to something else.
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass

import torch

from kiln.config import ConfigError, KilnConfig, TrainConfig

FLOAT8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper and later: float8 tensor cores


@dataclass(frozen=True)
class Machine:
    """What this machine offers the GPU-only settings."""

    cuda: bool
    capability: tuple[int, int] | None  # of the first CUDA device
    gpu_name: str | None
    torchao: bool
    symmetric_memory: bool  # torch.distributed._symmetric_memory (async TP)

    @classmethod
    def probe(cls) -> Machine:
        cuda = torch.cuda.is_available()
        return cls(
            cuda=cuda,
            capability=torch.cuda.get_device_capability() if cuda else None,
            gpu_name=torch.cuda.get_device_name() if cuda else None,
            torchao=importlib.util.find_spec("torchao") is not None,
            symmetric_memory=importlib.util.find_spec("torch.distributed._symmetric_memory") is not None,
        )


def sdpa_backend(name: str):
    """The torch SDPBackend of `train.parallel.attention` (None for auto)."""
    from torch.nn.attention import SDPBackend

    return {
        "auto": None,
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]


def attention_context(name: str):
    """The context the training step runs in: SDPA restricted to the configured backend (nothing for auto)."""
    backend = sdpa_backend(name)
    if backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel([backend])


def attention_kernel_problem(name: str, device: str, dtype: torch.dtype, head_dim: int, gqa: bool) -> str | None:
    """Why the backend has no kernel here for the DiT's attention, or None: a tiny SDPA call as
    model/attention.py makes it (additive key-mask bias, GQA when kv_heads < heads), forward and
    backward, under the backend, on the device and dtype the step uses."""
    from model.attention import attention_bias

    if sdpa_backend(name) is None:
        return None
    q = torch.randn(1, 2, 8, head_dim, device=device, dtype=dtype, requires_grad=True)
    kv = q[:, :1] if gqa else q
    keys = torch.ones(1, 8, dtype=torch.bool, device=device)
    keys[:, -1] = False
    try:
        with attention_context(name):
            out = torch.nn.functional.scaled_dot_product_attention(
                q, kv, kv, attn_mask=attention_bias(keys, dtype), enable_gqa=gqa
            )
            out.sum().backward()
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"SDPA backend {name} has no kernel on {device} for the DiT's attention ({dtype}, head_dim {head_dim}, key-mask bias{', GQA' if gqa else ''}): {first}"
    return None


def gpu_setting_problems(tc: TrainConfig, machine: Machine, head_dim: int, gqa: bool = False) -> list[tuple[str, str]]:
    """(key, problem) for each GPU-only setting of `tc` this machine cannot run."""
    p, out = tc.parallel, []
    if tc.device.startswith("cuda") and not machine.cuda:
        out.append(("train.device", f"{tc.device} but this machine has no CUDA device"))
    if p.float8:
        if not machine.cuda:
            out.append(
                ("train.parallel.float8", "float8 needs a CUDA device of capability 8.9+ and this machine has none")
            )
        elif machine.capability is not None and machine.capability < FLOAT8_MIN_CAPABILITY:
            cap = ".".join(map(str, machine.capability))
            out.append(
                (
                    "train.parallel.float8",
                    f"float8 needs CUDA capability 8.9+ (Ada, Hopper or later); {machine.gpu_name} is {cap}",
                )
            )
        if not machine.torchao:
            out.append(("train.parallel.float8", "float8 needs torchao: pip install 'kiln[gpu]'"))
    if p.async_tp and not (machine.cuda and machine.symmetric_memory):
        out.append(("train.parallel.async_tp", "async TP needs CUDA and torch.distributed._symmetric_memory"))
    if p.attention != "auto":
        if tc.device.startswith("cuda") and not machine.cuda:
            out.append(
                (
                    "train.parallel.attention",
                    f"the {p.attention} SDPA backend was asked for on {tc.device} and this machine has no CUDA device",
                )
            )
        elif why := attention_kernel_problem(
            p.attention, tc.device, torch.bfloat16 if tc.device.startswith("cuda") else torch.float32, head_dim, gqa
        ):
            out.append(("train.parallel.attention", why))
    return out


def check_gpu_settings(cfg: KilnConfig, machine: Machine | None = None) -> None:
    """Refuse a run whose GPU-only settings this machine cannot honour (ConfigError naming each key)."""
    from model.sizes import get_size

    size = get_size(cfg.model.size)
    kv_heads = cfg.model.kv_heads or size.kv_heads
    problems = gpu_setting_problems(
        cfg.train, machine or Machine.probe(), size.width // size.heads, kv_heads != size.heads
    )
    if problems:
        lines = "\n".join(f"  {key}: {what}" for key, what in problems)
        raise ConfigError(f"this machine cannot run the training config:\n{lines}")


def enable_async_tp(tp_mesh) -> None:
    """torch's async TP (torchtitan's recipe): inductor micro-pipelines the TP all-gather / reduce-scatter
    with the matmuls through symmetric memory. Takes effect in the compiled blocks only (hence compile=true)."""
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
