"""The GPU acceptance run behind `scripts/gpu-check.sh`: one command on a GPU machine, one JSON report.

Sections, each recorded as `ok`, `skipped` (with the reason) or `failed` (with the error), so one broken
path does not hide the others:
  * environment: driver, CUDA, cuDNN, NCCL, torch / torchao versions, each GPU's model, capability, memory;
  * attention: which SDPA backends (train.parallel.attention) have a kernel for the DiT's attention here;
  * parallel: the real trainer (training.core.trainer.train) under torchrun over all local GPUs: FSDP2 x TP
    (tp = the largest of 4, 2 that divides the GPU count; one GPU runs unsharded), bf16 autocast, per-block
    torch.compile, NVML telemetry every step; tokens/s, MFU against the GPU's bf16 peak, per-rank step times;
  * float8: the 1.2B class (prx_1b) with and without torchao float8 on one GPU, when the GPU has
    capability 8.9+ (else skipped, and the refusal the config gives there is recorded);
  * largest_fit: the largest model size whose training step (AdamW, fp32 master weights, bf16 autocast)
    fits one GPU at 256 px, with its largest batch size and peak memory.

Images are 256 px in pixel space with 16 px patches: 256 image tokens, what a latent model sees at 256 px
through an 8x autoencoder and 2x2 patches. The text encoder is a small random BERT (it is frozen and
cached; its FLOPs are not counted). `--dry-run` runs every section's plumbing on CPU in seconds: gloo
instead of NCCL, the micro size at 32 px, no compile; tests/test_gpu_paths.py runs it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

FIT_SIZES = ("small", "prx_1b", "krea2_12b")  # ascending; the first that does not fit ends the search
ADAMW_BYTES_PER_PARAM = 16  # fp32 weight + grad + AdamW's two moments
PARALLEL_CAP_S, FLOAT8_RUN_CAP_S = 200.0, 200.0  # a hung or slow compile fails its section, not the whole check


def environment() -> dict:
    import torch

    env = {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": [],
    }
    try:
        import torchao

        env["torchao"] = torchao.__version__
    except ImportError:
        env["torchao"] = None
    if not torch.cuda.is_available():
        return env
    env["cudnn"] = torch.backends.cudnn.version()
    env["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        env["gpus"].append(
            {
                "index": i,
                "name": p.name,
                "capability": f"{p.major}.{p.minor}",
                "memory_gib": round(p.total_memory / 2**30, 1),
                "sms": p.multi_processor_count,
            }
        )
    try:
        import pynvml

        pynvml.nvmlInit()
        env["driver"] = pynvml.nvmlSystemGetDriverVersion()
    except Exception as e:  # NVML missing: the report says so rather than failing the environment
        env["driver"] = f"unknown ({e})"
    return env


# ------------------------------------------------------------------------------------------ configs
def run_config(te_dir: Path, size: str, device: str, px: int, steps: int, batch: int, parallel: dict, dry_run: bool):
    """A KilnConfig for a short real training run at `px` pixels."""
    from kiln.config import KilnConfig, ModelConfig, PostConfig, TextEncoderConfig, TrainConfig

    te = TextEncoderConfig(path=str(te_dir), max_length=16 if dry_run else 32, layers=[-1, -2], refiner_layers=1)
    model = ModelConfig(size=size, patch_size=2 if dry_run else 16, in_channels=3, pad_to_multiple=16, text_encoder=te)
    train = TrainConfig.model_validate(
        {
            "steps": steps,
            "batch_size": batch,
            "lr": 1e-4,
            "warmup_steps": 1,
            "holdout": 0,
            "log_every": 0,
            "device": device,
            "threads": 1 if dry_run else None,
            "parallel": parallel,
            "telemetry": {"gpu_every": 1},
            "dcp": {"async_save": False},
        }
    )
    return KilnConfig(model=model, train=train, post=PostConfig(judge="demo_pixel"))


def write_train_set(folder: Path, px: int, rows: int, batch: int) -> Path:
    from training.testing import scene_rows, write_pack_output

    return write_pack_output(folder, scene_rows(rows, seed=0, buckets=((px, px),), batch_size=batch))


# ------------------------------------------------------------------------------------------ runs
def torchrun(cfg, data: Path, out: Path, nproc: int, timeout_s: float) -> dict:
    """The real trainer over `nproc` local processes; its throughput.json and last metrics row."""
    spec = out.parent / f"{out.name}.spec.json"
    spec.write_text(json.dumps({"cfg": cfg.model_dump(mode="json"), "data": str(data), "out": str(out)}))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "training.gpu_check",
        "--worker",
        str(spec),
    ]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode:
        raise RuntimeError(f"torchrun exited {proc.returncode}: {(proc.stderr or proc.stdout)[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    peaks = [json.loads(p.read_text())["peak_gib"] for p in sorted(out.glob("peak_memory_rank*.json"))]
    last = rows[-1]
    return {
        "wall_s": round(time.perf_counter() - started, 1),
        "throughput": json.loads((out / "throughput.json").read_text()),
        "losses": [r["loss"] for r in rows],
        "losses_finite": all(math.isfinite(r["loss"]) for r in rows),
        "rank_seconds_last_step": last.get("rank_seconds"),
        "straggler_steps": sum(bool(r.get("stragglers")) for r in rows),
        "nvml_last_step": {k: v for k, v in last.items() if k.startswith("gpu_")},
        "peak_memory_gib_per_rank": peaks,
    }


def worker(spec_path: str) -> None:
    """One torchrun rank: train, then record this rank's peak GPU memory."""
    import torch
    import torch.distributed as dist

    from kiln.config import KilnConfig
    from training.core.trainer import train

    spec = json.loads(Path(spec_path).read_text())
    cfg = KilnConfig.model_validate(spec["cfg"])
    out = Path(spec["out"])
    rank = int(os.environ.get("RANK", "0"))
    train(Path(spec["data"]), out, cfg, overwrite=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    (out / f"peak_memory_rank{rank}.json").write_text(
        json.dumps({"rank": rank, "peak_gib": round(peak, 2) if peak is not None else None})
    )
    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ sections
def tp_degree(gpus: int, kv_heads: int) -> int:
    """The parallel section's TP degree: the largest of 4, 2 that divides the GPU count and kv_heads and
    leaves two or more data-parallel shards; two GPUs run tp=2; one GPU runs unsharded."""
    for tp in (4, 2):
        if gpus % tp == 0 and kv_heads % tp == 0 and gpus // tp >= 2:
            return tp
    return 2 if gpus == 2 and kv_heads % 2 == 0 else 1


def dit_params(model_cfg) -> int:
    """The DiT's parameter count, built on the meta device (no memory, no time)."""
    import torch

    from model.dit import DiT
    from model.generator import resolve_dit_config

    with torch.device("meta"):
        return sum(p.numel() for p in DiT(resolve_dit_config(model_cfg)).parameters())


def parallel_section(ctx: dict) -> dict:
    from model.sizes import get_size

    if ctx["dry_run"]:
        nproc, size, px, steps, batch, parallel = 2, "micro", 32, 2, 4, {"tp": 1, "compile": False}
    else:
        import torch

        nproc, size, px, steps, batch = torch.cuda.device_count(), "prx_1b", 256, 12, 8 * torch.cuda.device_count()
        tp = tp_degree(nproc, get_size(size).kv_heads)
        parallel = {"tp": tp, "sequence_parallel": tp > 1, "compile": True, "activation_checkpointing": "selective"}
    cfg = run_config(ctx["te"], size, ctx["device"], px, steps, batch, parallel, ctx["dry_run"])
    data = write_train_set(ctx["work"] / "parallel_data", px, batch * 2, batch)
    result = torchrun(cfg, data, ctx["work"] / "parallel_run", nproc, min(ctx["left"](), PARALLEL_CAP_S))
    return {
        "status": "ok",
        "size": size,
        "px": px,
        "processes": nproc,
        "parallel": parallel,
        "global_batch": batch,
        "steps": steps,
    } | result


def float8_section(ctx: dict) -> dict:
    from kiln.config import ConfigError
    from training.core.gpu_settings import FLOAT8_MIN_CAPABILITY, Machine, check_gpu_settings

    machine = Machine.probe()
    size = "micro" if ctx["dry_run"] else "prx_1b"
    px, steps, batch = (32, 3, 4) if ctx["dry_run"] else (256, 12, 16)
    on = {"float8": True, "compile": not ctx["dry_run"]}
    cfg = run_config(ctx["te"], size, "cuda", px, steps, batch, on, ctx["dry_run"])
    try:
        check_gpu_settings(cfg, machine)
    except ConfigError as e:
        cap = ".".join(map(str, FLOAT8_MIN_CAPABILITY))
        return {
            "status": "skipped",
            "reason": f"needs a CUDA device of capability {cap}+ and torchao",
            "refusal": str(e),
        }
    data = write_train_set(ctx["work"] / "float8_data", px, batch * 2, batch)
    runs = {}
    for name, parallel in (("bf16", {"compile": True}), ("float8", on)):
        runs[name] = torchrun(
            run_config(ctx["te"], size, "cuda", px, steps, batch, parallel, False),
            data,
            ctx["work"] / f"float8_{name}",
            1,
            min(ctx["left"](), FLOAT8_RUN_CAP_S),
        )
    speedup = runs["float8"]["throughput"]["tokens_per_s"] / max(runs["bf16"]["throughput"]["tokens_per_s"], 1e-9)
    return {
        "status": "ok",
        "size": size,
        "px": px,
        "batch": batch,
        "steps": steps,
        "tokens_per_s_speedup": round(speedup, 3),
    } | runs


def largest_fit_section(ctx: dict) -> dict:
    """On one device, for each size in FIT_SIZES: skip it if its weights, grads and AdamW states alone
    exceed the device's memory, else double the batch from 1 until a step runs out of memory."""
    import torch

    from kiln.config import ParallelConfig
    from training.core.muon import make_optimizer
    from training.core.parallel import parallelize
    from training.core.text_cache import TextCache
    from training.core.trainer import Learner, Runtime, StepBatch, init_generator, step_generator, train_step

    dry = ctx["dry_run"]
    device = torch.device(ctx["device"] if dry else "cuda:0")
    sizes, px, max_batch = (("micro",), 32, 2) if dry else (FIT_SIZES, 256, 512)
    total = torch.cuda.get_device_properties(0).total_memory if device.type == "cuda" else None
    runtime = Runtime(device, torch.bfloat16 if device.type == "cuda" else None)
    results, largest = [], None
    for size in sizes:
        cfg = run_config(ctx["te"], size, device.type, px, 1, 1, {}, dry)
        entry: dict = {"size": size}
        results.append(entry)
        params = dit_params(cfg.model)
        entry["dit_params"] = params
        if total and params * ADAMW_BYTES_PER_PARAM > 0.95 * total:
            entry |= {
                "fits": False,
                "why": f"weights, grads and AdamW states alone need {params * ADAMW_BYTES_PER_PARAM / 2**30:.0f} GiB of {total / 2**30:.0f} GiB (shard it: FSDP2)",
            }
            break
        gen = init_generator(cfg.model, 0, device)
        parallelize(gen, None, ParallelConfig(), device.type)
        opt = make_optimizer(gen, cfg.train)
        cache = TextCache(gen)
        batch, fitted = 1, None
        while batch <= max_batch and ctx["left"]() > 30:
            try:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                x0 = torch.randn(batch, 3, px, px, device=device)
                text = cache.batch(["a red circle on a blue background"] * batch, device)
                null = gen.null_text(batch)
                result = train_step(
                    Learner(gen, opt, cfg.train, runtime), StepBatch(x0, text, null), step_generator(0, 0), 1e-5, 1.0
                )
                peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
                fitted = {
                    "batch": batch,
                    "peak_memory_gib": round(peak, 2) if peak is not None else None,
                    "loss_finite": math.isfinite(result.loss),
                }
                batch *= 2
            except torch.OutOfMemoryError:
                break
        del gen, opt, cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
        entry |= {"fits": fitted is not None, "largest_batch": fitted}
        if fitted is None:
            break
        largest = entry
    return {"status": "ok", "px": px, "activation_checkpointing": "none", "largest": largest, "sizes": results}


def attention_section(ctx: dict) -> dict:
    """Which SDPA backends (train.parallel.attention) have a kernel here for the 1.2B class's attention
    (head_dim 128, GQA, key-mask bias) in the step's dtype: None, or why not."""
    import torch

    from model.sizes import get_size
    from training.core.gpu_settings import attention_kernel_problem

    size = get_size("prx_1b")
    dtype = torch.float32 if ctx["dry_run"] else torch.bfloat16
    backends = {
        name: attention_kernel_problem(
            name, ctx["device"], dtype, size.width // size.heads, size.kv_heads != size.heads
        )
        for name in ("flash", "cudnn", "efficient", "math")
    }
    return {"status": "ok", "dtype": str(dtype), "problems": backends}


SECTIONS = {
    "attention": attention_section,
    "parallel": parallel_section,
    "float8": float8_section,
    "largest_fit": largest_fit_section,
}


def run_check(out: Path, dry_run: bool, budget_s: float, only: list[str] | None = None) -> dict:
    import torch

    from model.testing import write_tiny_text_encoder

    started = time.perf_counter()
    report: dict = {"dry_run": dry_run, "budget_s": budget_s, "environment": environment()}
    if not dry_run and not torch.cuda.is_available():
        report["error"] = "no CUDA device: run on a GPU machine, or pass --dry-run to check the plumbing on CPU"
        out.write_text(json.dumps(report, indent=2) + "\n")
        return report
    with tempfile.TemporaryDirectory(prefix="kiln-gpu-check-") as tmp:
        work = Path(tmp)
        ctx = {
            "dry_run": dry_run,
            "device": "cpu" if dry_run else "cuda",
            "work": work,
            "te": write_tiny_text_encoder(work / "bert", layers=2),
            "left": lambda: budget_s - (time.perf_counter() - started),
        }
        for name, section in SECTIONS.items():
            if only and name not in only:
                continue
            t0 = time.perf_counter()
            if ctx["left"]() < 20:
                report[name] = {"status": "skipped", "reason": f"the {budget_s:.0f} s budget is spent"}
                continue
            try:
                report[name] = section(ctx)
            except Exception as e:
                report[name] = {
                    "status": "failed",
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()[-4000:],
                }
            report[name]["seconds"] = round(time.perf_counter() - t0, 1)
            out.write_text(json.dumps(report, indent=2) + "\n")  # a section at a time: a killed run keeps what it did
    report["seconds"] = round(time.perf_counter() - started, 1)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu-check.json", help="the JSON report")
    ap.add_argument(
        "--dry-run", action="store_true", help="the plumbing on CPU: gloo, the micro size, no compile or float8"
    )
    ap.add_argument("--budget-s", type=float, default=450.0, help="stop starting sections after this many seconds")
    ap.add_argument("--only", nargs="*", choices=sorted(SECTIONS), help="run only these sections")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # a torchrun rank of a run
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    report = run_check(Path(args.out), args.dry_run, args.budget_s, args.only)
    statuses = {name: report[name]["status"] for name in SECTIONS if name in report}
    print(
        json.dumps(
            {"report": args.out, "sections": statuses, **({"error": report["error"]} if "error" in report else {})}
        )
    )
    return 1 if "error" in report or "failed" in statuses.values() else 0


if __name__ == "__main__":
    sys.exit(main())
