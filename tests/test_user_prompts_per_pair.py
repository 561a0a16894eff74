"""Several user prompts per prompt pair (data.user_prompts.per_pair): one row per pair still, its `prompts`
column lists every distinct prompt written for it with its style, and the expander's SFT trains on each."""

from __future__ import annotations

import json

import pyarrow as pa

from assets.user_prompts import RulePromptWriter, Written, user_prompt_rows
from components.rule_text import STYLES, terse
from kiln.config import load_config
from kiln.reasons import Reason
from kiln.schemas import PROMPT_PAIRS
from training.expander.sft import sft_pairs, train_sft

PAIRS = [  # (id, pair prompt, long caption, dropped details)
    (
        "a",
        "a large red circle on the left",
        "a large red circle on the left, on a blue background",
        ["on a blue background"],
    ),
    (
        "b",
        "a green square, on a white background",
        "a small green square at the top, on a white background",
        ["small", "at the top"],
    ),
    (
        "c",
        "two pink diamonds on the right",
        "two small pink diamonds on the right, on a black background",
        ["small", "on a black background"],
    ),
    (
        "d",
        'a red sign with the word "SALE"',
        'a red sign with the word "SALE", on a grey background',
        ["on a grey background"],
    ),
]


def pairs_table(rows=PAIRS) -> pa.Table:
    cols = list(zip(*[(i, p, t, json.dumps(d)) for i, p, t, d in rows]))
    return pa.table(dict(zip(PROMPT_PAIRS.names, map(list, cols))), schema=PROMPT_PAIRS)


def config(*over: str):
    return load_config(list(over)).data.user_prompts


def content_words(text: str) -> set[str]:
    return set(terse(text).replace(",", " ").replace('"', " ").split())


def test_each_pair_gets_k_distinct_prompts_each_with_its_style_in_one_row():
    out = user_prompt_rows(pairs_table(), RulePromptWriter(), config("data.user_prompts.per_pair=4"))
    assert out.kept.column("id").to_pylist() == ["a", "b", "c", "d"] and out.rejected.num_rows == 0
    for row in out.kept.to_pylist():
        variants = json.loads(row["prompts"])
        assert len(variants) == 4 and len({v["prompt"] for v in variants}) == 4
        assert (variants[0]["prompt"], variants[0]["style"], variants[0]["pair_prompt"]) == (
            row["prompt"],
            row["style"],
            row["pair_prompt"],
        )
        for v in variants:
            assert v["style"] in STYLES and v["decoding"]["style"] == v["style"]
            # each is a drop of the caption, and the prompt keeps every content word of its drop
            assert content_words(v["pair_prompt"]) <= content_words(row["target"])
            assert content_words(v["pair_prompt"]) <= set(
                v["prompt"].replace(",", " ").replace("?", " ").replace(".", " ").replace('"', " ").split()
            )
    # the extra prompts redraw what is dropped, not only the wording
    assert any(len({v["pair_prompt"] for v in json.loads(r)}) > 1 for r in out.kept.column("prompts").to_pylist())
    again = user_prompt_rows(pairs_table(), RulePromptWriter(), config("data.user_prompts.per_pair=4")).kept
    assert again.equals(out.kept)


def test_one_prompt_per_pair_is_the_row_itself():
    out = user_prompt_rows(pairs_table(), RulePromptWriter(), config("data.user_prompts.per_pair=1")).kept.to_pylist()
    for row in out:
        assert [v["prompt"] for v in json.loads(row["prompts"])] == [row["prompt"]]


class Echo:
    """A writer that ignores the style and wording asked for: every attempt for a pair is the same text,
    and for the pair 'c' it writes nothing at all."""

    name = "test:echo"

    def write(self, prompts, styles, targets, dropped, seeds):
        return [
            Written("" if t.startswith("two small pink") else t.split(",")[0], {"style": s})
            for t, s in zip(targets, styles)
        ]


def test_repeats_are_written_again_then_kept_short_and_an_all_empty_pair_is_rejected():
    out = user_prompt_rows(pairs_table(), Echo(), config("data.user_prompts.per_pair=3"))
    kept = {r["id"]: json.loads(r["prompts"]) for r in out.kept.to_pylist()}
    assert sorted([*kept, *out.rejected.column("id").to_pylist()]) == ["a", "b", "c", "d"]  # nothing lost
    assert all(len(v) == 1 for v in kept.values())  # one distinct text is all this writer has
    (reject,) = out.rejected.to_pylist()
    assert (
        reject["id"] == "c" and reject["reason"] == Reason.NO_PROMPT and "in 12 attempts" in reject["detail"]
    )  # 3, then 3 x 3 more


def test_the_sft_trains_on_every_prompt_of_a_row_and_a_caption_keeps_its_weight(tmp_path):
    rows = user_prompt_rows(pairs_table(), RulePromptWriter(), config("data.user_prompts.per_pair=4")).kept.to_pylist()
    pairs = sft_pairs(rows)
    assert len(pairs) == 4 * len(rows)
    for row in rows:
        mine = [p for p in pairs if p["id"] == row["id"]]
        assert [p["prompt"] for p in mine] == [v["prompt"] for v in json.loads(row["prompts"])]
        assert {p["target"] for p in mine} == {row["target"]}
        assert abs(sum(p["sampling_weight"] for p in mine) - row["sampling_weight"]) < 1e-9
    cfg = load_config(
        [
            f"expander.{k}={v}"
            for k, v in {
                "tiny_hidden": 16,
                "tiny_heads": 2,
                "tiny_layers": 1,
                "sft_steps": 2,
                "sft_batch": 2,
                "save_every": 2,
                "max_length": 48,
            }.items()
        ]
    )
    out = train_sft(rows, tmp_path / "sft", cfg)
    assert json.loads((out / "expander.json").read_text())["pairs"] == 4 * len(PAIRS)
