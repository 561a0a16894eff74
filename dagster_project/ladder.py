"""The training ladder's checkpoints as assets (the rungs are the config's `ladder`; kiln.ladder).

`checkpoint_<rung>` is the trainer on `train_set_<rung>` (a data step of kiln.lineage) from the previous
rung's checkpoint, with the rung's own config; on a Slurm profile it is a Slurm job. `checkpoint` is the PMA
of the last rung's last `train.pma_k` step checkpoints: the model samples and evaluation read.
"""

from __future__ import annotations

import json

import dagster as dg

from dagster_project.assets import train_checkpoint
from dagster_project.pages import checkpoint_page, checkpoint_samples
from dagster_project.resources import KilnResource
from kiln.config import load_config
from kiln.ladder import FINAL, Rung, checkpoint_overrides, pma_k, rungs
from kiln.lineage import code_files, code_version, default_config

RUNGS = rungs(default_config())


def checkpoint_asset(rung: Rung) -> dg.AssetsDefinition:
    deps = [rung.train_set] + ([rung.start] if rung.start else [])

    @dg.asset(
        name=rung.checkpoint,
        deps=deps,
        group_name="post_training" if rung.domain else "training",
        kinds={"pytorch", "safetensors"},
        code_version=code_version(code_files("training.trainer"), {"overrides": checkpoint_overrides(rung, [], "{data}")}),
        description=f"The {rung.name} rung: the trainer on {rung.train_set} (conf/train/{rung.train}.yaml{' + overrides' if rung.overrides else ''})"
        + (f", from {rung.start}'s weights." if rung.start else "."),
    )
    def _asset(context, kiln: KilnResource) -> dg.MaterializeResult:
        cfg = load_config(checkpoint_overrides(rung, kiln.overrides, kiln.data_dir))
        return train_checkpoint(context, kiln.path(rung.train_set), kiln.path(rung.checkpoint), cfg)

    return _asset


@dg.asset(
    name=FINAL,
    deps=[RUNGS[-1].checkpoint],
    group_name="training",
    kinds={"pytorch", "safetensors"},
    code_version=code_version(code_files("training.final_checkpoint")),
    description=f"The model: PMA, the average of {RUNGS[-1].checkpoint}'s last train.pma_k step checkpoints (in place of an EMA).",
)
def final_checkpoint(kiln: KilnResource) -> dg.MaterializeResult:
    from training.final_checkpoint import write_final_checkpoint

    last, cfg = RUNGS[-1], kiln.config()
    out = write_final_checkpoint(kiln.path(last.checkpoint), pma_k(cfg, kiln.overrides), kiln.path(FINAL))
    info = json.loads((out / "pma.json").read_text())
    pma = {"pma_k": info["k"], "pma_steps": dg.MetadataValue.json(info["steps"]), "rung": last.name}
    return dg.MaterializeResult(metadata=checkpoint_page(out, samples=checkpoint_samples(out, cfg), details=pma))


ladder_assets = [*(checkpoint_asset(r) for r in RUNGS), final_checkpoint]
