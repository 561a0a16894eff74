"""Synthetic user prompts (assets/user_prompts.py): styles, writers by rules or by an LLM path, sampling weights."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from assets.user_prompts import RulePromptWriter, sampling_weight, user_prompt_rows
from components.rule_text import terse
from kiln.config import ConfigError, load_config
from kiln.reasons import Reason
from kiln.schemas import PROMPT_PAIRS, USER_PROMPTS
from kiln.stage import read_dataset, run_stage, write_shards

PAIRS = [
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


@pytest.mark.slow
def test_rule_prompts_keep_every_content_word_of_the_pair_in_each_style():
    for style in ("terse", "conversational", "instruction"):
        out = user_prompt_rows(
            pairs_table(),
            RulePromptWriter(),
            config(f"data.user_prompts.styles={{{style}: 1.0}}"),
        )
        assert out.kept.num_rows == len(PAIRS) and out.rejected.num_rows == 0
        for row in out.kept.to_pylist():
            assert row["style"] == style and row["writer"] == "rules:templates"
            assert set(terse(row["pair_prompt"]).replace(",", "").split()) <= set(
                row["prompt"].replace(",", " ").replace("?", " ").replace(".", " ").split()
            )
    assert terse("a large red circle on the left, on a blue background") == "large red circle left, blue background"


def test_styles_are_drawn_per_row_reproducibly_with_the_configured_weights():
    rows = [
        (
            f"id{i}",
            "a red circle",
            "a large red circle, on a blue background",
            ["large"],
        )
        for i in range(300)
    ]
    cfg = config("data.user_prompts.styles={terse: 0.8, conversational: 0.2, instruction: 0.0}")
    first = user_prompt_rows(pairs_table(rows), RulePromptWriter(), cfg).kept
    again = user_prompt_rows(pairs_table(rows), RulePromptWriter(), cfg).kept
    assert first.equals(again)
    styles = first.column("style").to_pylist()
    assert "instruction" not in styles and 210 < styles.count("terse") < 270


def test_a_pair_the_writer_leaves_empty_is_rejected_with_a_reason_and_nothing_is_lost():
    rows = [
        *PAIRS,
        (
            "e",
            "on the",
            "a red circle on the left, on a blue background",
            ["a red circle"],
        ),
    ]
    out = user_prompt_rows(
        pairs_table(rows),
        RulePromptWriter(),
        # one prompt per pair: with more, e's caption would be dropped anew and give a prompt
        config("data.user_prompts.styles={terse: 1.0}", "data.user_prompts.per_pair=1"),
    )
    assert sorted(out.kept.column("id").to_pylist() + out.rejected.column("id").to_pylist()) == [
        "a",
        "b",
        "c",
        "d",
        "e",
    ]
    assert out.rejected.to_pylist()[0] | {"detail": ""} == {
        "id": "e",
        "uri": "",
        "stage": "user_prompts",
        "reason": Reason.NO_PROMPT,
        "value": 0.0,
        "detail": "",
    }


def test_thinking_traces_are_optional():
    cfg = config("data.user_prompts.thinking=true")
    with_trace = (
        user_prompt_rows(pairs_table(), RulePromptWriter(thinking=True), cfg).kept.column("thinking").to_pylist()
    )
    assert all(t and "Left open" in t for t in with_trace)
    assert user_prompt_rows(pairs_table(), RulePromptWriter(), cfg).kept.column("thinking").null_count == len(PAIRS)


def test_sampling_weights_favour_rich_captions_and_photographs():
    cfg = config(
        "data.user_prompts.richness_weight=1.0",
        "data.user_prompts.richness_cap=10",
        "data.user_prompts.photo_bias=0.5",
    )
    plain, rich = (
        sampling_weight("a red circle", cfg),
        sampling_weight(
            "a large red circle on the left, a small blue square at the top, on a white and grey striped background",
            cfg,
        ),
    )
    assert plain == pytest.approx(1.2) and rich == pytest.approx(2.0) and rich > plain
    assert sampling_weight("a photo of a red circle", cfg) == pytest.approx((1 + 0.3) * 1.5)
    assert sampling_weight("a red circle", config("data.user_prompts.richness_weight=0")) == 1.0


def test_an_llm_writer_without_a_model_path_fails_at_config_validation():
    with pytest.raises(
        ConfigError,
        match=r"data\.user_prompts\.llm_path: the user-prompt writer's LLM folder is not set",
    ):
        load_config(["data.user_prompts.writer=llm"])


def test_the_stage_runs_an_llm_by_path_and_records_its_decoding_on_every_row(tmp_path):
    from training.expander.model import build_tiny_lm, build_word_tokenizer

    lm = tmp_path / "lm"
    tok = build_word_tokenizer([p for _, p, t, _ in PAIRS] + [t for _, _, t, _ in PAIRS], lm)
    cfg = load_config(
        [
            "data.user_prompts.writer=llm",
            f"data.user_prompts.llm_path={lm}",
            "data.user_prompts.thinking=true",
            "data.user_prompts.max_new_tokens=6",
        ]
    )
    build_tiny_lm(
        cfg.expander.model_copy(update={"tiny_hidden": 16, "tiny_heads": 2, "tiny_layers": 1}),
        len(tok),
        lm,
        64,
    )
    write_shards([pairs_table()], tmp_path / "pairs", PROMPT_PAIRS)
    summary = run_stage("user_prompts", tmp_path / "pairs", tmp_path / "out", cfg, workers=0)
    kept = read_dataset(tmp_path / "out" / "kept")
    rejected = read_dataset(tmp_path / "out" / "rejected")
    assert kept.schema.equals(USER_PROMPTS) and kept.num_rows + rejected.num_rows == len(PAIRS) == summary.input_rows
    assert set(rejected.column("reason").to_pylist()) <= {Reason.NO_PROMPT}
    assert kept.num_rows > 0
    for row in kept.to_pylist():  # a random LM writes noise; what it wrote and how is recorded
        d = json.loads(row["decoding"])
        assert (
            row["writer"] == "llm:llama"
            and d["model"] == str(lm)
            and d["do_sample"] is True
            and d["max_new_tokens"] == 6
        )
        assert d["instruction"].startswith("Rewrite this image request") and row["thinking"] is not None
