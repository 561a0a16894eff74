"""The training ladder: the rungs of `ladder` in the config, each a train set and a checkpoint, and how each
rung's config is made, as override strings every door passes (Dagster, `kiln run`, DVC commands).

A rung composes its own train file (`train=<rung.train>`), its overrides, then the user's overrides (a
user's `train=` is dropped: the rung picks the train file). The ladder adds the wiring: the previous rung's
checkpoint as `train.init_from`, and for the train set the rung's resolution, its mix and the coverage
weights. `checkpoint`, the model samples and evaluation read, is the PMA of the last rung (kiln pma).
Held-out rows: the first rung holds out `train.holdout` rows of its train set, and every later rung
inherits that choice (training.core.data.inherited_holdout), so the evaluation's held-out rows were never
trained on by any rung. No Dagster import here.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.config import KilnConfig, load_config

# the asset the ladder ends in, and the train set evaluation reads its held-out rows from (the first rung's)
FINAL = "checkpoint"
MERGED = (
    "checkpoint_merged"  # the merge of the domain SFT rungs (training/post/merge.py), when `ladder.domains` has any
)


@dataclass(frozen=True)
class Rung:
    name: str
    train: str  # conf/train/<train>.yaml
    overrides: tuple[str, ...]
    start: str | None  # the checkpoint asset whose weights start this rung (None: from scratch)
    domain: bool = False  # a domain SFT rung (post-training, from `checkpoint`), not a rung of the main ladder

    @property
    def train_set(self) -> str:
        return f"train_set_{self.name}"

    @property
    def checkpoint(self) -> str:
        return f"checkpoint_{self.name}"


def rungs(cfg: KilnConfig) -> list[Rung]:
    out, start = [], None
    for r in cfg.ladder.rungs:
        out.append(Rung(r.name, r.train, tuple(r.overrides), start))
        start = f"checkpoint_{r.name}"
    return out


def domain_rungs(cfg: KilnConfig) -> list[Rung]:
    """The domain SFT rungs (`ladder.domains`): each trained from `checkpoint` on its own mix; MERGED merges them."""
    return [Rung(d.name, d.train, tuple(d.overrides), FINAL, domain=True) for d in cfg.ladder.domains]


def all_rungs(cfg: KilnConfig) -> list[Rung]:
    return [*rungs(cfg), *domain_rungs(cfg)]


def post_base(cfg: KilnConfig) -> str:
    """The checkpoint post-training (preference pairs, DPO) starts from: the merge of the domain SFTs if there
    are any, else `checkpoint`."""
    return MERGED if cfg.ladder.domains else FINAL


def _user(overrides: list[str]) -> list[str]:
    return [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != "train"]


def rung_base(rung: Rung, user: list[str]) -> list[str]:
    """The overrides that make the rung's own config, before the ladder's wiring."""
    return [f"train={rung.train}", *rung.overrides, *_user(user)]


def checkpoint_overrides(rung: Rung, user: list[str], data_root: str) -> list[str]:
    """The trainer's overrides for a rung: its config, started from the previous rung's checkpoint."""
    out = rung_base(rung, user)
    if rung.start:
        out.append(f"train.init_from={data_root}/{rung.start}")
    return out


def train_set_overrides(rung: Rung, user: list[str], data_root: str, cfg: KilnConfig | None = None) -> list[str]:
    """The pack stage's overrides for a rung's train set: its resolution, its mix (rows outside rejected
    `not_in_mix`) and the concept coverage weights. `cfg` is the rung's composed config when the caller has it."""
    cfg = cfg or load_config(rung_base(rung, user))
    out = [
        *rung_base(rung, user),
        f"data.pack.resolution={cfg.train.resolution or cfg.data.pack.resolution}",
        f"data.pack.weights_file={data_root}/coverage/weights.parquet",
    ]
    if cfg.train.mix:
        out.append(f"data.pack.mix_file={data_root}/mixes/{cfg.train.mix}/part-00000.parquet")
    return out


def pma_k(cfg: KilnConfig, user: list[str]) -> int:
    """How many of the last rung's step checkpoints `checkpoint` averages (at least its final one)."""
    last = rungs(cfg)[-1]
    return max(load_config(rung_base(last, user)).train.pma_k, 1)
