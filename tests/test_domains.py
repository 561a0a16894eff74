"""Domain SFT rungs: each domain is a mix defined in config and a rung from `checkpoint`, the merge of the
domain checkpoints is where post-training starts, and each domain is scored on its own prompts."""

from __future__ import annotations

import pyarrow as pa
import pytest

from assets.mixes import build_mixes
from kiln.config import ConfigError, DomainMix, MixConfig, load_config
from kiln.ladder import FINAL, MERGED, checkpoint_overrides, domain_rungs, post_base, rungs, train_set_overrides


def pool() -> pa.Table:
    caps = ["a large red circle on the left, on a blue background", "two small white squares at the top, on a black background",
            'a red sign with the word "OPEN", on a white background']  # fmt: skip
    return pa.table({"id": [f"{i:03d}" for i in range(30)], "uri": [f"raw/{i}.png" for i in range(30)], "caption": [caps[i % 3] for i in range(30)],
                     "laplacian_var": [float(i) for i in range(30)], "contains_text": [i % 3 == 2 for i in range(30)]})  # fmt: skip


def test_a_domain_mix_holds_only_its_rows_best_first_up_to_its_size():
    cfg = MixConfig(domains=[DomainMix(name="counted", where="caption LIKE 'two %'", size=4, order="laplacian_var DESC"),
                                          DomainMix(name="single", where="caption LIKE 'a % circle %'", size=50)])  # fmt: skip
    mixes = build_mixes(pool(), cfg)
    counted, info = mixes["domain_counted"]
    assert counted.column("id").to_pylist() == [
        "028",
        "025",
        "022",
        "019",
    ]  # the 4 best (highest laplacian_var) matching rows
    assert set(counted.column("mix").to_pylist()) == {"domain_counted"} and info["short"] is False
    single, info = mixes["domain_single"]
    assert single.num_rows == 10 and info["short"] is True  # 10 circles in the pool, 50 asked: recorded as short


def test_domain_rungs_start_from_checkpoint_and_train_on_their_own_mix():
    cfg = load_config([])  # the demo ladder: pretrain -> sft -> checkpoint, then domains single and counted
    domains = domain_rungs(cfg)
    assert [r.name for r in domains] == ["single", "counted"] and all(r.domain and r.start == FINAL for r in domains)
    assert [r.start for r in rungs(cfg)] == [None, "checkpoint_pretrain"]  # the main ladder is unchanged
    single = domains[0]
    assert checkpoint_overrides(single, [], "data")[-1] == "train.init_from=data/checkpoint"
    assert "data.pack.mix_file=data/mixes/domain_single/part-00000.parquet" in train_set_overrides(single, [], "data")
    assert post_base(cfg) == MERGED
    assert post_base(load_config(["ladder.domains=[]"])) == FINAL


def test_one_domain_or_a_name_clash_is_refused():
    with pytest.raises(ConfigError, match="at least two"):
        load_config(["ladder.domains=[{name: a, train: demo}]"])
    with pytest.raises(ConfigError, match="repeat"):
        load_config(["ladder.domains=[{name: sft, train: demo}, {name: b, train: demo}]"])


def test_the_graph_runs_sft_then_domain_sfts_then_their_merge_then_preference_optimisation():
    from dagster_project.definitions import defs

    graph = defs.resolve_asset_graph()

    def parents(key: str) -> set[str]:
        import dagster as dg

        return {k.to_user_string() for k in graph.get(dg.AssetKey(key)).parent_keys}

    assert parents("checkpoint_single") == {"train_set_single", "checkpoint"}
    assert parents(MERGED) == {"checkpoint", "checkpoint_single", "checkpoint_counted"}
    assert parents("preference_pairs") == {MERGED} and MERGED in parents("checkpoint_dpo")
    main = {k.to_user_string() for k in defs.resolve_job_def("main").asset_layer.executable_asset_keys}
    assert "train_set_single" not in main and "checkpoint_single" not in main  # post-training: its own job


def test_a_demo_domain_is_scored_on_prompts_of_its_own_scene_family():
    from training.post.domains import domain_prompts

    cfg = load_config([])
    single, counted = cfg.ladder.domains
    assert all(not p.prompt.startswith(("two ", "three ")) for p in domain_prompts(single, cfg))
    assert all(
        p.prompt.startswith(("two ", "three ")) and "count" in {r.attribute for r in p.requirements}
        for p in domain_prompts(counted, cfg)
    )
    assert len(domain_prompts(counted, cfg)) == counted.eval_n


@pytest.mark.slow
@pytest.mark.integration
def test_checkpoint_merged_merges_the_domain_sfts_and_scores_each_on_every_domain(tmp_path):
    import json

    import dagster as dg
    from safetensors.torch import load_file

    from dagster_project.assets import ASSETS, EVAL_SET
    from dagster_project.resources import KilnResource
    from model.testing import write_tiny_text_encoder
    from training.core.checkpoint import verify_export
    from training.core.trainer import train
    from training.testing import scene_rows, tiny_config, write_pack_output

    te, data = write_tiny_text_encoder(tmp_path / "te"), tmp_path / "data"
    train(write_pack_output(data / EVAL_SET, scene_rows(24, seed=1)), data / "checkpoint", tiny_config(te, steps=4))
    for name, seed in (("single", 2), ("counted", 3)):  # two "domains": other rows, from the same base
        train(
            write_pack_output(tmp_path / name, scene_rows(16, seed=seed)),
            data / f"checkpoint_{name}",
            tiny_config(te, steps=3, init_from=str(data / "checkpoint")),
        )
    fast = [
        "train.eval.n_per_prompt=1",
        "train.eval.steps=2",
        "ladder.domains.0.eval_n=2",
        "ladder.domains.1.eval_n=2",
        "post.merge.method=linear",
        "post.merge.search=[]",
    ]
    merged_asset = ASSETS[MERGED]
    result = dg.materialize(
        [merged_asset],
        resources={"kiln": KilnResource(overrides=fast, data_dir=str(data))},
        instance=dg.DagsterInstance.ephemeral(),
    )
    assert result.success
    out = data / MERGED
    verify_export(out)  # the copied held-out ids and train state are under the folder's checksums
    a, b, merged = (
        load_file(str(data / d / "model.safetensors")) for d in ("checkpoint_single", "checkpoint_counted", MERGED)
    )
    for name in merged:  # linear with no weights: the equal-weight average
        assert (merged[name] - (a[name].double() + b[name].double()).div(2).to(merged[name].dtype)).abs().max() <= 1e-6
    table = json.loads((out / "domain_scores.json").read_text())
    assert set(table) == {"single", "counted", "base", "merge"} and all(
        set(r) == {"single", "counted"} for r in table.values()
    )
    assert (out / "heldout.json").read_text() == (
        data / "checkpoint" / "heldout.json"
    ).read_text()  # the base's held-out rows
    md = result.asset_materializations_for_node(MERGED)[0].metadata
    assert "| merge |" in md["scores"].value and {"merge.single", "merge.counted"} <= set(md)
    # and the merge's evaluation row, as every rung has: prompt following per attribute, held-out loss, the cost
    assert {
        "prompt_following_merge.all",
        "prompt_following_merge.color",
        "heldout_loss_merge",
        "seconds_per_image_merge",
    } <= set(md)
    assert md["heldout_loss_merge"].value > 0 and md["nfe_per_image_merge"].value == 2 * 2  # 2 steps, CFG


def test_kiln_run_job_runs_a_named_job_of_the_definitions():
    from dagster_project.run import job_for

    post = job_for(None, False, "post_training")
    assert post.name == "post_training" and {MERGED, "checkpoint_single", "train_set_single", "checkpoint_student"} <= {
        k.to_user_string() for k in post.asset_layer.executable_asset_keys
    }
    with pytest.raises(ConfigError, match="no job 'nope'; jobs: main"):
        job_for(None, False, "nope")
