"""The expander's wider faithfulness set (training/expander/rl.py `wide_heldout_prompt_set`): twelve held-out
prompts move faithfulness in steps of ~0.03, so the evaluation also reads 120 more demo prompts, and those
must be as held out as the twelve: none is a prompt RL is rewarded on, none an evaluation combination."""

from __future__ import annotations

import pytest
from fresh import in_fresh_process

from kiln.config import load_config
from training.expander.rewards import demo_attributes
from training.expander.rl import heldout_prompt_set, rl_prompt_set, wide_heldout_prompt_set


def test_the_wide_set_is_n_distinct_prompts_neither_rl_nor_the_evaluation_ever_sees():
    cfg = load_config([])
    wide = wide_heldout_prompt_set(cfg, 120)
    captions = [p.rubric.prompt for p in wide]
    assert len(captions) == 120 and len(set(captions)) == 120
    assert not set(captions) & {p.rubric.prompt for p in rl_prompt_set(cfg)}
    evaluation = {frozenset(demo_attributes(p.rubric.prompt)) for p in heldout_prompt_set(cfg)}
    assert not {frozenset(demo_attributes(c)) for c in captions} & evaluation
    # made short as the user_prompts stage makes them: every short prompt states something, and less than its caption
    for p in wide:
        assert demo_attributes(p.short) and demo_attributes(p.short) <= demo_attributes(p.rubric.prompt)
    assert any(demo_attributes(p.short) < demo_attributes(p.rubric.prompt) for p in wide)


@pytest.mark.slow  # a second process imports the expander's stack
def test_the_wide_set_is_reproducible_and_empty_for_a_profile_with_its_own_evaluation_prompts(tmp_path):
    cfg = load_config([])
    code = (
        "import json; from kiln.config import load_config; from training.expander.rl import wide_heldout_prompt_set\n"
        "print(json.dumps([p.short for p in wide_heldout_prompt_set(load_config([]), 40)]))"
    )
    assert in_fresh_process(code) == [p.short for p in wide_heldout_prompt_set(cfg, 40)]
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text('{"prompt": "a red circle", "requirements": []}\n')
    assert wide_heldout_prompt_set(load_config([f"post.eval_prompts={prompts}"]), 40) == []
