"""The training ladder as Dagster assets: a train set and a checkpoint per rung (256 -> 512 -> 1024 ->
midtrain -> SFT), each rung starting from the previous one's weights, midtraining and SFT on their mixes,
and the PMA checkpoint averaging SFT's last step checkpoints.

The rungs' own configs (conf/train/<stage>.yaml: GPU, Muon, TP, compile) are shrunk by the resource's
overrides to a micro DiT at 16 px on CPU: the wiring is what is tested, not the budget."""

import json

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dagster_project.checks import all_checks
from dagster_project.ladder import LADDER, LADDER_KEYS, ladder_assets
from dagster_project.resources import KilnResource
from kiln.config import load_config
from kiln.stage import read_dataset, run_stage

pytestmark = [pytest.mark.slow, pytest.mark.integration]

CPU_MICRO = [
    "model.size=micro", "model.patch_size=2", "model.pad_to_multiple=16", "model.text_encoder.max_length=16", "model.text_encoder.layers=[-1,-2,-3]",
    "train.device=cpu", "train.threads=1", "train.steps=3", "train.warmup_steps=1", "train.batch_size=4", "train.holdout=0", "train.log_every=0",
    "train.resolution=16", "train.parallel.tp=1", "train.parallel.sequence_parallel=false", "train.parallel.compile=false",
    "train.parallel.activation_checkpointing=none", "train.dcp.every=1", "train.dcp.keep=8", "train.dcp.async_save=false",
    "data.pack.batch_size=4",
]  # fmt: skip


@pytest.fixture(scope="module")
def ladder(tmp_path_factory, text_encoder_dir):
    """rewritten demo rows, their coverage weights and hand-written mixes under data/, then the whole ladder materialized."""
    import os

    from assets.concepts import write_coverage
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
        write_coverage(root / "data" / "rewritten", root / "data" / "coverage", cfg.data.concepts)
        ids = sorted(read_dataset(root / "data" / "rewritten" / "kept").column("id").to_pylist())
        mixes = {"pretrain": ids, "midtrain": ids[: len(ids) // 2], "sft": ids[:12]}
        for mix, chosen in mixes.items():
            (root / "data" / "mixes" / mix).mkdir(parents=True)
            pq.write_table(pa.table({"id": chosen, "mix": [mix] * len(chosen)}), root / "data" / "mixes" / mix / "part-00000.parquet")
        resource = KilnResource(overrides=[*CPU_MICRO, f"model.text_encoder.path={text_encoder_dir}"], data_dir="data")
        checks = [c for c in all_checks if any(k.asset_key.to_user_string().startswith("train_set_") for k in c.check_keys)]
        result = dg.materialize([*ladder_assets, *checks], resources={"kiln": resource}, instance=dg.DagsterInstance.ephemeral())
    finally:
        os.chdir(old)
    return root / "data", mixes, result


def test_every_rung_gives_a_train_set_and_a_checkpoint_and_the_checks_pass(ladder):
    data, _, result = ladder
    assert result.success
    assert sorted(m.asset_key.to_user_string() for m in result.get_asset_materialization_events() for m in [m.materialization]) == sorted(LADDER_KEYS)
    assert len(result.get_asset_check_evaluations()) == 2 * len(LADDER) and all(e.passed for e in result.get_asset_check_evaluations())
    for rung in LADDER:
        state = json.loads((data / "train" / rung.stage / "train_state.json").read_text())
        assert state["step"] == 3 and state["bucket"] == "16x16"


def test_each_rung_starts_from_the_previous_rungs_checkpoint_with_its_own_config(ladder):
    data, _, _ = ladder
    for rung in LADDER:
        train = json.loads((data / "train" / rung.stage / "train_state.json").read_text())["config"]["train"]
        expected = load_config([f"train={rung.stage}"]).train
        assert train["optim"]["name"] == expected.optim.name and train["mix"] == expected.mix and train["lr"] == expected.lr
        assert train["init_from"] == (f"data/train/{rung.previous}" if rung.previous else None)  # the resource's data_dir
    assert [load_config([f"train={r.stage}"]).train.resolution for r in LADDER] == [256, 512, 1024, 1024, 1024]


def test_midtraining_and_sft_train_on_their_mix_and_every_other_row_is_rejected_with_the_reason(ladder):
    data, mixes, _ = ladder
    for rung in LADDER:
        kept = read_dataset(data / rung.train_set / "kept").column("id").to_pylist()
        rejected = read_dataset(data / rung.train_set / "rejected")
        mix = mixes[load_config([f"train={rung.stage}"]).train.mix]
        assert set(kept) <= set(mix) and len(kept) + rejected.num_rows == len(mixes["pretrain"])
        assert set(rejected.filter(pa.compute.equal(rejected.column("reason"), "not_in_mix")).column("id").to_pylist()) == set(mixes["pretrain"]) - set(mix)


def test_the_pma_checkpoint_averages_the_last_sft_step_checkpoints(ladder):
    import torch
    from safetensors.torch import load_file

    from model.generator import Generator
    from training.dcp import complete_checkpoints
    from training.pma import dcp_step_weights

    data, _, _ = ladder
    pma = json.loads((data / "train" / "pma" / "pma.json").read_text())
    assert pma["steps"] == [1, 2, 3] and pma["asked_k"] == 4  # SFT asks for 4; a 3-step run kept 3
    gen = Generator.from_pretrained(data / "train" / "sft")
    steps = [dcp_step_weights(d, gen) for d in complete_checkpoints(data / "train" / "sft")]
    averaged = load_file(str(data / "train" / "pma" / "model.safetensors"))
    for name, value in averaged.items():
        torch.testing.assert_close(value, sum(s[name].double() for s in steps).div(3).float(), rtol=0, atol=1e-7)
    final = load_file(str(data / "train" / "sft" / "model.safetensors"))
    assert any(not torch.equal(final[k], averaged[k]) for k in final)
    Generator.from_pretrained(data / "train" / "pma")  # a normal checkpoint folder for the sampler and evaluator
