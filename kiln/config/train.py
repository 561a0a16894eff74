"""train: one training stage (a rung of the ladder): optimiser, schedule, parallelism, checkpoints, telemetry."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from kiln.config.base import (
    MAX_BATCH,
    MAX_ROWS,
    MAX_SIDE,
    MAX_STEPS,
    MAX_THREADS,
    PairError,
    Seed,
    Strict,
    check_order,
)


class SampleConfig(Strict):
    steps: int = Field(20, ge=1, le=10000)
    cfg_scale: float = Field(3.0, ge=0, le=100)
    seed: Seed = 0
    n_per_prompt: int = Field(4, ge=1, le=10000)
    shift: float | None = Field(
        None, gt=0, le=100, description="inference timestep shift; None = the training shift at the sampled resolution"
    )


class EvalConfig(Strict):
    """The first evaluation: held-out flow loss at fixed (t, noise), and attribute checks on demo prompts."""

    loss_timesteps: list[Annotated[float, Field(gt=0, lt=1)]] = Field(
        default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9],
        min_length=1,
        description="fixed t of the held-out loss, each in (0, 1)",
    )
    seed: Seed = Field(1234, description="seed of the held-out loss's fixed noise")
    n_per_prompt: int = Field(
        2, ge=1, le=10000, description="images generated per demo prompt for the attribute checks"
    )
    steps: int = Field(10, ge=1, le=10000, description="sampler steps for the attribute checks")


class ParallelConfig(Strict):
    """FSDP2 x TP layout and per-block execution options (training/core/parallel.py, docs/training-at-scale.md)."""

    tp: int = Field(1, ge=1, le=MAX_THREADS, description="tensor-parallel degree; dp_shard = world_size / tp")
    sequence_parallel: bool = Field(
        False, description="shard the residual stream over tp along the sequence between blocks"
    )
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    compile: bool = Field(False, description="torch.compile per block (CPU: single process only)")
    float8: bool = Field(
        False,
        description="torchao float8 training of the DiT blocks' large Linears; GPU-only: CUDA capability 8.9+ and torchao, else the run is refused",
    )
    float8_recipe: Literal["tensorwise", "rowwise"] = Field(
        "tensorwise", description="torchao float8 scaling: one scale per tensor (fastest) or per row (more accurate)"
    )
    float8_min_dim: int = Field(
        1024,
        ge=16,
        le=2**20,
        description="Linears with a side below this stay bf16 (float8's casts cost more than they save on small matmuls)",
    )
    attention: Literal["auto", "flash", "cudnn", "efficient", "math"] = Field(
        "auto",
        description="SDPA backend (torch.nn.attention.sdpa_kernel); auto = torch's choice; one the device lacks refuses the run",
    )
    async_tp: bool = Field(
        False,
        description="GPU-only: overlap TP collectives with matmuls (torch symmetric memory, inductor micro-pipelining); needs tp > 1 and compile",
    )
    watchdog_timeout_s: float = Field(
        600.0,
        ge=10,
        le=86400,
        description="process-group timeout: a collective stuck this long (an NCCL hang) fails the job, dumping the flight recorder",
    )


class OptimConfig(Strict):
    name: Literal["adamw", "muon"] = "adamw"
    muon_momentum: float = Field(0.95, ge=0, lt=1)
    muon_nesterov: bool = True
    muon_ns_steps: int = Field(5, ge=1, le=100, description="Newton-Schulz iterations")
    adam_eps: float = Field(1e-8, gt=0, le=1e-2, description="AdamW's epsilon (the denominator floor)")
    weights: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="how the weights are stored between steps: fp32 (master weights), or rounded to bf16 after every step (training.core.bf16_weights)",
    )


REPA_CLASSICAL = "classical"  # train.repa.teacher_path naming the hand-made descriptor instead of a model folder


class RepaConfig(Strict):
    """REPA / iREPA: align an intermediate block's image tokens with a frozen vision teacher's patch features."""

    teacher_path: str | None = Field(
        None,
        description="an HF vision model folder, or `classical`: the hand-made descriptor of model/image_encoders.py, one vector per image; None = REPA off",
    )
    block: int = Field(1, ge=0, le=1024, description="the DiT block whose output is aligned")
    weight: float = Field(0.5, ge=0, le=1000)
    steps: int = Field(
        0, ge=0, le=MAX_STEPS, description="REPA is on for the first `steps` optimiser steps; 0 = the whole run"
    )
    projector: Literal["mlp", "conv"] = Field(
        "mlp", description="mlp: REPA; conv: iREPA (conv projector + spatial normalisation)"
    )
    hidden: int = Field(256, ge=1, le=2**18, description="projector hidden width")

    @model_validator(mode="after")
    def _a_teacher_for_its_settings(self) -> "RepaConfig":
        """Settings for a REPA that has no teacher would leave it off without a word (the 256-px rung once did)."""
        if self.teacher_path is None:
            fields = type(self).model_fields
            changed = sorted(k for k in fields if k != "teacher_path" and getattr(self, k) != fields[k].default)
            if changed:
                raise ValueError(
                    f"sets {', '.join(changed)} but no teacher_path, so REPA would be off: name the teacher "
                    "(an HF vision model folder, or `classical`) or drop the settings"
                )
        return self


class RouteConfig(Strict):
    """TREAD-style token routing, training only: a random share of the image tokens skips blocks [start, end)."""

    frac: float = Field(0.0, ge=0, lt=1, description="share of image tokens that skip the span; 0 = off")
    start: int = Field(1, ge=0, le=1024, description="first block the routed tokens skip")
    end: int = Field(
        2, ge=1, le=1024, description="the block where they rejoin (exclusive end of the span; at most the depth)"
    )

    @model_validator(mode="after")
    def _span(self) -> RouteConfig:
        check_order("start", self.start, "end", self.end, strict=True)
        return self


class DCPConfig(Strict):
    every: int = Field(
        0, ge=0, le=MAX_STEPS, description="save a torch.distributed.checkpoint every N steps; 0 = only at the end"
    )
    keep: int = Field(3, ge=1, le=10000, description="keep the last K step checkpoints")
    async_save: bool = True
    trust_unsigned: bool = Field(
        False,
        description="resume from checkpoints whose checksum manifests this user's key did not sign (from elsewhere: their DCP metadata is a pickle; docs/training.md)",
    )
    allow_train_set_change: bool = Field(
        False, description="resume on another train set than the checkpoint was trained on"
    )


class TelemetryConfig(Strict):
    """What the trainer records besides the loss (training/core/telemetry.py, training/core/gpu_telemetry.py)."""

    spike_window: int = Field(
        50, ge=2, le=10**6, description="steps in the trailing window of the loss / grad-norm spike detector"
    )
    spike_z: float = Field(
        6.0, gt=0, le=1000, description="a value this many standard deviations above the window mean is a spike"
    )
    peak_tflops: float | None = Field(
        None, gt=0, le=1e6, description="one device's peak TFLOP/s for MFU; None = known GPUs from a table, else no MFU"
    )
    gpu_every: int = Field(10, ge=0, le=MAX_STEPS, description="record NVML counters every N steps on a GPU; 0 = never")
    straggler_factor: float = Field(
        1.5,
        gt=1,
        le=1000,
        description="a rank whose step took this many times the median rank's is flagged a straggler",
    )


class TrainConfig(Strict):
    steps: int = Field(1500, ge=1, le=MAX_STEPS)
    batch_size: int = Field(32, ge=1, le=MAX_BATCH)
    lr: float = Field(1e-3, gt=0, le=10)
    warmup_steps: int = Field(
        100, ge=0, le=MAX_STEPS, description="linear LR warmup; longer than the run: the whole run"
    )
    weight_decay: float = Field(0.0, ge=0, le=10)
    grad_clip: float = Field(1.0, ge=0, le=1e6, description="clip the global grad norm to this; 0 = no clipping")
    caption_dropout: float = Field(0.1, ge=0, le=1)
    timestep_shift: float = Field(1.0, gt=0, le=100, description="logit-normal timestep shift at the base resolution")
    log_every: int = Field(25, ge=0, le=MAX_STEPS, description="log every N steps; 0 = never")
    seed: Seed = 0
    device: str = "cpu"
    threads: int | None = Field(None, ge=1, le=MAX_THREADS, description="torch intra-op threads; None = all cores")
    decay_frac: float = Field(0.2, ge=0, le=1, description="share of the steps in the final linear LR decay (WSD)")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="LR at the end of the decay, as a share of lr")
    timestep_mean: float = Field(0.0, ge=-10, le=10, description="logit-normal timestep mean")
    timestep_std: float = Field(1.0, gt=0, le=10, description="logit-normal timestep std")
    timestep_max_shift: float = Field(
        3.0, gt=0, le=100, description="timestep shift at 4096 image tokens (linear in tokens from the base)"
    )
    holdout: int = Field(
        32,
        ge=0,
        le=MAX_ROWS,
        description="rows (smallest sha1(id)) kept out of training for the held-out loss; fewer than the train set's rows",
    )
    sample: SampleConfig = SampleConfig()
    eval: EvalConfig = EvalConfig()
    parallel: ParallelConfig = ParallelConfig()
    optim: OptimConfig = OptimConfig()
    repa: RepaConfig = RepaConfig()
    dcp: DCPConfig = DCPConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    bad_shard: Literal["stop", "skip"] = Field(
        "stop",
        description="a train-set shard missing, truncated or with a changed index: stop naming its URI, or skip it "
        "for that epoch and record it in train_data.json (a member whose bytes changed always stops)",
    )
    text_cache_mb: float = Field(
        512,
        ge=0,
        le=1_000_000,
        description="caption embeddings kept in memory, in MB (least recently used out); the rest are encoded at their step",
    )
    text_prefill_rows: int = Field(
        20_000,
        ge=0,
        le=10_000_000,
        description="a train set of at most this many rows has its drawable captions encoded before step 1, as many as fit text_cache_mb; 0 = never",
    )
    loader_workers: int | None = Field(
        None,
        ge=0,
        le=MAX_THREADS,
        description="threads preparing the next batches (autoencoder latents, cache reads); 0 = in the step; None = by device: 0 on CPU, 1 on CUDA (docs/training-at-scale.md)",
    )
    init_from: str | None = Field(
        None, description="checkpoint folder whose weights start this stage (256 -> 512 -> 1024 -> mid -> SFT)"
    )
    resolution: int | None = Field(
        None,
        ge=8,
        le=MAX_SIDE,
        description="side of this stage's square training bucket (its pack); None = data.pack.resolution",
    )
    mix: str | None = Field(
        None,
        description="the dataset mix this stage trains on (assets.mixes: pretrain, midtrain, sft); None = every packed row",
    )
    pma_k: int = Field(
        0,
        ge=0,
        le=10000,
        description="average the last K step checkpoints into a PMA checkpoint after this stage; 0 = none",
    )
    nonfinite_skip: int = Field(
        0,
        ge=0,
        le=1000,
        description="steps with a non-finite loss or grad norm skipped (no update) before the run stops; 0 = stop at the first",
    )
    ema_decay: float = Field(
        0.0, ge=0, lt=1, description="keep an EMA of the weights with this decay (in the DCP checkpoints); 0 = none"
    )
    final_weights: Literal["last", "ema", "pma"] = Field(
        "last",
        description="what model.safetensors holds: the last step's weights, the EMA (ema_decay > 0) or the PMA of the last pma_k step checkpoints",
    )
    route: RouteConfig = RouteConfig()

    @model_validator(mode="after")
    def _pairs_in_order(self) -> TrainConfig:
        check_order(
            "timestep_shift", self.timestep_shift, "timestep_max_shift", self.timestep_max_shift
        )  # more tokens, more noise
        check_order("pma_k", self.pma_k, "dcp.keep", self.dcp.keep)  # PMA averages step checkpoints the run kept
        if self.final_weights == "ema" and self.ema_decay == 0:
            raise PairError("final_weights=ema needs ema_decay > 0", "final_weights", "ema_decay")
        if self.final_weights == "pma" and self.pma_k == 0:
            raise PairError("final_weights=pma needs pma_k > 0", "final_weights", "pma_k")
        if self.route.frac > 0 and self.parallel.sequence_parallel:
            raise PairError(
                "route.frac > 0 changes the sequence length between blocks: not with parallel.sequence_parallel",
                "route.frac",
                "parallel.sequence_parallel",
            )
        on_gpu = self.device.startswith(
            "cuda"
        )  # whether this machine has one is checked when the run starts (training/core/gpu_settings.py)
        if self.parallel.float8 and not on_gpu:
            raise PairError(
                "parallel.float8 is GPU-only (torchao float8 needs CUDA capability 8.9+): set device=cuda or float8=false",
                "parallel.float8",
                "device",
            )
        if self.parallel.async_tp and not (on_gpu and self.parallel.tp > 1 and self.parallel.compile):
            raise PairError(
                "parallel.async_tp is GPU-only and needs tp > 1 and compile=true (symmetric memory + inductor)",
                "parallel.async_tp",
                "device",
                "parallel.tp",
                "parallel.compile",
            )
        return self
