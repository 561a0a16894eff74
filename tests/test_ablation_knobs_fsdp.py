"""The weight EMA under FSDP2 (2 gloo processes on CPU): each rank keeps and updates its own shards of the
average, which gathered equal the EMA one process computes, and a DCP step checkpoint saves and restores it."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch

pytestmark = pytest.mark.distributed

STEPS, DECAY = 2, 0.5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, te_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    from kiln.config import TrainConfig
    from model.testing import micro_model_config
    from model.text_encoder import TextBatch
    from training.core.data import DataPosition, local_rows
    from training.core.dcp import Checkpointer, RunState
    from training.core.ema import WeightEma
    from training.core.muon import make_optimizer
    from training.core.parallel import build_mesh, parallelize
    from training.core.trainer import Learner, Runtime, StepBatch, init_generator, step_generator, train_step

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = build_mesh(world, 1, "cpu")
    tc = TrainConfig(lr=1e-2, caption_dropout=0.0, ema_decay=DECAY)
    cfg = micro_model_config(te_dir)
    ref, sharded = init_generator(cfg, 0), init_generator(cfg, 0)
    parallelize(sharded, mesh, tc.parallel, "cpu")
    ema_ref, ema_sh = WeightEma(ref, DECAY), WeightEma(sharded, DECAY)
    opt_ref, opt_sh = make_optimizer(ref, tc), make_optimizer(sharded, tc)
    cpu = Runtime(torch.device("cpu"), None)
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(4, 3, 16, 16, generator=g)
    text = TextBatch(torch.randn(4, 3, 16, 32, generator=g), torch.ones(4, 16, dtype=torch.bool))
    null = TextBatch(torch.zeros(4, 3, 16, 32), torch.ones(4, 16, dtype=torch.bool))
    for step in range(STEPS):
        train_step(
            Learner(sharded, opt_sh, tc, cpu, world),
            StepBatch(x0, text, null),
            step_generator(0, step),
            tc.lr,
            1.0,
            local_rows(4, rank, world),
        )
        train_step(Learner(ref, opt_ref, tc, cpu), StepBatch(x0, text, null), step_generator(0, step), tc.lr, 1.0)
        ema_sh.update(sharded)
        ema_ref.update(ref)
    shards = ema_sh.averaged()
    local_is_a_shard = all(
        hasattr(t, "to_local") and t.to_local().numel() < t.numel()
        for t in shards.values()
        if t.dim() >= 1 and t.shape[0] >= world
    )
    gathered = {n: t.full_tensor() for n, t in shards.items()}
    diff = max(float((gathered[n] - ema_ref.averaged()[n]).abs().max()) for n in gathered)
    moved = max(
        float((ema_ref.averaged()[n] - p.detach()).abs().max()) for n, p in init_generator(cfg, 0).named_parameters()
    )

    ckpt = Checkpointer(out_dir, keep=2, async_save=False, aux={"ema": (ema_sh, [])})
    ckpt.save(sharded, opt_sh, RunState(STEPS, DataPosition()))
    dist.barrier()  # rank 0 marks the save complete (train_state.json) after the others wrote theirs
    with torch.no_grad():
        for t in ema_sh.averaged().values():
            t.to_local().zero_()
    assert ckpt.load_latest(sharded, opt_sh).step == STEPS
    restored = max(float((ema_sh.averaged()[n].full_tensor() - gathered[n]).abs().max()) for n in gathered)
    if rank == 0:
        with open(os.path.join(out_dir, "report.json"), "w") as f:
            json.dump({"diff": diff, "moved": moved, "sharded": local_is_a_shard, "restored": restored}, f)
    dist.barrier()
    dist.destroy_process_group()


def test_the_ema_keeps_each_ranks_shards_and_resumes_from_dcp(text_encoder_dir, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(2, _free_port(), str(text_encoder_dir), str(tmp_path)), nprocs=2, join=True)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["sharded"]  # each rank holds a shard of the average, not a full copy
    assert report["moved"] > 1e-4  # the average moved away from the initial weights...
    assert report["diff"] < 1e-5  # ...exactly as one process's EMA did
    assert report["restored"] == 0.0  # and the DCP checkpoint restored it
