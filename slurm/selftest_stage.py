"""A tiny shard-scope data stage (rejects rows narrower than `data.filters.min_side`).

It exists to check that Slurm array dispatch (slurm.arrays) writes exactly what `kiln.stage.run_stage`
writes, on any cluster, without needing image data: `kiln submit stage slurm.selftest_stage ...`.
Kept apart from slurm.selftest so that array tasks do not import torch.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from kiln.config import KilnConfig
from kiln.reasons import Reason
from kiln.schemas import MANIFEST
from kiln.stage import Rejects, Stage, StageOutput


def narrow_filter(table: pa.Table, cfg: KilnConfig) -> StageOutput:
    rejects = Rejects(STAGE.name)
    short_side = pc.min_element_wise(table["width"], table["height"])
    too_small = pc.less(short_side, cfg.data.filters.min_side)
    for row, side in zip(table.filter(too_small).to_pylist(), short_side.filter(too_small).to_pylist()):
        rejects.add(row["id"], row["uri"], Reason.TOO_SMALL, float(side))
    return StageOutput(table.filter(pc.invert(too_small)), rejects.table())


STAGE = Stage(name="slurm.selftest_stage", fn=narrow_filter, input_schema=MANIFEST, output_schema=MANIFEST, scope="shard")
