"""expander: the prompt expander, a causal LM fine-tuned on (user prompt -> long caption), then RL."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from kiln.config.base import (
    MAX_BATCH,
    MAX_STEPS,
    MAX_TOKENS,
    PairError,
    Seed,
    Strict,
)


class ExpanderConfig(Strict):
    """The prompt expander (docs/expander.md): a causal LM by path fine-tuned on (user prompt -> long caption),
    then RL (GDPO) with faithfulness, image and diversity rewards and a safety gate. Its model paths are checked
    before any expander work (training.expander.sft.expander_problems)."""

    base: Literal["path", "tiny"] = Field(
        "path",
        description="path: an HF causal LM folder (`path`); tiny: a small LM built from `tiny_*` over a word-level vocabulary (the demo's stand-in, from scratch)",
    )
    path: str | None = Field(None, description="HF causal LM + tokenizer folder (base=path)")
    tiny_layers: int = Field(2, ge=1, le=64)
    tiny_hidden: int = Field(64, ge=8, le=8192)
    tiny_heads: int = Field(4, ge=1, le=128)
    template: str = Field(
        "Short: {prompt}\nLong:",
        description="what the LM reads; the target follows it (the loss is on the target only)",
    )
    max_length: int = Field(
        96, ge=8, le=MAX_TOKENS, description="tokens of template + target; longer pairs are cut at the end"
    )
    max_new_tokens: int = Field(48, ge=1, le=MAX_TOKENS)
    sft_steps: int = Field(300, ge=1, le=MAX_STEPS)
    sft_batch: int = Field(16, ge=1, le=MAX_BATCH)
    sft_lr: float = Field(3e-3, gt=0, le=1)
    save_every: int = Field(50, ge=1, le=MAX_STEPS, description="DCP checkpoint every N steps (SFT and RL)")
    rl_iterations: int = Field(30, ge=1, le=MAX_STEPS)
    rl_prompts: int = Field(4, ge=1, le=MAX_BATCH, description="prompts per RL iteration")
    group_size: int = Field(
        4, ge=2, le=1024, description="expansions per prompt: the group each reward is normalised in"
    )
    temperature: float = Field(1.0, gt=0, le=10, description="sampling temperature of the rollouts")
    rl_lr: float = Field(1e-4, gt=0, le=1)
    clip: float = Field(0.2, gt=0, le=1, description="PPO ratio clip")
    kl: float = Field(0.05, ge=0, le=100, description="weight of the KL to the frozen SFT model")
    reward_weights: dict[Literal["faithfulness", "image", "diversity"], Annotated[float, Field(ge=0, le=100)]] = Field(
        default_factory=lambda: {"faithfulness": 1.0, "image": 1.0, "diversity": 0.5},
        description="GDPO: each reward is normalised within its group, then they are summed with these weights",
    )
    extractor: Literal["demo_grammar", "llm"] = Field(
        "llm",
        description="who lists a prompt's attributes for faithfulness: the demo grammar (a stand-in) or an LLM by path",
    )
    extractor_path: str | None = Field(None, description="causal LM folder (extractor=llm)")
    blocklist: list[str] = Field(
        default_factory=list, description="an expansion containing any of these words (case-insensitive) gets reward 0"
    )
    image_steps: int = Field(10, ge=1, le=10000, description="DiT sampler steps of the image and diversity rewards")
    image_cfg: float = Field(3.0, ge=0, le=100, description="CFG scale of the image and diversity rewards' samples")
    seed: Seed = 0

    @model_validator(mode="after")
    def _usable(self) -> ExpanderConfig:
        if "{prompt}" not in self.template:
            raise PairError(f"template {self.template!r} has no {{prompt}}", "template")
        if sum(self.reward_weights.values()) <= 0:
            raise PairError("reward_weights sum to 0: RL would have no signal", "reward_weights")
        return self
