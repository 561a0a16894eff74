"""Merging DCP checkpoints that two ranks saved sharded (FSDP2, and FSDP2 x TP) gives the same checkpoint,
byte for byte, as merging their gathered exports: each rank merges its own whole tensors from the step
folders, no rank gathers the model, and the tp row layout of a step is undone per tensor."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch

pytestmark = pytest.mark.distributed

METHODS = ("ties", "dare_ties", "task_arithmetic")
RUNS = {"base": (0, 1), "a": (1, 2), "b": (2, 1)}  # name: (seed, tp) -- a was trained with tp=2, the others FSDP only


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _generator(te_dir: str, seed: int):
    """A micro Generator whose heads and kv_heads split over tp=2, its weights moved by a seeded step."""
    from model.dit import DiTConfig
    from model.generator import Generator
    from model.testing import micro_model_config

    dit = DiTConfig(
        width=64, depth=2, heads=4, kv_heads=2, mlp_hidden=128, patch_size=2, in_channels=3, pad_to_multiple=16
    )
    torch.manual_seed(0)
    gen = Generator.build(micro_model_config(te_dir), dit)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in gen.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return gen


def _worker(rank: int, world: int, port: int, te_dir: str, root: str, key_file: str) -> None:
    import torch.distributed as dist

    from kiln.config import MergeConfig, ParallelConfig
    from training.core.checkpoint import write_export_manifest
    from training.core.data import DataPosition
    from training.core.dcp import Checkpointer, RunState
    from training.core.manifest import KEY_ENV
    from training.core.parallel import build_mesh, parallelize
    from training.post.merge import merge_dcp

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **{KEY_ENV: key_file})
    dist.init_process_group("gloo", rank=rank, world_size=world)
    steps = {}
    for name, (seed, tp) in RUNS.items():
        run = f"{root}/{name}"
        gen = _generator(te_dir, seed)
        if rank == 0:  # the gathered export: what the trainer writes at the end of a run
            gen.save_pretrained(run)
            write_export_manifest(run)
        dist.barrier()
        parallelize(gen, build_mesh(world, tp, "cpu"), ParallelConfig(tp=tp), "cpu")
        saver = Checkpointer(run, keep=1, async_save=False, mesh_facts={"tp": tp})
        steps[name] = saver.save(gen, torch.optim.AdamW(gen.parameters()), RunState(5, DataPosition()))
    for method in METHODS:
        cfg = MergeConfig(method=method, weights=[0.7, 0.3], density=0.5, scale=0.9, seed=3)
        merge_dcp([steps["a"], steps["b"]], steps["base"], f"{root}/merged-{method}", cfg)
    dist.destroy_process_group()


def test_merging_sharded_dcp_steps_equals_merging_their_gathered_exports(text_encoder_dir, tmp_path, monkeypatch):
    from kiln.config import MergeConfig
    from model.generator import Generator
    from training.core.checkpoint import verify_export
    from training.core.dcp import complete_checkpoints
    from training.core.manifest import KEY_ENV
    from training.post.merge import merge_exports

    key = tmp_path / "checkpoint.key"
    monkeypatch.setenv(KEY_ENV, str(key))
    torch.multiprocessing.spawn(
        _worker, args=(2, _free_port(), str(text_encoder_dir), str(tmp_path), str(key)), nprocs=2, join=True
    )
    assert json.loads((complete_checkpoints(tmp_path / "a")[0] / "train_state.json").read_text())["tp"] == 2
    for method in METHODS:
        cfg = MergeConfig(method=method, weights=[0.7, 0.3], density=0.5, scale=0.9, seed=3)
        sharded = tmp_path / f"merged-{method}"
        gathered = merge_exports(
            [tmp_path / "a", tmp_path / "b"], tmp_path / "base", tmp_path / f"gathered-{method}", cfg
        )
        assert (sharded / "model.safetensors").read_bytes() == (gathered / "model.safetensors").read_bytes(), method
        assert json.loads((sharded / "merge.json").read_text())["ranks"] == 2
        assert verify_export(sharded)
        assert not list(sharded.glob(".merge-part-*")), "the ranks' parts are joined and removed"
    merged = Generator.from_pretrained(tmp_path / "merged-ties").state_dict()
    base = Generator.from_pretrained(tmp_path / "base").state_dict()
    assert any(not torch.equal(merged[k], base[k]) for k in merged), "the merge moved the weights"
