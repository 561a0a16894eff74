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
    assert counted.column("id").to_pylist() == ["028", "025", "022", "019"]  # the 4 best (highest laplacian_var) matching rows
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
    from training.domains import domain_prompts

    cfg = load_config([])
    single, counted = cfg.ladder.domains
    assert all(not p.prompt.startswith(("two ", "three ")) for p in domain_prompts(single, cfg))
    assert all(p.prompt.startswith(("two ", "three ")) and "count" in {r.attribute for r in p.requirements} for p in domain_prompts(counted, cfg))
    assert len(domain_prompts(counted, cfg)) == counted.eval_n
