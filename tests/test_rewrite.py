"""Rewrites and prompt pairs: every kept row stores every caption form, lengths are enforced with a reason,
the LLM path runs a tiny random causal LM through real generate(), and training draws forms with the
configured probabilities."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pytest
import torch
from caption_fixtures import (
    deduped_rows,
    ocred_rows,
    scene_image,
    shape,
    sign,
    write_tiny_causal_lm,
)
from fresh import in_fresh_process

from assets.caption import caption_rows
from assets.prompt_pairs import prompt_pair_rows
from assets.rewrite import LLMRewriter, RuleRewriter, make_rewriter, rewrite_rows
from components.rule_text import make_prompt, rule_forms
from kiln.config import RewriteConfig, load_config
from kiln.reasons import Reason
from kiln.sampling import FORMS, pick_form
from kiln.schemas import PROMPT_PAIRS, REWRITTEN, check_schema

torch.set_num_threads(1)
LONG = "two small green squares at the top, on a blue and white striped background"


class Known:
    name, decoding = "known", {"method": "lookup"}

    def __init__(self, captions):
        self.captions = captions

    def caption(self, rows):
        return self.captions


@pytest.fixture(scope="module")
def captioned(tmp_path_factory):
    d = tmp_path_factory.mktemp("img")
    rows = ocred_rows(
        deduped_rows([scene_image(d, "stop", sign("STOP")), scene_image(d, "sq", shape("square"))]), ["STOP", ""]
    )
    caps = ['a red sign with the word "STOP", on a blue background', LONG]
    return caption_rows(rows, Known(caps), record_decoding=True).kept


def test_rule_forms_shorten_the_caption_and_keep_the_ocr_text():
    f = rule_forms('a red sign with the word "STOP", on a blue background', "STOP", short_words=12)
    assert f.short == 'a red sign with the word "STOP"' and f.long.endswith("blue background")
    assert f.tags.split(", ")[0] == "STOP" and "background" in f.tags
    assert json.loads(f.json)["text"] == ["STOP"] and json.loads(f.json)["subject"] == f.short
    g = rule_forms(LONG, "", short_words=3)
    assert g.short == "two small green" and g.medium == "two small green squares at the top"


def test_every_kept_row_stores_every_form(captioned):
    out = rewrite_rows(captioned, RuleRewriter(), RewriteConfig())
    kept = check_schema(out.kept, REWRITTEN, "rewrite")
    assert kept.num_rows == 2 and out.rejected.num_rows == 0
    for form in FORMS:
        assert all(v.strip() for v in kept.column(f"caption_{form}").to_pylist())
    assert json.loads(kept.column("rewrite_decoding")[0].as_py()) == {
        "method": "rules",
        "short_words": 12,
        "json": "composed",
    }


def test_forms_outside_their_length_range_are_rejected_with_the_length(captioned):
    cfg = RewriteConfig(
        lengths={"short": (3, 20), "medium": (3, 300), "long": (3, 2000), "tags": (1, 400), "json": (2, 4000)}
    )
    out = rewrite_rows(captioned, RuleRewriter(), cfg)
    assert out.rejected.column("reason").to_pylist() == [Reason.CAPTION_LENGTH] * 2  # both short forms exceed 20 chars
    assert out.rejected.column("value").to_pylist() == [31.0, 23.0]
    assert "short form" in out.rejected.column("detail")[0].as_py()


def test_llm_rewriter_generates_every_form_deterministically(captioned, tmp_path):
    path = write_tiny_causal_lm(tmp_path / "lm")
    cfg = load_config(
        [
            "data.rewrite.rewriter=llm",
            f"data.rewrite.llm_path={path}",
            "data.rewrite.max_new_tokens=5",
            "data.rewrite.min_new_tokens=2",
            "data.rewrite.batch_size=2",
        ]
    ).data.rewrite
    rewriter = make_rewriter(cfg)
    assert isinstance(rewriter, LLMRewriter) and rewriter.name == "llm:llama"
    out = rewrite_rows(captioned, rewriter, cfg)
    kept = check_schema(out.kept, REWRITTEN, "rewrite")
    assert kept.num_rows == 2
    assert kept.column("caption_long").to_pylist() == captioned.column("caption").to_pylist()
    for form in ("short", "medium", "tags"):
        assert all(
            len(v.split()) >= 2 for v in kept.column(f"caption_{form}").to_pylist()
        )  # min_new_tokens words from the tiny vocabulary
    assert all(isinstance(json.loads(j), dict) for j in kept.column("caption_json").to_pylist())
    dec = json.loads(kept.column("rewrite_decoding")[0].as_py())
    assert (dec["model"], dec["max_new_tokens"], dec["do_sample"], dec["json"]) == (str(path), 5, False, "composed")
    assert rewrite_rows(captioned, rewriter, cfg).kept.equals(out.kept)


def test_training_draws_forms_with_the_configured_probabilities():
    probs = {"long": 0.5, "medium": 0.2, "short": 0.15, "tags": 0.1, "json": 0.05}
    counts = Counter(pick_form(f"id{i}", probs, seed=0) for i in range(4000))
    for form, p in probs.items():
        assert counts[form] / 4000 == pytest.approx(p, abs=0.025)
    draws = [pick_form(f"id{i}", probs, 0, epoch=e) for i in range(20) for e in range(3)]
    code = f"import json; from kiln.sampling import pick_form; print(json.dumps([pick_form(f'id{{i}}', {probs!r}, 0, epoch=e) for i in range(20) for e in range(3)]))"
    assert (
        in_fresh_process(code) == draws
    )  # a pure function of (id, probabilities, seed, epoch): every rank draws alike
    assert len({pick_form("x", probs, 0, epoch=e) for e in range(30)}) > 1  # a new draw per epoch


def test_prompt_pairs_drop_details_reproducibly(captioned):
    prompt, dropped = make_prompt(LONG, "row-1", drop=0.5)
    assert dropped and len(prompt) < len(LONG) and (prompt, dropped) == make_prompt(LONG, "row-1", drop=0.5)
    assert make_prompt(LONG, "row-1", drop=1.0) == (
        "two green squares",
        ["on a blue and white striped background", "at the top", "small"],
    )
    rewritten = rewrite_rows(captioned, RuleRewriter(), RewriteConfig()).kept
    lonely = rewritten.slice(0, 1).to_pylist()[0] | {"id": "lonely", "caption_long": "cat"}
    rows = pa.concat_tables([rewritten, pa.Table.from_pylist([lonely], schema=REWRITTEN)])
    out = prompt_pair_rows(rows, drop=0.5)
    pairs = check_schema(out.kept, PROMPT_PAIRS, "pairs").to_pylist()
    assert [p["target"] for p in pairs] == rewritten.column("caption_long").to_pylist()
    assert all(p["prompt"] != p["target"] and json.loads(p["dropped"]) for p in pairs)
    assert out.rejected.column("reason").to_pylist() == [Reason.NO_PROMPT]


def test_the_rewritten_suite_passes_clean_rows_and_catches_a_leaked_path(captioned):
    from assets.caption_expectations import validate_caption_table

    cfg = load_config()
    rewritten = rewrite_rows(captioned, RuleRewriter(), cfg.data.rewrite).kept
    assert validate_caption_table(rewritten, "rewritten", cfg).success
    leaky = rewritten.set_column(
        rewritten.schema.get_field_index("caption_tags"), "caption_tags", pa.array(["red, images/00/12.png", "ok"])
    )
    failed = validate_caption_table(leaky, "rewritten", cfg).failed
    assert [(f.expectation, f.column) for f in failed] == [("expect_column_values_to_not_match_regex", "caption_tags")]
