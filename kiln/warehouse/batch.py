"""One claimed batch through one stage, with a poison row isolated instead of failing the batch.

A stage is a function over a whole table, so when it raises we do not know which row was at fault.
`process_batch` bisects: the failing half is split again until the failure is pinned to single rows,
and every other row still gets its result. k poison rows in a batch of n cost about 2k*log2(n) extra
calls; a clean batch costs exactly one.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from kiln.config import KilnConfig
from kiln.schemas import REJECTED
from kiln.stage import Stage, StageOutput, apply_stage

MAX_ERROR_CHARS = 2000


@dataclass(frozen=True)
class BatchResult:
    kept: pa.Table  # stage.output_schema
    rejected: pa.Table  # REJECTED
    failed: dict[str, str]  # id -> error message, for rows whose stage call raised

    def statuses(self) -> dict[str, str]:
        """id -> 'kept' | 'rejected' for every row that has a result."""
        out = {i: "kept" for i in self.kept.column("id").to_pylist()}
        out.update({i: "rejected" for i in self.rejected.column("id").to_pylist()})
        return out


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:MAX_ERROR_CHARS]


def process_batch(stage: Stage, rows: pa.Table, cfg: KilnConfig) -> BatchResult:
    """Results for every row that has one; the error of every row that raised on its own."""
    outputs: list[StageOutput] = []
    failed: dict[str, str] = {}
    pending = [rows]
    while pending:
        part = pending.pop()
        try:
            outputs.append(apply_stage(stage, part, cfg))
        except Exception as e:  # noqa: BLE001 - any stage error is a row failure, retried later
            if part.num_rows == 1:
                failed[part.column(stage.id_column)[0].as_py()] = describe(e)
            elif part.num_rows > 1:
                half = part.num_rows // 2
                pending += [part.slice(half), part.slice(0, half)]
    kept = pa.concat_tables([o.kept for o in outputs]) if outputs else stage.output_schema.empty_table()
    rejected = pa.concat_tables([o.rejected for o in outputs]) if outputs else REJECTED.empty_table()
    return BatchResult(kept, rejected, failed)
