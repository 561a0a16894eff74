"""FSDP2 x tensor parallelism over a 2-D DeviceMesh ("dp_shard", "tp"), and per-block execution options.

Order (torchtitan's): TP plans -> activation checkpointing -> torch.compile -> fully_shard per block -> root.

TP (Megatron style) on every DiT block: the fused q/k/v/gate projection and the fused SwiGLU gate/up are
column-parallel, the attention and MLP output projections row-parallel, QK-norms run on the local heads
(SequenceParallel over the head dim, so their gain's gradient is summed over tp). A fused weight is split
by `split` on its output dim, so before sharding its rows are regrouped rank-major
([q0 k0 v0 g0 | q1 k1 v1 g1]): each rank's contiguous shard then holds whole heads of every part, and the
module's split sizes / head counts are set to the local ones. That regrouping is the only layout change;
`canonical_state_dict` undoes it for exports. With sequence_parallel the residual stream between blocks is
sharded on the sequence (norms and modulation run on 1/tp of the tokens); attention and MLP all-gather on
entry and reduce-scatter on exit, and the (replicated) modulation's gradient is summed over tp, since each
rank only back-propagates its own tokens into it. The text refiner, embeddings and final layer are only FSDP-sharded.

Verified on CPU (gloo, 2x2 mesh): equal to one process within 1e-6 (tests/test_training_parallel.py).
torch.compile with DTensor on CPU gives wrong gradients, so `apply_compile` refuses it; compile + TP is a GPU path.
"""

from __future__ import annotations

import logging
from functools import partial

import torch
from torch import nn

from kiln.config import ParallelConfig

log = logging.getLogger("kiln.training.parallel")


# ------------------------------------------------------------------------------------------- mesh
def build_mesh(world_size: int, tp: int, device_type: str):
    from torch.distributed.device_mesh import init_device_mesh

    if world_size % tp:
        raise ValueError(f"world size {world_size} is not a multiple of parallel.tp={tp}")
    return init_device_mesh(device_type, (world_size // tp, tp), mesh_dim_names=("dp_shard", "tp"))


# --------------------------------------------------------------------------------------- TP layout
def rank_major_rows(sizes: tuple[int, ...], tp: int) -> torch.Tensor:
    """Row permutation that regroups a fused [part0; part1; ...] weight as [part0_r0 part1_r0 ... | part0_r1 ...]."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    order = []
    for r in range(tp):
        for start, size in zip(starts, sizes):
            n = size // tp
            order.extend(range(start + r * n, start + (r + 1) * n))
    return torch.tensor(order, dtype=torch.long)


def fused_layouts(model: nn.Module, tp: int) -> dict[str, torch.Tensor]:
    """{weight name: row permutation} of every fused TP weight of a Generator, from its config (the
    modules' split sizes are local once `to_tp_layout` ran)."""
    cfg = model.dit_cfg
    hd = cfg.width // cfg.heads
    q, kv = cfg.heads * hd, cfg.kv_heads * hd
    split = (q, kv, kv) + ((q,) if cfg.gated_attention else ())
    out = {}
    for i in range(cfg.depth):
        out[f"dit.blocks.{i}.attn.qkvg.weight"] = rank_major_rows(split, tp)
        out[f"dit.blocks.{i}.mlp.gate_up.weight"] = rank_major_rows((cfg.mlp_hidden, cfg.mlp_hidden), tp)
    return out


def check_tp_shapes(model: nn.Module, tp: int) -> None:
    cfg = model.dit_cfg
    for what, n in (("heads", cfg.heads), ("kv_heads", cfg.kv_heads), ("mlp_hidden", cfg.mlp_hidden)):
        if n % tp:
            raise ValueError(f"parallel.tp={tp} does not divide the DiT's {what}={n}")


def to_tp_layout(model: nn.Module, tp: int) -> None:
    """Regroup fused weights rank-major and set local head counts / split sizes (in place, before sharding)."""
    perms = fused_layouts(model, tp)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, perm in perms.items():
            params[name].copy_(params[name][perm])
    for block in model.dit.blocks:
        a = block.attn
        a.heads, a.kv_heads, a.split = a.heads // tp, a.kv_heads // tp, tuple(s // tp for s in a.split)


def canonical_state_dict(full: dict[str, torch.Tensor], model: nn.Module, tp: int) -> dict[str, torch.Tensor]:
    """A full (gathered) state dict in the single-process layout: undo `to_tp_layout`'s row regrouping."""
    if tp == 1:
        return dict(full)
    out = dict(full)
    for name, perm in fused_layouts(model, tp).items():
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(len(perm))
        out[name] = full[name][inv]
    return out


# ------------------------------------------------------------------------------------------ TP plans
def block_plan(sequence_parallel: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    plan = {
        "attn.qkvg": ColwiseParallel(),
        "attn.out": RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate()),
        "mlp.gate_up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate()),
    }
    if sequence_parallel:
        # attention is called as attn(h, rope, key_mask), the MLP as mlp(h): all-gather h on entry
        plan |= {
            "norm1": SequenceParallel(use_local_output=True),
            "norm2": SequenceParallel(use_local_output=True),
            "attn": PrepareModuleInput(
                input_layouts=(Shard(1), None, None),
                desired_input_layouts=(Replicate(), None, None),
                use_local_output=True,
            ),
            "mlp": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            ),
        }
    return plan


def qk_norm_plan() -> dict:
    from torch.distributed.tensor.parallel import SequenceParallel

    # q/k are [B, S, heads, head_dim] when normed: the local heads are a Shard(2) of all heads
    return {
        "attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    }


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient backward: Megatron's "f" operator."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_grad_over_tp(tp_mesh):
    """A forward hook for modules whose (replicated) output then meets sequence-sharded tokens: each tp
    rank sees the gradient of its own tokens only, so the gradient is summed over tp on the way back."""
    group = tp_mesh.get_group()

    def hook(module, args, output):
        return _SumGradOverGroup.apply(output, group)

    return hook


def apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool = False) -> None:
    """Tensor-parallelise every DiT block of a Generator over `tp_mesh` (in place)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, parallelize_module

    tp = tp_mesh.size()
    check_tp_shapes(model, tp)
    to_tp_layout(model, tp)
    blocks = model.dit.blocks
    for block in blocks:
        plan = block_plan(sequence_parallel)
        if model.dit_cfg.qk_norm:
            plan |= qk_norm_plan()
        parallelize_module(block, tp_mesh, plan)
    if sequence_parallel:
        for block in blocks:
            if block.modulation is not None:
                block.modulation.register_forward_hook(sum_grad_over_tp(tp_mesh))
        rest = (None,) * 4
        parallelize_module(
            blocks[0],
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Replicate(), *rest), desired_input_layouts=(Shard(1), *rest), use_local_output=True
            ),
        )
        parallelize_module(
            blocks[-1],
            tp_mesh,
            PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True),
        )


# ----------------------------------------------------------------------------- activation checkpointing
def _selective_policy():
    """Save matmul and attention outputs, recompute the cheap elementwise ops (norms, gates, activations)."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    save = {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    }

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_activation_checkpointing(blocks: nn.ModuleList, mode: str) -> None:
    """Replace each block's forward by a checkpointed one (in place: parameter names do not change)."""
    if mode == "none":
        return
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    kwargs = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _selective_policy())
    elif mode != "full":
        raise ValueError(f"unknown activation_checkpointing {mode!r}")
    for block in blocks:
        block.forward = partial(checkpoint, block.forward, **kwargs)


# ------------------------------------------------------------------------------------------- compile
def apply_compile(blocks: nn.ModuleList, device_type: str, distributed: bool) -> None:
    """torch.compile each block's forward in place (parameter names unchanged). The forward, not the module
    (`Module.compile`): a forward that activation checkpointing replaced is not traced through the module's
    call and would silently run eager. DTensor + compile on CPU gives wrong gradients: refused."""
    if distributed and device_type == "cpu":
        raise ValueError(
            "parallel.compile with FSDP2/TP on CPU gives wrong gradients (docs/training-at-scale.md, torch.compile): compile single-process on CPU, or on GPU"
        )
    for block in blocks:
        block.forward = torch.compile(block.forward)


def float8_filter(min_dim: int):
    """Which Linears torchao converts to float8 (torchtitan's rule): those of the DiT blocks only, so the
    first layers (patch, timestep and text embedders, the text refiner) and the last (the final layer)
    stay bf16, and of those only the large ones: both sides at least `min_dim` and multiples of 16 (the
    float8 matmul's alignment); on a small projection float8's casts cost more than the matmul saves."""

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or not f".{fqn}".startswith(".dit.blocks."):
            return False
        sides = (module.in_features, module.out_features)
        return min(sides) >= min_dim and all(n % 16 == 0 for n in sides)

    return keep


def apply_float8(model: nn.Module, cfg: ParallelConfig, device_type: str) -> int:
    """torchao float8 training for the DiT blocks' large Linears; returns how many were converted.
    A machine without CUDA or torchao is refused before this (training/core/gpu_settings.py); here too, so it
    can never quietly run in bf16."""
    if device_type != "cuda":
        raise ValueError("parallel.float8 needs a CUDA device (capability 8.9+); this run is on " + device_type)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    keep = float8_filter(cfg.float8_min_dim)
    n = sum(keep(m, name) for name, m in model.named_modules())
    if n == 0:
        raise ValueError(
            f"parallel.float8: no DiT Linear has both sides >= float8_min_dim={cfg.float8_min_dim}; lower it or turn float8 off"
        )
    convert_to_float8_training(
        model, module_filter_fn=keep, config=Float8LinearConfig.from_recipe_name(cfg.float8_recipe)
    )
    log.info("parallel.float8: %d Linears in float8 (%s scaling)", n, cfg.float8_recipe)
    return n


# ---------------------------------------------------------------------------------------------- FSDP
def mixed_precision(bf16: bool):
    """bf16: bf16 compute parameters (all-gathered in bf16) with fp32 gradient reduction; the sharded master
    weights and the optimiser stay fp32. Else fp32 throughout."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(model: nn.Module, dp_mesh, device_type: str, bf16: bool | None = None) -> None:
    """FSDP2 per block, then the root. `bf16` (default: on CUDA) is the mixed-precision policy; CPU runs fp32,
    the bf16 policy runs on CPU too (gloo), which is how tests/test_gpu_paths.py checks it."""
    from torch.distributed.fsdp import fully_shard

    mp = mixed_precision(device_type == "cuda" if bf16 is None else bf16)
    blocks = list(model.text_fusion.refiner) + list(model.dit.blocks)
    for i, block in enumerate(blocks):
        # the last block's parameters are needed at once by backward: keeping them unsharded saves an all-gather
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)


def parallelize(model: nn.Module, mesh, cfg: ParallelConfig, device_type: str) -> nn.Module:
    """Apply TP, activation checkpointing, compile and FSDP2 to a Generator (in place) and return it.

    `mesh=None` is the single-process path: only checkpointing / compile / float8 apply (async TP needs tp > 1)."""
    if cfg.float8:
        apply_float8(model, cfg, device_type)
    distributed = mesh is not None
    if distributed and mesh["tp"].size() > 1:
        apply_tp(model, mesh["tp"], cfg.sequence_parallel)
        if cfg.async_tp:
            from training.core.gpu_settings import enable_async_tp

            enable_async_tp(mesh["tp"])
    blocks = [model.text_fusion.refiner, model.dit.blocks]
    for group in blocks:
        apply_activation_checkpointing(group, cfg.activation_checkpointing)
    if cfg.compile:
        for group in blocks:
            apply_compile(group, device_type, distributed)
    if distributed:
        apply_fsdp(model, mesh["dp_shard"], device_type)
    return model
