"""Serving with the prompt expander: `kiln sample --expand EXPANDER_DIR` expands each prompt, the DiT draws the
expansion, and samples.parquet records it beside the prompt as typed."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from kiln.config import load_config
from training.evaluation.sampling import SAMPLES, sample_to_dir
from training.expander.sft import expand, expander_from, load_expander, train_sft
from training.testing import EXPANDER_PAIRS, trained_micro_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    dit, cfg = trained_micro_model(root, 16, seed=1, steps=2)
    over = {
        "tiny_hidden": 32,
        "tiny_heads": 2,
        "tiny_layers": 1,
        "sft_steps": 60,
        "sft_batch": 2,
        "sft_lr": 0.01,
        "save_every": 60,
        "max_new_tokens": 16,
    }
    expander = train_sft(
        EXPANDER_PAIRS,
        root / "expander",
        load_config([f"expander.{k}={v}" for k, v in over.items()]),
    )
    return dit, expander, cfg


def test_sampling_with_an_expander_draws_the_expansions_and_records_them(models, tmp_path):
    dit, expander, cfg = models
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("red circle\ngreen square\n")
    sample_to_dir(dit, tmp_path / "expanded", cfg, prompts=str(prompts), expand=expander_from(expander))
    table = pq.read_table(tmp_path / "expanded" / "samples.parquet")
    lm, tok, template, max_new = load_expander(expander)
    wanted = expand(lm, tok, ["red circle", "green square"], template, max_new)
    assert all(wanted) and wanted != ["red circle", "green square"]
    n = cfg.train.sample.n_per_prompt
    assert table.schema.equals(SAMPLES.append(table.schema.field("expanded_prompt")))
    assert table.column("prompt").to_pylist() == ["red circle"] * n + ["green square"] * n
    assert table.column("expanded_prompt").to_pylist() == [wanted[0]] * n + [wanted[1]] * n
    fed = tmp_path / "fed.txt"  # the same images as sampling the expansions directly: the DiT was fed them
    fed.write_text("\n".join(wanted) + "\n")
    sample_to_dir(dit, tmp_path / "direct", cfg, prompts=str(fed))
    assert (
        table.column("png").to_pylist()
        == pq.read_table(tmp_path / "direct" / "samples.parquet").column("png").to_pylist()
    )


def test_kiln_sample_expand_feeds_the_dit_the_expansions_of_the_expander_in_a_folder(models, tmp_path):
    from kiln.cli import main

    dit, expander, _ = models
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("red circle\ngreen square\n")
    argv = [
        "sample",
        "--checkpoint",
        str(dit),
        "--out",
        str(tmp_path / "cli"),
        "--prompts",
        str(prompts),
        "--expand",
        str(expander),
    ]
    assert main([*argv, "train.sample.steps=2", "train.sample.n_per_prompt=2"]) == 0
    lm, tok, template, max_new = load_expander(expander)
    wanted = expand(lm, tok, ["red circle", "green square"], template, max_new)
    table = pq.read_table(tmp_path / "cli" / "samples.parquet")
    assert table.column("prompt").to_pylist() == ["red circle"] * 2 + ["green square"] * 2
    assert table.column("expanded_prompt").to_pylist() == [wanted[0]] * 2 + [wanted[1]] * 2
