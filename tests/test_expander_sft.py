"""Expander SFT (training/expander/sft.py): the loss is on the target only, and a killed run resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.config import load_config
from training.expander.model import (
    build_word_tokenizer,
    encode_pair,
    load_lm,
    masked_lm_loss,
)
from training.expander.sft import expand, load_expander, train_sft

PAIRS = [
    {"id": f"r{i}", "prompt": p, "target": t, "sampling_weight": w}
    for i, (p, t, w) in enumerate(
        [
            ("red circle", "a large red circle on the left, on a blue background", 1.5),
            (
                "Draw a green square.",
                "a small green square at the top, on a white background",
                1.0,
            ),
            (
                "can you make me a blue triangle?",
                "a large blue triangle in the center, on a yellow background",
                2.0,
            ),
            (
                "two pink diamonds",
                "two small pink diamonds on the right, on a black background",
                1.2,
            ),
        ]
    )
]


def tiny_cfg(**over):
    base = {
        "tiny_hidden": 16,
        "tiny_heads": 2,
        "tiny_layers": 1,
        "sft_steps": 6,
        "sft_batch": 3,
        "save_every": 2,
        "max_length": 40,
        "max_new_tokens": 16,
    }
    return load_config([f"expander.{k}={v}" for k, v in (base | over).items()])


def test_the_loss_counts_target_tokens_only_against_a_hand_written_reference():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11)
    labels = torch.tensor([[-100, -100, -100, 4, 7, 2], [-100, -100, 5, 1, -100, -100]])  # prompt, target, padding
    terms = []
    for b in range(2):
        for t in range(5):  # position t predicts token t + 1
            if labels[b, t + 1] != -100:
                terms.append(-torch.log_softmax(logits[b, t], -1)[labels[b, t + 1]])
    assert len(terms) == 5
    assert masked_lm_loss(logits, labels).item() == pytest.approx(torch.stack(terms).mean().item(), abs=1e-6)
    changed = logits.clone()
    changed[0, 0] += 100.0  # predicts a prompt token: not part of the loss
    changed[1, 4:] -= 50.0  # predicts padding
    assert masked_lm_loss(changed, labels).item() == pytest.approx(masked_lm_loss(logits, labels).item(), abs=1e-6)


def test_a_pair_is_masked_on_its_template_and_ends_with_end_of_text(tmp_path):
    tok = build_word_tokenizer([p["prompt"] + " " + p["target"] for p in PAIRS] + ["Short: Long:"], tmp_path)
    ids, labels = encode_pair(tok, "Short: {prompt}\nLong:", "red circle", "a large red circle", 64)
    head = tok("Short: red circle\nLong:", add_special_tokens=False)["input_ids"]
    assert labels[: len(head)] == [-100] * len(head)
    assert labels[len(head) :] == ids[len(head) :] and ids[-1] == tok.eos_token_id
    assert tok.decode(ids[len(head) : -1]) == "a large red circle"


def test_a_killed_sft_run_resumes_to_the_weights_and_history_of_an_uninterrupted_one(
    tmp_path,
):
    cfg = tiny_cfg()
    train_sft(PAIRS, tmp_path / "full", cfg)
    assert train_sft(PAIRS, tmp_path / "killed", cfg, stop_at=3) is None  # step 3 ran after the checkpoint at 2
    train_sft(PAIRS, tmp_path / "killed", cfg, resume=True)
    a, _ = load_lm(tmp_path / "full")
    b, _ = load_lm(tmp_path / "killed")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    history = [json.loads(x) for x in (tmp_path / "killed" / "expander_sft_history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == list(range(1, 7))
    assert history == [
        json.loads(x) for x in (tmp_path / "full" / "expander_sft_history.jsonl").read_text().splitlines()
    ]


def test_a_fresh_run_into_a_folder_with_checkpoints_is_refused_and_deletes_nothing(tmp_path):
    cfg = tiny_cfg()
    out = train_sft(PAIRS, tmp_path / "sft", cfg)
    files = lambda: {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}  # noqa: E731
    before = files()
    with pytest.raises(FileExistsError, match=r"dcp/step-000006.*--resume.*--overwrite"):
        train_sft(PAIRS[:2], out, cfg)
    assert files() == before
    train_sft(PAIRS[:2], out, cfg, overwrite=True)  # asked for: the earlier run's steps go, none is resumed
    assert json.loads((out / "expander.json").read_text())["pairs"] < json.loads(before[Path("expander.json")])["pairs"]
    assert [json.loads(x)["step"] for x in (out / "expander_sft_history.jsonl").read_text().splitlines()] == list(
        range(1, 7)
    )


@pytest.mark.slow
def test_the_tiny_expander_learns_the_pairs_and_reloads_by_path(tmp_path):
    cfg = tiny_cfg(tiny_hidden=32, sft_steps=150, sft_batch=4, save_every=150, sft_lr=0.01)
    out = train_sft(PAIRS, tmp_path / "sft", cfg)
    model, tok, template, max_new = load_expander(out)
    got = expand(model, tok, [p["prompt"] for p in PAIRS], template, max_new)
    assert got == [p["target"] for p in PAIRS]


def test_a_real_expander_without_its_model_folder_fails_before_any_work(tmp_path):
    cfg = load_config(["expander.base=path"])
    with pytest.raises(ValueError, match=r"expander\.path: the expander's causal LM folder is not set"):
        train_sft(PAIRS, tmp_path / "sft", cfg)
    assert not (tmp_path / "sft").exists()


def test_kiln_expander_sft_trains_from_the_user_prompts_folder(tmp_path, capsys):
    import pyarrow as pa

    from kiln.cli import main
    from kiln.schemas import PROMPT_PAIRS
    from kiln.stage import run_stage, write_shards

    pairs = pa.table(
        {
            "id": [p["id"] for p in PAIRS],
            "prompt": [p["prompt"] for p in PAIRS],
            "target": [p["target"] for p in PAIRS],
            "dropped": ['["x"]'] * len(PAIRS),
        },
        schema=PROMPT_PAIRS,
    )
    write_shards([pairs], tmp_path / "pairs", PROMPT_PAIRS)
    run_stage(
        "user_prompts",
        tmp_path / "pairs",
        tmp_path / "user_prompts",
        load_config([]),
        workers=0,
    )
    over = [
        "expander.tiny_hidden=16",
        "expander.tiny_heads=2",
        "expander.tiny_layers=1",
        "expander.sft_steps=2",
        "expander.sft_batch=2",
    ]
    assert (
        main(
            [
                "expander-sft",
                "--pairs",
                str(tmp_path / "user_prompts"),
                "--out",
                str(tmp_path / "sft"),
                *over,
            ]
        )
        == 0
    )
    assert (tmp_path / "sft" / "config.json").exists() and (tmp_path / "sft" / "expander.json").exists()
    assert (
        main(
            [
                "expander-sft",
                "--pairs",
                str(tmp_path / "user_prompts"),
                "--out",
                str(tmp_path / "real"),
                "expander.base=path",
            ]
        )
        == 2
    )
    assert (
        "expander.path: the expander's causal LM folder is not set" in capsys.readouterr().err
        and not (tmp_path / "real").exists()
    )
