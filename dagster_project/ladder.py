"""The training ladder as assets: 256 -> 512 -> 1024 pretraining, midtraining, SFT and the PMA checkpoint.

Each rung is two assets: `train_set_<stage>`, the pack stage over `rewritten` at the stage's resolution
(`train.resolution`) restricted to its dataset mix (`train.mix`, rows outside it rejected `not_in_mix`),
and `checkpoint_<stage>`, the trainer on it from the previous rung's weights (`train.init_from`), with its
config `train=<stage>` (conf/train/<stage>.yaml). `checkpoint_pma` averages the last `train.pma_k` step
checkpoints of the last rung. On a Slurm profile the checkpoints are Slurm jobs, as the main checkpoint is.

The ladder is its own job (`training_ladder`): a GPU cluster's work, not part of the CPU demo.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import dagster as dg

from dagster_project.assets import run_data_stage, train_checkpoint
from dagster_project.resources import KilnResource
from kiln.config import load_config


@dataclass(frozen=True)
class Rung:
    stage: str  # conf/train/<stage>.yaml
    previous: str | None  # the rung whose checkpoint starts this one

    @property
    def train_set(self) -> str:
        return f"train_set_{self.stage}"

    @property
    def checkpoint(self) -> str:
        return f"checkpoint_{self.stage}"


LADDER = [
    Rung("pretrain_256", None),
    Rung("pretrain_512", "pretrain_256"),
    Rung("pretrain_1024", "pretrain_512"),
    Rung("midtrain", "pretrain_1024"),
    Rung("sft", "midtrain"),
]


def rung_config(kiln: KilnResource, rung: Rung, with_mix: bool = False):
    """The stage's config: `train=<stage>` under the resource's overrides, then the ladder's wiring: the
    previous rung's checkpoint as `init_from`, the stage's resolution (and, for its train set, its mix) for pack."""
    cfg = load_config([f"train={rung.stage}", *kiln.overrides])
    init_from = str(checkpoint_dir(kiln, rung.previous)) if rung.previous else cfg.train.init_from
    train = cfg.train.model_copy(update={"init_from": init_from})
    pack: dict = {"resolution": cfg.train.resolution or cfg.data.pack.resolution, "weights_file": str(kiln.path("coverage") / "weights.parquet")}
    if with_mix:
        pack["mix_file"] = mix_file(kiln, cfg.train.mix)
    data = cfg.data.model_copy(update={"pack": cfg.data.pack.model_copy(update=pack)})
    return cfg.model_copy(update={"train": train, "data": data})


def checkpoint_dir(kiln: KilnResource, stage: str) -> Path:
    return kiln.path("train") / stage


def mix_file(kiln: KilnResource, mix: str | None) -> str | None:
    """The Parquet of the `mixes` asset for this mix (assets.mixes.write_mixes: OUT/<mix>/part-00000.parquet)."""
    if mix is None:
        return None
    path = kiln.path("mixes") / mix / "part-00000.parquet"
    if not path.exists():
        raise FileNotFoundError(f"train.mix={mix} but {path} does not exist: materialize the `mixes` asset first")
    return str(path)


def _train_set_asset(rung: Rung) -> dg.AssetsDefinition:
    @dg.asset(name=rung.train_set, deps=["rewritten", "coverage", "mixes"], group_name="training_ladder", kinds={"python", "parquet"}, description=f"`kiln stage pack` over rewritten for {rung.stage}: its resolution, its mix, the coverage weights.")
    def _asset(kiln: KilnResource) -> dg.MaterializeResult:
        return run_data_stage("pack", kiln.path("rewritten"), kiln.path(rung.train_set), rung_config(kiln, rung, with_mix=True))

    return _asset


def _checkpoint_asset(rung: Rung) -> dg.AssetsDefinition:
    deps = [rung.train_set] + ([f"checkpoint_{rung.previous}"] if rung.previous else [])

    @dg.asset(name=rung.checkpoint, deps=deps, group_name="training_ladder", kinds={"pytorch", "safetensors"}, description=f"The {rung.stage} checkpoint (conf/train/{rung.stage}.yaml), from the previous rung's weights.")
    def _asset(context, kiln: KilnResource) -> dg.MaterializeResult:
        cfg = rung_config(kiln, rung)
        return train_checkpoint(context, kiln.path(rung.train_set), checkpoint_dir(kiln, rung.stage), cfg)

    return _asset


@dg.asset(deps=[LADDER[-1].checkpoint], group_name="training_ladder", kinds={"pytorch", "safetensors"}, description="PMA: the average of the last train.pma_k step checkpoints of the last rung (replaces an EMA).")
def checkpoint_pma(kiln: KilnResource) -> dg.MaterializeResult:
    from training.pma import pma_from_run

    last = LADDER[-1]
    cfg = rung_config(kiln, last)
    out = pma_from_run(checkpoint_dir(kiln, last.stage), max(cfg.train.pma_k, 1), kiln.path("train") / "pma")
    info = json.loads((out / "pma.json").read_text())
    return dg.MaterializeResult(metadata={"path": dg.MetadataValue.path(str(out)), "k": info["k"], "steps": dg.MetadataValue.json(info["steps"])})


ladder_assets = [factory(r) for r in LADDER for factory in (_train_set_asset, _checkpoint_asset)] + [checkpoint_pma]
LADDER_KEYS = [r.train_set for r in LADDER] + [r.checkpoint for r in LADDER] + ["checkpoint_pma"]
