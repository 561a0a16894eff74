"""FSDP2 x TP on a 2 x 2 CPU mesh (4 gloo processes) computes what one process computes.

Each rank trains a sharded copy and an unsharded reference from the same initial weights on the same
global batches; after several optimiser steps the losses and the gathered (canonical-layout) weights
must agree, for AdamW and Muon, with and without sequence parallelism."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch

pytestmark = pytest.mark.distributed

CASES = [("adamw", False), ("muon", True)]  # (optimiser, sequence parallel): one spawn, ~1 min on 2 cores
STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _generator(te_dir: str, seed: int):
    """A micro Generator whose heads and kv_heads split over tp=2, with every weight perturbed from its
    zero-closing init so that every parameter gets a gradient from the first step."""
    from model.dit import DiTConfig
    from model.generator import Generator
    from model.testing import micro_model_config

    cfg = micro_model_config(te_dir)
    dit = DiTConfig(
        width=64, depth=2, heads=4, kv_heads=2, mlp_hidden=128, patch_size=2, in_channels=3, pad_to_multiple=16
    )
    torch.manual_seed(seed)
    gen = Generator.build(cfg, dit)
    with torch.no_grad():
        for p in gen.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return gen


def _inputs(step: int):
    from model.text_encoder import TextBatch

    g = torch.Generator().manual_seed(100 + step)
    x0 = torch.randn(4, 3, 16, 16, generator=g)
    mask = torch.ones(4, 16, dtype=torch.bool)
    mask[:, 10 + step :] = False
    text = TextBatch(torch.randn(4, 3, 16, 32, generator=g), mask)
    null = TextBatch(torch.zeros(4, 3, 16, 32), torch.ones(4, 16, dtype=torch.bool))
    return x0, text, null


def _worker(rank: int, world: int, port: int, te_dir: str, out: str, cases: list) -> None:
    import torch.distributed as dist

    from kiln.config import ParallelConfig, TrainConfig
    from training.core.data import local_rows
    from training.core.distributed import full_model_state
    from training.core.muon import make_optimizer
    from training.core.parallel import build_mesh, parallelize
    from training.core.trainer import Learner, Runtime, StepBatch, step_generator, train_step

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = build_mesh(world, 2, "cpu")
    dp_rank, dp = mesh["dp_shard"].get_local_rank(), mesh["dp_shard"].size()
    report = {}
    for optim, sp in cases:
        tc = TrainConfig(
            lr=1e-2,
            caption_dropout=0.25,
            grad_clip=0.5,
            weight_decay=0.01,
            optim={"name": optim},
            parallel=ParallelConfig(tp=2, sequence_parallel=sp),
        )
        ref, sharded = _generator(te_dir, 0), _generator(te_dir, 0)
        init = {k: v.clone() for k, v in ref.state_dict().items()}
        parallelize(sharded, mesh, tc.parallel, "cpu")
        opt_ref, opt_sh = make_optimizer(ref, tc), make_optimizer(sharded, tc)
        losses = []
        for step in range(STEPS):
            x0, text, null = _inputs(step)
            cpu = Runtime(torch.device("cpu"), None)
            batch = StepBatch(x0, text, null)
            a = train_step(
                Learner(sharded, opt_sh, tc, cpu, dp),
                batch,
                step_generator(0, step),
                tc.lr,
                1.0,
                local_rows(4, dp_rank, dp),
            )
            b = train_step(Learner(ref, opt_ref, tc, cpu), batch, step_generator(0, step), tc.lr, 1.0)
            losses.append((a.loss, b.loss, a.grad_norm, b.grad_norm))
        full = full_model_state(sharded, 2)  # gathered on rank 0
        if rank != 0:
            continue
        ref_sd = ref.state_dict()
        moved = max(float((ref_sd[k] - init[k]).abs().max()) for k in ref_sd)
        diffs = {k: float((full[k] - ref_sd[k]).abs().max()) for k in ref_sd}
        diff = max(diffs.values())
        report[f"{optim}/sp={sp}"] = {
            "losses": losses,
            "max_weight_diff": diff,
            "max_moved": moved,
            "keys_equal": sorted(full) == sorted(ref_sd),
            "worst": sorted(diffs, key=diffs.get)[-3:],
        }
    if rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


def test_fsdp2_tp_on_a_2x2_cpu_mesh_matches_one_process(text_encoder_dir, tmp_path):
    out = tmp_path / "report.json"
    torch.multiprocessing.spawn(
        _worker, args=(4, _free_port(), str(text_encoder_dir), str(out), CASES), nprocs=4, join=True
    )
    report = json.loads(out.read_text())
    assert sorted(report) == sorted(f"{o}/sp={s}" for o, s in CASES)
    for case, r in report.items():
        assert r["keys_equal"], case
        assert r["max_moved"] > 1e-3, f"{case}: the weights did not train, the comparison would be empty"
        # fp32 reductions in another order: ~1e-7 in the loss; AdamW's normalised step turns that into
        # ~1e-5 on weights whose gradient is near zero (lr 1e-2); a wrong shard or reduction is >1e-2
        assert r["max_weight_diff"] < 2e-4, (
            f"{case}: sharded weights differ from one process by {r['max_weight_diff']} ({r['worst']})"
        )
        for sharded_loss, ref_loss, sharded_norm, ref_norm in r["losses"]:
            assert sharded_loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6), case
            assert sharded_norm == pytest.approx(ref_norm, rel=1e-5), case
