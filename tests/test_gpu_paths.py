"""The GPU paths (float8, async TP, attention backends, device=cuda), checked where no GPU is.

GPU-only settings (float8, async TP, a fused attention backend, device=cuda) fail with the key named: in the
schema when any machine can see the contradiction, and at the start of a run when this machine lacks what
they need; they never quietly become something else. Activation checkpointing and per-block compile give
the loss the plain model gives; per-rank step times flag a straggler; the GPU acceptance run
(scripts/gpu-check.sh) runs its plumbing on CPU with --dry-run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from kiln.config import ConfigError, load_config
from training.core.gpu_settings import Machine, check_gpu_settings, gpu_setting_problems

ROOT = Path(__file__).resolve().parents[1]
H100 = Machine(cuda=True, capability=(9, 0), gpu_name="NVIDIA H100 80GB HBM3", torchao=True, symmetric_memory=True)
NO_GPU = Machine(
    cuda=False, capability=None, gpu_name=None, torchao=False, symmetric_memory=True
)  # this CI machine, or any CPU box
A100 = Machine(cuda=True, capability=(8, 0), gpu_name="NVIDIA A100-SXM4-80GB", torchao=True, symmetric_memory=True)


def problems_on(machine: Machine, *overrides: str) -> list[tuple[str, str]]:
    """(key, problem) lines of the refusal `check_gpu_settings` gives the config on `machine`."""
    cfg = load_config(list(overrides))
    try:
        check_gpu_settings(cfg, machine)
    except ConfigError as e:
        return [tuple(line.strip().split(": ", 1)) for line in str(e).splitlines()[1:]]
    return []


# ------------------------------------------------------------------------------ config validation
@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["train.parallel.float8=true"], "parallel.float8 is GPU-only"),
        (["train.device=cuda", "train.parallel.async_tp=true"], "needs tp > 1 and compile=true"),
        (
            ["train.parallel.async_tp=true", "train.parallel.tp=2", "train.parallel.compile=true"],
            "async_tp is GPU-only",
        ),
        (["train.parallel.attention=fastest"], "'auto', 'flash', 'cudnn', 'efficient' or 'math'"),
        (
            ["train.parallel.float8=true", "train.device=cuda", "train.parallel.float8_recipe=blockwise"],
            "'tensorwise' or 'rowwise'",
        ),
    ],
)
def test_a_gpu_only_setting_that_contradicts_the_config_fails_at_load_naming_its_source(overrides, says):
    with pytest.raises(ConfigError, match="invalid kiln config") as e:
        load_config(overrides)
    assert says in str(e.value) and f"override '{overrides[-1]}'" in str(e.value)


def test_on_a_machine_without_cuda_every_gpu_only_setting_refuses_the_run():
    assert problems_on(NO_GPU, "train.device=cuda") == [("train.device", "cuda but this machine has no CUDA device")]
    float8 = problems_on(NO_GPU, "train.device=cuda", "train.parallel.float8=true")
    assert (
        "train.parallel.float8",
        "float8 needs a CUDA device of capability 8.9+ and this machine has none",
    ) in float8
    assert ("train.parallel.float8", "float8 needs torchao: pip install 'kiln[gpu]'") in float8
    async_tp = problems_on(
        NO_GPU,
        "train.device=cuda",
        "train.parallel.tp=2",
        "train.parallel.compile=true",
        "train.parallel.async_tp=true",
    )
    assert ("train.parallel.async_tp", "async TP needs CUDA and torch.distributed._symmetric_memory") in async_tp
    flash_on_cuda = dict(problems_on(NO_GPU, "train.device=cuda", "train.parallel.attention=flash"))
    assert (
        flash_on_cuda["train.parallel.attention"]
        == "the flash SDPA backend was asked for on cuda and this machine has no CUDA device"
    )


def test_an_attention_backend_without_a_kernel_for_the_dit_s_attention_refuses_the_run():
    for backend in ("efficient", "cudnn"):  # CUDA-only kernels, asked for on the CPU
        ((key, why),) = problems_on(NO_GPU, f"train.parallel.attention={backend}")
        assert (
            key == "train.parallel.attention"
            and f"SDPA backend {backend} has no kernel on cpu" in why
            and "key-mask bias" in why
        )
    for backend in ("auto", "math", "flash"):  # flash has a CPU kernel
        assert problems_on(NO_GPU, f"train.parallel.attention={backend}") == []


def test_float8_needs_capability_8_9_and_torchao():
    tc = load_config(["train.device=cuda", "train.parallel.float8=true"]).train
    assert gpu_setting_problems(tc, H100, head_dim=64) == []
    ((key, why),) = gpu_setting_problems(tc, A100, head_dim=64)
    assert key == "train.parallel.float8" and "NVIDIA A100-SXM4-80GB is 8.0" in why
    no_torchao = Machine(cuda=True, capability=(9, 0), gpu_name="H100", torchao=False, symmetric_memory=True)
    assert gpu_setting_problems(tc, no_torchao, head_dim=64) == [
        ("train.parallel.float8", "float8 needs torchao: pip install 'kiln[gpu]'")
    ]


def test_the_trainer_refuses_a_setting_this_machine_cannot_run_before_it_touches_data_or_output(tmp_path):
    from training.core.trainer import train

    cfg = load_config(["train.parallel.attention=efficient"])  # no CPU kernel, on any machine
    with pytest.raises(ConfigError, match="train.parallel.attention: SDPA backend efficient has no kernel on cpu"):
        train(tmp_path / "no_data", tmp_path / "ckpt", cfg)
    assert not (tmp_path / "ckpt").exists()


def test_float8_is_never_skipped_quietly_off_cuda(text_encoder_dir):
    from kiln.config import ParallelConfig
    from model.testing import micro_model_config
    from training.core.parallel import apply_float8
    from training.core.trainer import init_generator

    gen = init_generator(micro_model_config(text_encoder_dir), 0)
    with pytest.raises(ValueError, match="parallel.float8 needs a CUDA device"):
        apply_float8(gen, ParallelConfig(float8=True), "cpu")


def test_float8_converts_only_the_large_linears_inside_the_dit_blocks(text_encoder_dir):
    """torchtitan's rule: the first layers (embedders, text refiner) and the last (final layer) stay bf16,
    and so do projections with a side below float8_min_dim (or not a multiple of 16)."""
    from model.testing import micro_model_config
    from training.core.parallel import float8_filter
    from training.core.trainer import init_generator

    gen = init_generator(micro_model_config(text_encoder_dir), 0)  # width 64, SwiGLU hidden 192
    linears = {name: m for name, m in gen.named_modules() if isinstance(m, torch.nn.Linear)}
    converted = {name for name, m in linears.items() if float8_filter(16)(m, name)}
    assert converted and all(name.startswith("dit.blocks.") for name in converted)
    assert any(not name.startswith("dit.blocks.") for name in linears)  # there were first / last layers to leave out
    assert {name for name, m in linears.items() if float8_filter(128)(m, name)} == {
        n for n in converted if min(linears[n].in_features, linears[n].out_features) >= 128
    }
    assert not any(float8_filter(1024)(m, name) for name, m in linears.items())  # the default: nothing of a micro model


# ----------------------------------------------------------------- checkpointing and compile equality
def _steps(
    te_dir: str, parallel: dict, steps: int = 3, rows: slice = slice(None), dp_size: int = 1, prepare=None
) -> tuple[list[float], dict]:
    """`steps` optimiser steps of a perturbed micro Generator on fixed batches of 4: the losses and the final
    weights. `prepare(gen)` shards it; then `rows` are this rank's share of `dp_size`."""
    from kiln.config import TrainConfig
    from model.testing import micro_model_config
    from model.text_encoder import TextBatch
    from training.core.muon import make_optimizer
    from training.core.parallel import parallelize
    from training.core.trainer import Learner, Runtime, StepBatch, init_generator, step_generator, train_step

    torch.set_num_threads(1)
    tc = TrainConfig(lr=1e-2, caption_dropout=0.25, parallel=parallel)
    gen = init_generator(micro_model_config(te_dir), 0)
    with torch.no_grad():  # off the zero-closing init, so every block gets a gradient
        g = torch.Generator().manual_seed(7)
        for p in gen.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    parallelize(gen, None, tc.parallel, "cpu")
    if prepare is not None:
        prepare(gen)
    opt = make_optimizer(gen, tc)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        x0 = torch.randn(4, 3, 16, 16, generator=g)
        mask = torch.ones(4, 16, dtype=torch.bool)
        mask[:, 10:] = False
        text = TextBatch(torch.randn(4, 3, 16, 32, generator=g), mask)
        null = TextBatch(torch.zeros(4, 3, 16, 32), torch.ones(4, 16, dtype=torch.bool))
        cpu = Runtime(torch.device("cpu"), None)
        losses.append(
            train_step(
                Learner(gen, opt, tc, cpu, dp_size), StepBatch(x0, text, null), step_generator(0, step), 1e-2, 1.0, rows
            ).loss
        )
    return losses, {k: v.detach().clone() for k, v in gen.state_dict().items()}


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_trains_as_the_plain_model_does(text_encoder_dir, mode):
    plain_losses, plain = _steps(str(text_encoder_dir), {})
    losses, weights = _steps(str(text_encoder_dir), {"activation_checkpointing": mode})
    assert losses == pytest.approx(plain_losses, rel=1e-6, abs=1e-7)
    assert plain.keys() == weights.keys()  # the wrapped forward leaves the parameter names alone
    for k in plain:
        torch.testing.assert_close(weights[k], plain[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_per_block_compile_trains_as_the_eager_model_does(text_encoder_dir):
    """Inductor on CPU: minutes the first time on 2 cores, seconds from its cache after."""
    from torch._dynamo.utils import counters

    plain_losses, plain = _steps(str(text_encoder_dir), {})
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    losses, weights = _steps(
        str(text_encoder_dir), {"compile": True, "activation_checkpointing": "selective"}
    )  # as the ladder's rungs run
    assert counters["stats"]["unique_graphs"] > graphs  # the checkpointed blocks did run compiled, not silently eager
    assert sum(counters["graph_break"].values()) == breaks  # each block is one graph
    assert losses == pytest.approx(plain_losses, rel=1e-4, abs=1e-5)
    for k in plain:
        torch.testing.assert_close(weights[k], plain[k], rtol=1e-3, atol=1e-4)


def test_the_math_attention_backend_trains_as_torch_s_choice_does(text_encoder_dir):
    from training.core.gpu_settings import attention_context

    plain_losses, _ = _steps(str(text_encoder_dir), {})
    with attention_context("math"):
        losses, _ = _steps(str(text_encoder_dir), {"attention": "math"})
    assert losses == pytest.approx(plain_losses, rel=1e-5, abs=1e-6)


# ------------------------------------------------------------------------------------ stragglers
def test_a_rank_slower_than_the_median_by_the_factor_is_a_straggler():
    from training.core.stragglers import find_stragglers

    assert find_stragglers([1.0, 1.02, 0.98, 1.01], 1.5) == []
    assert find_stragglers([1.0, 1.02, 2.1, 1.01], 1.5) == [2]
    assert find_stragglers([1.0, 1.02, 2.1, 1.01], 2.5) == []  # the factor is the configured one
    assert find_stragglers([1.0, 3.0, 1.0, 3.5, 1.0, 1.0], 1.5) == [1, 3]
    assert find_stragglers([1.0, 1.0, 1.0, 10.0, 1.6], 1.5) == [
        3,
        4,
    ]  # against the median: one very slow rank does not hide a slow one
    assert find_stragglers([5.0], 1.5) == []  # one rank has no peers to lag behind


def test_telemetry_records_each_rank_s_time_and_flags_the_straggler(tmp_path):
    from training.core.stragglers import find_stragglers
    from training.core.telemetry import StepRecord, Telemetry

    tel = Telemetry(tmp_path)
    for step, seconds in enumerate(([0.5, 0.51], [0.5, 1.4]), start=1):
        tel.log(
            StepRecord(
                step,
                1.0,
                1.0,
                1e-3,
                4,
                64,
                max(seconds),
                rank_seconds=seconds,
                stragglers=find_stragglers(seconds + [0.5], 1.5),
            )
        )
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["stragglers"] for r in rows] == [[], [1]] and rows[1]["rank_seconds"] == [0.5, 1.4]
    assert tel.finish()["straggler_steps"] == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, delays: list[float], out: str) -> None:
    from training.core.distributed import init_distributed
    from training.core.stragglers import find_stragglers, gather_rank_seconds

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank))
    import torch.distributed as dist

    init_distributed("cpu", timeout_s=42)
    timeout = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options._timeout
    seconds = gather_rank_seconds(delays[rank], torch.device("cpu"))  # the injected per-rank delay
    if rank == 0:
        Path(out).write_text(
            json.dumps(
                {"seconds": seconds, "stragglers": find_stragglers(seconds, 1.5), "timeout_s": timeout.total_seconds()}
            )
        )
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_per_rank_times_are_gathered_and_the_injected_straggler_flagged_with_the_configured_watchdog(tmp_path):
    out = tmp_path / "rank0.json"
    delays = [0.20, 0.21, 0.95]
    torch.multiprocessing.spawn(_rank, args=(3, _free_port(), delays, str(out)), nprocs=3, join=True)
    got = json.loads(out.read_text())
    assert got == {"seconds": delays, "stragglers": [2], "timeout_s": 42.0}


# ----------------------------------------------------------------------------- bf16 under FSDP2
def _bf16_rank(rank: int, world: int, port: int, te_dir: str, out: str) -> None:
    import torch.distributed as dist

    from training.core.parallel import apply_fsdp, build_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    report = {}
    for bf16 in (False, True):
        compute = set()

        def shard(gen, bf16=bf16, compute=compute):
            for block in gen.dit.blocks:  # the dtype each block computes with, seen from inside its forward
                block.attn.qkvg.register_forward_hook(lambda m, a, o: compute.add(str(m.weight.dtype)))
            apply_fsdp(gen, build_mesh(world, 1, "cpu")["dp_shard"], "cpu", bf16=bf16)

        losses, weights = _steps(te_dir, {}, rows=slice(2 * rank, 2 * rank + 2), dp_size=world, prepare=shard)
        master = {str(v.dtype) for v in weights.values() if v.is_floating_point()}
        report["bf16" if bf16 else "fp32"] = {"losses": losses, "compute": sorted(compute), "master": sorted(master)}
    if rank == 0:
        Path(out).write_text(json.dumps(report))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_bf16_mixed_precision_computes_in_bf16_and_keeps_fp32_master_weights(text_encoder_dir, tmp_path):
    """The GPU policy, run on CPU through gloo: bf16 parameters inside each block's forward, fp32 reduction,
    fp32 sharded master weights; the losses follow the fp32 run within bf16's precision."""
    out = tmp_path / "bf16.json"
    torch.multiprocessing.spawn(
        _bf16_rank, args=(2, _free_port(), str(text_encoder_dir), str(out)), nprocs=2, join=True
    )
    got = json.loads(out.read_text())
    assert got["fp32"]["compute"] == ["torch.float32"] and got["bf16"]["compute"] == ["torch.bfloat16"]
    assert got["fp32"]["master"] == got["bf16"]["master"] == ["torch.float32"]
    assert got["bf16"]["losses"] != got["fp32"]["losses"]  # it did compute in bf16
    assert got["bf16"]["losses"] == pytest.approx(got["fp32"]["losses"], rel=2e-2)


# ----------------------------------------------------------------------------- hang diagnostics
def test_a_gpu_training_job_sets_the_nccl_flight_recorder_and_the_profile_can_override_it(tmp_path):
    from slurm.profiles import executor_parameters

    gpu = load_config(["cluster=h200", f"++cluster.log_dir={tmp_path}"]).cluster
    setup = executor_parameters(gpu, "train", "t")["slurm_setup"]
    assert 'export TORCH_NCCL_DUMP_ON_TIMEOUT="1"' in setup and 'export TORCH_NCCL_TRACE_BUFFER_SIZE="2000"' in setup
    assert f'export TORCH_FR_DUMP_TEMP_FILE="{tmp_path.resolve()}/$SLURM_JOB_ID/nccl_trace_rank_"' in setup
    assert not any(
        "TORCH_NCCL_DUMP_ON_TIMEOUT" in line for line in executor_parameters(gpu, "array", "a").get("slurm_setup", [])
    )  # data stages use no NCCL
    cpu = load_config(["cluster=test", f"++cluster.log_dir={tmp_path}"]).cluster
    assert not any(
        "TORCH_NCCL_DUMP_ON_TIMEOUT" in line for line in executor_parameters(cpu, "train", "t").get("slurm_setup", [])
    )
    mine = gpu.model_copy(update={"env": {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}})
    setup = executor_parameters(mine, "train", "t")["slurm_setup"]
    assert (
        "export TORCH_NCCL_TRACE_BUFFER_SIZE=50" in setup and 'export TORCH_NCCL_TRACE_BUFFER_SIZE="2000"' not in setup
    )


# -------------------------------------------------------------------------------- the GPU check
def test_the_gpu_check_shards_tp_over_the_gpus_it_finds():
    from training.gpu_check import tp_degree

    assert [tp_degree(n, kv_heads=4) for n in (1, 2, 4, 8, 16)] == [1, 2, 2, 4, 4]
    assert tp_degree(8, kv_heads=2) == 2 and tp_degree(3, kv_heads=4) == 1


@pytest.mark.slow
@pytest.mark.distributed
def test_the_gpu_check_dry_run_exercises_its_plumbing_on_cpu(tmp_path):
    report_path = tmp_path / "report.json"
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gpu-check.sh"), "--dry-run", "--out", str(report_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["dry_run"] and report["environment"]["torch"] == torch.__version__
    run = report["parallel"]
    assert (
        run["status"] == "ok"
        and run["processes"] == 2
        and run["losses_finite"]
        and len(run["rank_seconds_last_step"]) == 2
    )
    assert run["throughput"]["tokens_per_s"] > 0
    if not torch.cuda.is_available():  # the float8 section records the refusal this machine gives
        assert report["float8"]["status"] == "skipped" and "train.parallel.float8" in report["float8"]["refusal"]
    assert report["largest_fit"]["status"] == "ok" and report["largest_fit"]["largest"]["fits"]
    assert report["attention"]["problems"]["math"] is None


def test_without_a_gpu_the_real_check_says_so_and_fails(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks a machine without CUDA")
    from training.gpu_check import main

    assert main(["--out", str(tmp_path / "r.json")]) == 1
    assert "no CUDA device" in json.loads((tmp_path / "r.json").read_text())["error"]


def test_every_rung_of_the_gpu_ladder_composes_here_and_only_the_run_checks_the_machine(krea):
    """The krea ladder's rungs (device=cuda, float8 on some) are config a login node composes and validates;
    the machine check belongs to the run, which names each setting a machine without CUDA cannot honour."""
    from kiln.ladder import all_rungs, rung_base

    no_gpu = Machine(cuda=False, capability=None, gpu_name=None, torchao=False, symmetric_memory=False)
    rungs = all_rungs(load_config(krea))
    assert [r.name for r in rungs] == ["pretrain_256", "pretrain_512", "pretrain_1024", "midtrain", "sft"]
    for rung in rungs:
        cfg = load_config(rung_base(rung, krea))
        assert cfg.train.device == "cuda", rung.name
        with pytest.raises(ConfigError, match="train.device: cuda but this machine has no CUDA device") as refusal:
            check_gpu_settings(cfg, no_gpu)
        assert ("train.parallel.float8" in str(refusal.value)) == cfg.train.parallel.float8, rung.name
