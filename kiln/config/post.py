"""post: post-training after SFT: rewards, the rubric judge, GRPO, preference pairs and DPO, merging, distillation."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from kiln.config.base import (
    PairError,
    Seed,
    Strict,
)


class RewardSpec(Strict):
    """One reward of the mix (training/evaluation/rewards.py) and its weight."""

    name: Literal["rubric", "text", "aesthetic", "artifact"]
    weight: float = Field(1.0, gt=0, le=1000)
    path: str | None = Field(
        None, description="aesthetic: the reward_model folder; artifact: an HF image classifier folder"
    )
    labels: list[str] = Field(
        default_factory=lambda: ["artifact"], description="artifact: the classifier labels that name artifacts"
    )


class TDMConfig(Strict):
    """Few-step distillation by Trajectory Distribution Matching (training/post/distill.py, docs/distillation.md).
    Device, side and prompt set are post.device, post.resolution and post.prompts, as in GRPO."""

    student_steps: int = Field(4, ge=1, le=64, description="Euler steps of the student's sampler (its sampler.json)")
    teacher_cfg: float = Field(
        3.0,
        ge=0,
        le=100,
        description="CFG scale of the teacher's targets: guidance baked into a student sampled without CFG",
    )
    iterations: int = Field(
        80, ge=1, le=10_000_000, description="student updates (80: about 5 minutes on the demo, CPU)"
    )
    fake_updates: int = Field(
        1, ge=1, le=64, description="fake-score updates before each student update (the paper: 1)"
    )
    batch: int = Field(8, ge=1, le=65536, description="prompts (one student trajectory each) per iteration")
    lr: float = Field(1e-4, gt=0, le=1, description="student AdamW learning rate")
    fake_lr: float = Field(5e-4, gt=0, le=1, description="fake-score AdamW learning rate (the paper: 5x the student's)")
    weight_decay: float = Field(0.01, ge=0, le=10)
    grad_clip: float = Field(1.0, gt=0, le=1e6)
    t_min: float = Field(0.02, gt=0, lt=1, description="lowest time student samples are diffused to")
    decoupled: bool = Field(
        True,
        description="sampling-steps-aware: diffuse a stage's sample only inside its own interval (else up to t = 1)",
    )
    random_mid: bool = Field(
        False,
        description="diffuse from a random point of the student's step, not its end (the paper code's use_randmid)",
    )
    importance_weighting: bool = Field(
        True, description="reweight the fake score's loss by the effective-noise density ratio"
    )
    huber_c: float = Field(
        0.0, ge=0, le=10, description="> 0: pseudo-Huber student loss with this c (the paper's recipe: 1e-3); 0 = MSE"
    )
    save_every: int = Field(40, ge=1, le=10_000_000, description="DCP checkpoint every N iterations")
    seed: int = Field(0, ge=0, le=2**63 - 1)


MergeWeight = Annotated[float, Field(ge=0, le=1000)]


class MergeCandidate(Strict):
    """One merge the search tries (training/post/merge.py merge_search): what it changes in `post.merge`."""

    weights: list[MergeWeight] = Field(default_factory=list, description="one per source; empty = post.merge.weights")
    scale: float | None = Field(None, gt=0, le=10, description="None = post.merge.scale")
    density: float | None = Field(None, gt=0, le=1, description="None = post.merge.density")


class MergeConfig(Strict):
    """Merging N checkpoints of one model into one (training/post/merge.py, docs/post-training.md#merging)."""

    method: Literal["linear", "task_arithmetic", "ties", "dare", "dare_ties"] = "linear"
    weights: list[MergeWeight] = Field(
        default_factory=list, description="one per source, in source order; empty = equal (1/N each)"
    )
    density: float = Field(
        0.5, gt=0, le=1, description="ties / dare / dare_ties: the fraction of each task vector kept"
    )
    scale: float = Field(
        1.0,
        gt=0,
        le=10,
        description="task_arithmetic / ties / dare / dare_ties: the merged task vector's multiplier (lambda)",
    )
    seed: Seed = Field(0, description="dare / dare_ties: the drop masks' seed")
    search: list[MergeCandidate] = Field(
        default_factory=list,
        max_length=64,
        description="merges the search tries, in order (empty and grid 0: only this merge)",
    )
    grid: int = Field(
        0,
        ge=0,
        le=10,
        description="the search also tries every weight vector with entries k / grid summing to 1 (0 = none)",
    )

    @model_validator(mode="after")
    def _lengths(self) -> MergeConfig:
        if self.weights and sum(self.weights) <= 0:
            raise PairError(f"weights {self.weights} sum to 0: nothing would be merged", "weights")
        sized = [("weights", len(self.weights))] if self.weights else []
        sized += [(f"search[{i}].weights", len(c.weights)) for i, c in enumerate(self.search) if c.weights]
        for key, n in sized[1:]:
            if n != sized[0][1]:
                raise PairError(
                    f"{key} has {n} entries and {sized[0][0]} has {sized[0][1]}: every weight list has one weight per source",
                    "weights",
                    "search",
                )
        for i, c in enumerate(self.search):
            if c.weights and sum(c.weights) <= 0:
                raise PairError(f"search[{i}].weights {c.weights} sum to 0: nothing would be merged", "search")
        return self


class PostConfig(Strict):
    """Post-training after SFT (docs/post-training.md): rewards, the rubric judge, and the RL stage."""

    prompts: str | None = Field(
        None,
        description="rubric prompt set (JSONL, training/evaluation/rubric.py); None = the demo grammar's RL prompts",
    )
    eval_prompts: str | None = Field(
        None, description="rubric prompt set the evaluation's prompt following is scored on; None = the 12 demo prompts"
    )
    judge: Literal["demo_pixel", "demo_graded", "vlm"] = Field(
        "vlm",
        description="who checks rubric requirements: the demo's pixel checker (a stand-in; demo_graded: its graded scores) or a VLM by path",
    )
    judge_vlm_path: str | None = Field(None, description="VLM folder for judge=vlm (P(yes) per requirement)")
    rewards: list[RewardSpec] = Field(default_factory=lambda: [RewardSpec(name="rubric")], min_length=1)
    ocr_upscale: int = Field(1, ge=1, le=16, description="text reward: samples are read at this many times their size")
    # GRPO (training/post/grpo.py)
    iterations: int = Field(60, ge=1, le=10_000_000, description="rollout + update rounds")
    prompts_per_iter: int = Field(4, ge=1, le=65536)
    group_size: int = Field(
        8, ge=2, le=1024, description="samples per prompt: the group its advantages are relative to"
    )
    sample_steps: int = Field(10, ge=2, le=1000, description="SDE sampler steps of a rollout (no CFG)")
    eta: float = Field(0.7, gt=0, le=5, description="SDE noise level (training/post/sde.py)")
    clip: float = Field(0.2, gt=0, le=1, description="PPO ratio clip")
    kl: float = Field(0.01, ge=0, le=100, description="weight of the KL to the frozen reference")
    lr: float = Field(1e-4, gt=0, le=1)
    grad_clip: float = Field(1.0, gt=0, le=1e6)
    inner_epochs: int = Field(1, ge=1, le=64, description="policy updates per rollout batch")
    save_every: int = Field(10, ge=1, le=10_000_000, description="DCP checkpoint every N iterations")
    seed: int = Field(0, ge=0, le=2**63 - 1)
    device: Literal["cpu", "cuda"] = "cpu"
    resolution: int | None = Field(
        None, ge=8, le=16384, description="rollout side in px; None = the checkpoint's training bucket"
    )
    # preference pairs (training/post/pairs.py) and Diffusion-DPO (training/post/dpo.py)
    pair_prompts: int = Field(64, ge=1, le=10_000_000, description="prompts sampled for on-policy pairs")
    pair_k: int = Field(4, ge=2, le=256, description="samples per prompt; the best and worst make a pair")
    pair_margin: float = Field(0.2, ge=0, le=1000, description="minimum reward gap between winner and loser")
    dpo_steps: int = Field(200, ge=1, le=10_000_000)
    dpo_batch: int = Field(8, ge=1, le=65536)
    dpo_beta: float = Field(500.0, gt=0, le=1e7, description="DPO's beta on velocity-error differences")
    dpo_lr: float = Field(1e-5, gt=0, le=1)
    winner_anchor: float = Field(
        0.0,
        ge=0,
        le=1e6,
        description="weight of the penalty on a winner likelihood below the reference's (0 = plain DPO)",
    )
    guard_patience: int = Field(
        20,
        ge=2,
        le=1_000_000,
        description="steps both likelihoods must fall below the reference before the guard fires",
    )
    guard_action: Literal["warn", "stop"] = "warn"
    merge: MergeConfig = MergeConfig()
    distill: TDMConfig = TDMConfig()
