"""ladder: the training ladder's rungs and the domain SFT rungs merged after it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kiln.config.base import (
    Strict,
)


class RungConfig(Strict):
    """One rung of the training ladder (kiln.ladder): a train set packed at its resolution from its mix,
    and a checkpoint trained on it from the previous rung's weights."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$", description="assets train_set_<name> and checkpoint_<name>")
    train: str = Field(description="the train config of this rung: conf/train/<train>.yaml")
    overrides: list[str] = Field(
        default_factory=list, description="Hydra overrides of this rung after its train file (e.g. train.steps=500)"
    )


class DomainRungConfig(RungConfig):
    """A domain SFT rung (kiln.ladder.domain_rungs): trained from `checkpoint` on its own mix (its overrides set
    `train.mix=domain_<name>`, a `data.mixes.domains` entry), and scored on its own prompts for the merge."""

    eval_prompts: str | None = Field(
        None,
        description="rubric prompt set (JSONL) this domain is scored on; None = demo grammar prompts of `demo_family`",
    )
    demo_family: Literal["single_shape", "counted_shapes"] | None = Field(
        None, description="demo stand-in: the scene family its prompts are drawn from"
    )
    eval_n: int = Field(16, ge=1, le=100_000, description="prompts drawn for demo_family")


class LadderConfig(Strict):
    """The rungs in order; the PMA of the last rung's last `train.pma_k` step checkpoints is `checkpoint`,
    the model that samples and evaluation read."""

    rungs: list[RungConfig] = Field(default_factory=lambda: [RungConfig(name="pretrain", train="demo")], min_length=1)
    domains: list[DomainRungConfig] = Field(
        default_factory=list, description="domain SFT rungs, each from `checkpoint`, merged into checkpoint_merged"
    )

    @model_validator(mode="after")
    def _unique(self) -> LadderConfig:
        names = [r.name for r in [*self.rungs, *self.domains]]
        if len(set(names)) != len(names):
            raise ValueError(f"rung names repeat: {names}")
        if len(self.domains) == 1:
            raise ValueError("ladder.domains: a merge needs at least two domain SFT rungs (or none)")
        return self
