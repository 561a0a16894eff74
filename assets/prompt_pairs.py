"""Prompt-expansion pairs: a short synthetic "user prompt" and the long caption it should grow back into.

People type "a red circle"; the model trains on "a large red circle on the left, on a blue background".
A later prompt expander learns the way back from these pairs. The prompt is the long caption with
details dropped: each clause after the first with probability `pair_drop`, then, inside the first,
the prepositional tail ("on the left") and size words with the same probability, every draw seeded by
(seed, id) so that the pairs reproduce. A pair always drops at least one detail; a caption with
nothing to drop is rejected (`no_prompt`).
"""

from __future__ import annotations

import json

import pyarrow as pa

from components.rule_text import make_prompt
from kiln.config import KilnConfig
from kiln.reasons import Reason
from kiln.schemas import PROMPT_PAIRS, REWRITTEN
from kiln.stage import Rejects, Stage, StageOutput


def prompt_pair_rows(table: pa.Table, drop: float, seed: int = 0, stage: str = "prompt_pairs") -> StageOutput:
    rejects, out = Rejects(stage), {"id": [], "prompt": [], "target": [], "dropped": []}
    for id_, uri, long in zip(*(table.column(c).to_pylist() for c in ("id", "uri", "caption_long"))):
        prompt, dropped = make_prompt(long, id_, drop, seed)
        if not dropped or not prompt:
            rejects.add(id_, uri, Reason.NO_PROMPT, float(len(long)), "the caption has no detail to drop")
            continue
        for k, v in zip(out, (id_, prompt, long, json.dumps(dropped, ensure_ascii=False))):
            out[k].append(v)
    return StageOutput(pa.table(out, schema=PROMPT_PAIRS), rejects.table())


def prompt_pairs_stage(table: pa.Table, cfg: KilnConfig) -> StageOutput:
    return prompt_pair_rows(table, cfg.data.rewrite.pair_drop, cfg.data.rewrite.seed)


STAGE = Stage("prompt_pairs", prompt_pairs_stage, input_schema=REWRITTEN, output_schema=PROMPT_PAIRS, scope="shard")
