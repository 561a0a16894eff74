"""Synthetic user prompts: each rule-made prompt pair rewritten as a person would type it, in a style.

People do not type "a large red circle, on a blue background"; they type "red circle blue bg", "can you make
me a red circle?" or "Draw a red circle.". The expander learns from these (user prompt -> long caption), so
the stage rewrites each pair's prompt in one style (terse, conversational, instruction-like), drawn per row
with the configured weights and seeded by (seed, id), keeping every detail the pair's prompt states.

Two writers behind one interface (`PromptWriter.write(prompts, styles, targets, dropped, seeds)`):
- `LLMPromptWriter`: a transformers causal LM loaded by local path, one instruction per style; every row
  records the model, the instruction and the generate() settings (`decoding`), and optionally a thinking
  trace (what the caption adds to the request), written by the same LM.
- `RulePromptWriter`: templates, honest about being templates (`rules:templates`); the demo's stand-in.

Distribution shaping: every row carries a `sampling_weight` = (1 + richness_weight x richness) x
(1 + photo_bias if the target is photographic), richness = the target's content words / richness_cap, capped
at 1. The expander's SFT draws its batches with these weights (training/expander/sft.py). A row whose writer
wrote nothing is rejected (`no_prompt`), never dropped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Protocol

import pyarrow as pa

from components.rule_text import STYLES, draw, make_prompt, pick_style, rule_prompt, tag_list
from kiln.config import KilnConfig, UserPromptConfig
from kiln.reasons import Reason
from kiln.schemas import PROMPT_PAIRS, USER_PROMPTS
from kiln.stage import Rejects, Stage, StageOutput

PHOTOGRAPHIC = re.compile(
    r"\b(photo|photos|photograph\w*|photoreal\w*|camera|lens|dslr|bokeh|shot on|35mm)\b",
    re.IGNORECASE,
)


def sampling_weight(target: str, cfg: UserPromptConfig) -> float:
    """Oversample visually rich captions, and add a light bias for photographic ones."""
    richness = min(len(tag_list(target)), cfg.richness_cap) / cfg.richness_cap
    photo = 1.0 + cfg.photo_bias if PHOTOGRAPHIC.search(target) else 1.0
    return (1.0 + cfg.richness_weight * richness) * photo


@dataclass(frozen=True)
class Written:
    prompt: str
    decoding: dict
    thinking: str | None = None


class PromptWriter(Protocol):
    name: str

    def write(
        self,
        prompts: list[str],
        styles: list[str],
        targets: list[str],
        dropped: list[list[str]],
        seeds: list[int],
    ) -> list[Written]: ...


def rule_thinking(prompt: str, dropped: list[str]) -> str:
    left_open = "; ".join(dropped) if dropped else "nothing"
    return f"The request fixes: {prompt}. Keep all of it. Left open: {left_open}. Fill those in to match the picture."


class RulePromptWriter:
    name = "rules:templates"

    def __init__(self, thinking: bool = False):
        self.thinking = thinking

    def write(self, prompts, styles, targets, dropped, seeds) -> list[Written]:
        return [
            Written(
                rule_prompt(p, st, sd),
                {"method": "rules", "style": st, "template": sd % 3},
                rule_thinking(p, d) if self.thinking else None,
            )
            for p, st, d, sd in zip(prompts, styles, dropped, seeds)
        ]


# ------------------------------------------------------------------------------------------------ llm
INSTRUCTIONS = {
    "terse": "Rewrite this image request as a few terse keywords, keeping every detail.\nRequest: {prompt}\nKeywords:",
    "conversational": "Rewrite this image request as a casual message a person might send, keeping every detail.\nRequest: {prompt}\nMessage:",
    "instruction": "Rewrite this image request as a short instruction to an image generator, keeping every detail.\nRequest: {prompt}\nInstruction:",
}
THINKING = (
    "Request: {prompt}\nFull caption: {target}\nBriefly, which details does the caption add to the request?\nAnswer:"
)


def first_line(text: str) -> str:
    return next((line.strip() for line in text.strip().splitlines() if line.strip()), "")


class LLMPromptWriter:
    """Any HF causal LM by local path (the rewriter's loader and seeding); settings recorded on every row."""

    def __init__(self, path: str, cfg: UserPromptConfig):
        from components.llm import load_llm

        self.path, self.cfg = path, cfg
        self.model, self.tokenizer = load_llm(path)
        self.name = f"llm:{self.model.config.model_type}"
        self.settings = {
            "max_new_tokens": cfg.max_new_tokens,
            "do_sample": cfg.do_sample,
        } | ({"temperature": cfg.temperature, "top_p": cfg.top_p} if cfg.do_sample else {})

    def generate(self, texts: list[str], seed: int) -> list[str]:
        import torch

        out = []
        for start in range(0, len(texts), self.cfg.batch_size):
            enc = self.tokenizer(
                texts[start : start + self.cfg.batch_size],
                return_tensors="pt",
                padding=True,
            )
            torch.manual_seed(seed + start)
            greedy = {} if self.cfg.do_sample else {"temperature": None, "top_p": None, "top_k": None}
            with torch.no_grad():
                ids = self.model.generate(
                    **enc,
                    **self.settings,
                    **greedy,
                    pad_token_id=self.tokenizer.pad_token_id,
                )
            out += [
                first_line(t)
                for t in self.tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            ]
        return out

    def write(self, prompts, styles, targets, dropped, seeds) -> list[Written]:
        seed = self.cfg.seed
        answers: list[str] = [""] * len(prompts)
        for style in STYLES:  # one instruction per style, batched
            idx = [i for i, s in enumerate(styles) if s == style]
            for i, a in zip(
                idx,
                self.generate([INSTRUCTIONS[style].format(prompt=prompts[i]) for i in idx], seed),
            ):
                answers[i] = a
        traces = (
            self.generate(
                [THINKING.format(prompt=p, target=t) for p, t in zip(prompts, targets)],
                seed + 1,
            )
            if self.cfg.thinking
            else [None] * len(prompts)
        )
        return [
            Written(
                a,
                {
                    "model": self.path,
                    "instruction": INSTRUCTIONS[st],
                    "thinking_instruction": THINKING if self.cfg.thinking else None,
                    "seed": seed,
                    "batch_size": self.cfg.batch_size,
                    **self.settings,
                },
                tr,
            )
            for a, st, tr in zip(answers, styles, traces)
        ]


def make_writer(cfg: KilnConfig) -> PromptWriter:
    up, rw = cfg.data.user_prompts, cfg.data.rewrite
    if (up.writer or rw.rewriter) == "llm":
        path = up.llm_path or rw.llm_path
        if not path:
            raise ValueError("data.user_prompts.writer=llm needs data.user_prompts.llm_path (or data.rewrite.llm_path)")
        return LLMPromptWriter(path, up)
    return RulePromptWriter(up.thinking)


# ---------------------------------------------------------------------------------------------- stage
@dataclass(frozen=True)
class Attempt:
    """One user prompt to write for a pair: attempt 0 is the pair's own prompt, later ones redraw the drop."""

    row: int
    pair_prompt: str
    dropped: list[str]
    style: str
    seed: int


def attempt(j: int, row: int, id_: str, pair: str, target: str, dropped: list[str], cfg: UserPromptConfig) -> Attempt:
    """Attempt j of a row: j=0 the pair's prompt in the row's style (as with one prompt per pair); j>0 the
    caption with its own drop (`variant_drop`, seeded by (seed, id, j)) in its own drawn style."""
    key = id_ if j == 0 else f"{id_}:{j}"
    if j > 0:
        redrawn, gone = make_prompt(target, id_, cfg.variant_drop, cfg.seed + 7919 * j)
        if redrawn and gone:
            pair, dropped = redrawn, gone
    return Attempt(
        row,
        pair,
        dropped,
        pick_style(cfg.styles, cfg.seed, key),
        int(draw(cfg.seed, key, "template") * 2**31),
    )


def user_prompt_rows(
    table: pa.Table,
    writer: PromptWriter,
    cfg: UserPromptConfig,
    stage: str = "user_prompts",
) -> StageOutput:
    """Pure core: `per_pair` distinct user prompts per pair (one row per pair, the prompts in its `prompts`
    column), each in a drawn style. A row gets `per_pair` attempts, then 3 more per prompt still missing
    (an empty or repeated one; none with per_pair=1); it is kept with the distinct prompts it got (at least
    one) and rejected (`no_prompt`) when the writer left every attempt empty."""
    ids, prompts, targets, dropped_json = (table.column(c).to_pylist() for c in ("id", "prompt", "target", "dropped"))
    dropped = [json.loads(d) for d in dropped_json]
    k = cfg.per_pair
    got: list[list[tuple[Attempt, Written, str]]] = [[] for _ in ids]
    tried = [0] * len(ids)
    for per_missing in (1, 3 if k > 1 else 0):  # k attempts, then 3 per prompt still missing
        todo = [
            attempt(j, i, ids[i], prompts[i], targets[i], dropped[i], cfg)
            for i in range(len(ids))
            for j in range(tried[i], tried[i] + per_missing * (k - len(got[i])))
        ]
        if not todo:
            break
        written = writer.write(
            [a.pair_prompt for a in todo],
            [a.style for a in todo],
            [targets[a.row] for a in todo],
            [a.dropped for a in todo],
            [a.seed for a in todo],
        )
        for a, w in zip(todo, written):
            tried[a.row] += 1
            text = " ".join(w.prompt.split())
            if text and len(got[a.row]) < k and text not in {t for _, _, t in got[a.row]}:
                got[a.row].append((a, w, text))
    rejects, out = Rejects(stage), {n: [] for n in USER_PROMPTS.names}
    for i, (id_, pair, target, dj) in enumerate(zip(ids, prompts, targets, dropped_json)):
        if not got[i]:
            style = pick_style(cfg.styles, cfg.seed, id_)
            rejects.add(
                id_,
                "",
                Reason.NO_PROMPT,
                0.0,
                f"the {writer.name} writer wrote no {style} prompt for {pair!r}"
                + (f" in {tried[i]} attempts" if tried[i] > 1 else ""),
            )
            continue
        first, w, text = got[i][0]
        variants = [
            {"prompt": t, "style": a.style, "pair_prompt": a.pair_prompt, "dropped": a.dropped, "decoding": v.decoding}
            for a, v, t in got[i]
        ]
        row = (
            id_,
            text,
            first.style,
            first.pair_prompt,
            target,
            json.dumps(first.dropped, ensure_ascii=False) if first.pair_prompt != pair else dj,
            writer.name,
            json.dumps(w.decoding, sort_keys=True),
            w.thinking,
            sampling_weight(target, cfg),
            json.dumps(variants, ensure_ascii=False, sort_keys=True),
        )
        for col, v in zip(USER_PROMPTS.names, row):
            out[col].append(v)
    return StageOutput(pa.table(out, schema=USER_PROMPTS), rejects.table())


def user_prompts_stage(table: pa.Table, cfg: KilnConfig) -> StageOutput:
    return user_prompt_rows(table, make_writer(cfg), cfg.data.user_prompts)


STAGE = Stage(
    "user_prompts",
    user_prompts_stage,
    input_schema=PROMPT_PAIRS,
    output_schema=USER_PROMPTS,
    scope="shard",
)
