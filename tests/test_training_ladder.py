"""The training ladder in the main graph: a train set and a checkpoint per rung (conf/ladder/demo.yaml:
pretrain, then SFT), each rung from the previous one's weights with its own config and mix, held-out rows
that no rung trains on, and `checkpoint`, the PMA of SFT's last step checkpoints, that samples and
evaluation read. The demo rungs are shrunk by the resource's overrides to a micro DiT at 16 px on CPU: the
wiring is what is tested, not the budget. Krea 2's five-rung ladder (ladder=krea) is checked as config."""

import json
from collections import Counter

import dagster as dg
import pyarrow.compute as pc
import pytest

from dagster_project.resources import KilnResource
from kiln.config import load_config
from kiln.ladder import checkpoint_overrides, rungs, train_set_overrides
from kiln.stage import read_dataset, run_stage
from training.core.data import train_ids, train_index

pytestmark = [pytest.mark.slow, pytest.mark.integration]

CPU_MICRO = [
    "model.size=micro", "model.patch_size=2", "model.pad_to_multiple=16", "model.text_encoder.max_length=16", "model.text_encoder.layers=[-1,-2,-3]",
    "train.device=cpu", "train.threads=1", "train.steps=3", "train.warmup_steps=1", "train.batch_size=4", "train.holdout=4", "train.log_every=0",
    "train.resolution=16", "train.dcp.every=1", "train.dcp.keep=8", "train.dcp.async_save=false",
    "data.pack.batch_size=4", "data.mixes.sft_size=12",
]  # fmt: skip
LADDER_KEYS = ["train_set_pretrain", "checkpoint_pretrain", "train_set_sft", "checkpoint_sft", "checkpoint"]


@pytest.fixture(scope="module")
def ladder(tmp_path_factory, text_encoder_dir):
    """Rewritten demo rows under data/, then coverage, mixes and the whole ladder materialized through Dagster."""
    import os

    from assets.demo_corpus import write_demo_corpus

    root = tmp_path_factory.mktemp("ladder")
    old = os.getcwd()
    os.chdir(root)
    try:
        write_demo_corpus(root / "data" / "raw", n=60, seed=0, size=96)
        cfg = load_config([])
        chain = [("ingest", "raw/images", "manifest"), ("filter", "manifest", "filtered"), ("dedup", "filtered", "deduped"), ("ocr", "deduped", "ocr"),
                 ("text_filter", "ocr", "text_filtered"), ("caption_ocr", "text_filtered", "captioned"), ("rewrite", "captioned", "rewritten")]  # fmt: skip
        for stage, src, dst in chain:
            run_stage(stage, root / "data" / src, root / "data" / dst, cfg)
        from dagster_project.checks import all_checks
        from dagster_project.definitions import all_assets

        resource = KilnResource(overrides=[*CPU_MICRO, f"model.text_encoder.path={text_encoder_dir}"], data_dir="data")
        selected = {"coverage", "mixes", *LADDER_KEYS}
        assets = [a for a in all_assets if a.key.to_user_string() in selected]
        checks = [
            c for c in all_checks if any(k.asset_key.to_user_string().startswith("train_set_") for k in c.check_keys)
        ]
        result = dg.materialize(
            [*assets, *checks], resources={"kiln": resource}, instance=dg.DagsterInstance.ephemeral()
        )
    finally:
        os.chdir(old)
    return root / "data", result


def trained_on(data, rung: str) -> set[str]:
    """The rows a rung's steps could draw: its train set's kept rows less the ids its run held out."""
    kept = set(train_ids(data / f"train_set_{rung}"))
    return kept - set(json.loads((data / f"checkpoint_{rung}" / "heldout.json").read_text())["ids"])


def test_every_rung_gives_a_train_set_and_a_checkpoint_and_the_checks_pass(ladder):
    data, result = ladder
    assert result.success
    materialized = {m.materialization.asset_key.to_user_string() for m in result.get_asset_materialization_events()}
    assert set(LADDER_KEYS) <= materialized
    assert len(result.get_asset_check_evaluations()) == 4 and all(
        e.passed for e in result.get_asset_check_evaluations()
    )
    for rung in ("pretrain", "sft"):
        state = json.loads((data / f"checkpoint_{rung}" / "train_state.json").read_text())
        rows = trained_on(data, rung)
        counts = Counter(
            b
            for _, index in train_index(data / f"train_set_{rung}", ("id", "bucket"))
            for i, b in zip(index["id"], index["bucket"])
            if i in rows
        )
        most = min(counts, key=lambda k: (-counts[k], k))  # the rows' ids hash the tmp path: so does the winner
        assert state["step"] == 3 and state["bucket"] == most


def test_sft_starts_from_the_pretrained_checkpoint_with_its_own_config(ladder):
    data, _ = ladder
    pretrain = json.loads((data / "checkpoint_pretrain" / "train_state.json").read_text())["config"]["train"]
    sft = json.loads((data / "checkpoint_sft" / "train_state.json").read_text())["config"]["train"]
    assert (pretrain["init_from"], pretrain["mix"], pretrain["decay_frac"]) == (None, "pretrain", 0.0)
    assert (sft["init_from"], sft["mix"], sft["lr"], sft["decay_frac"]) == (
        "data/checkpoint_pretrain",
        "sft",
        0.001,
        1.0,
    )
    assert sft["steps"] == 3  # the user's overrides come after the rung's


def test_the_sft_rung_trains_on_its_mix_and_every_other_row_is_rejected_with_the_reason(ladder):
    import pyarrow.parquet as pq

    data, _ = ladder
    sft_mix = set(pq.read_table(data / "mixes" / "sft" / "part-00000.parquet").column("id").to_pylist())
    pool = set(read_dataset(data / "rewritten" / "kept").column("id").to_pylist())
    kept = set(train_ids(data / "train_set_sft"))
    rejected = read_dataset(data / "train_set_sft" / "rejected")
    assert len(sft_mix) == 12 and kept == sft_mix
    assert (
        set(rejected.filter(pc.equal(rejected.column("reason"), "not_in_mix")).column("id").to_pylist())
        == pool - sft_mix
    )


def test_no_rung_trains_on_the_rows_evaluation_holds_out(ladder):
    from training.evaluation.evaluate import heldout_rows

    data, _ = ladder
    held = set(json.loads((data / "checkpoint_pretrain" / "heldout.json").read_text())["ids"])
    assert len(held) == 4
    assert json.loads((data / "checkpoint_sft" / "heldout.json").read_text())["ids"] == sorted(
        held
    )  # inherited, not chosen anew
    assert not held & (trained_on(data, "pretrain") | trained_on(data, "sft"))
    rows, is_heldout = heldout_rows(data / "train_set_pretrain", 4, data / "checkpoint")
    assert is_heldout and set(rows.column("id").to_pylist()) == held


def test_checkpoint_is_the_pma_of_the_last_sft_step_checkpoints(ladder):
    import torch
    from safetensors.torch import load_file

    from model.generator import Generator
    from training.core.dcp import complete_checkpoints
    from training.core.pma import dcp_step_weights

    data, _ = ladder
    pma = json.loads((data / "checkpoint" / "pma.json").read_text())
    assert (
        pma["steps"] == [1, 2, 3] and pma["asked_k"] == 4
    )  # SFT asks for 4 (conf/ladder/demo.yaml); a 3-step run kept 3
    gen = Generator.from_pretrained(data / "checkpoint_sft")
    steps = [dcp_step_weights(d, gen) for d in complete_checkpoints(data / "checkpoint_sft")]
    averaged = load_file(str(data / "checkpoint" / "model.safetensors"))
    for name, value in averaged.items():
        torch.testing.assert_close(value, sum(s[name].double() for s in steps).div(3).float(), rtol=0, atol=1e-7)
    final = load_file(str(data / "checkpoint_sft" / "model.safetensors"))
    assert any(not torch.equal(final[k], averaged[k]) for k in final)
    Generator.from_pretrained(data / "checkpoint")  # a normal checkpoint folder for the sampler and evaluator
    assert (data / "checkpoint" / "train_data.json").exists()  # with the last rung's record of what it saw


def test_krea_ladder_climbs_256_512_1024_then_midtrain_and_sft_each_from_the_last(krea):
    cfg = load_config(krea)
    ladder = rungs(cfg)
    assert [r.name for r in ladder] == ["pretrain_256", "pretrain_512", "pretrain_1024", "midtrain", "sft"]
    packs = [train_set_overrides(r, [], "data") for r in ladder]
    assert [next(o for o in p if o.startswith("data.pack.resolution=")) for p in packs] == [
        f"data.pack.resolution={n}" for n in (256, 512, 1024, 1024, 1024)
    ]
    assert [next((o for o in p if o.startswith("data.pack.mix_file=")), None) for p in packs] == [
        f"data.pack.mix_file=data/mixes/{m}/part-00000.parquet"
        for m in ("pretrain", "pretrain", "pretrain", "midtrain", "sft")
    ]
    starts = [
        next((o for o in checkpoint_overrides(r, [], "data") if o.startswith("train.init_from=")), None) for r in ladder
    ]
    assert starts == [None, *(f"train.init_from=data/checkpoint_{r.name}" for r in ladder[:-1])]
    assert (
        load_config(checkpoint_overrides(ladder[1], ["train=demo"], "data")).train.optim.name == "muon"
    )  # a user's train= never replaces a rung's


def test_a_ladder_with_a_repeated_rung_name_is_refused():
    from kiln.config import ConfigError

    with pytest.raises(ConfigError, match="rung names repeat"):
        load_config(["ladder.rungs=[{name: a, train: demo}, {name: a, train: demo}]"])
