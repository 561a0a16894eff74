"""Training consumes what curation made: a cluster rejected in review, a classifier reject and a semantic
duplicate never reach a train set, and each is accounted for with its reason where it left."""

from __future__ import annotations

import dagster as dg
import pyarrow.parquet as pq
import pytest

from assets.cluster_review import review_rows, set_decision
from kiln.config import load_config
from kiln.registry import curation_nodes, ladder_train_sets
from kiln.stage import read_dataset
from training.core.data import train_ids

pytestmark = [pytest.mark.slow, pytest.mark.integration]

MAIN_CHAIN = curation_nodes(load_config([]))
PACKS = ladder_train_sets(load_config([]))  # a train set per ladder rung (conf/ladder/demo.yaml: pretrain, sft)
CHAIN = ["raw_images", *[s.key for s in MAIN_CHAIN], "coverage", "mixes", *[p.key for p in PACKS]]
# the demo's low_quality head rejects at p >= 0.3 here and semantic dedup merges at cosine 0.99, so that each rejects something
OVERRIDES = ["data.demo.n=240", "data.classify.heads.0.threshold=0.3", "data.clustering.semdedup_threshold=0.99"]


def run_chain(root) -> None:
    from dagster_project.run import job_for

    run_config = {"resources": {"kiln": {"config": {"overrides": OVERRIDES, "data_dir": str(root / "data")}}}}
    assert (
        job_for(CHAIN, everything=False)
        .execute_in_process(run_config=run_config, instance=dg.DagsterInstance.ephemeral())
        .success
    )


def rejected(root, step: str, reason: str) -> set[str]:
    rows = read_dataset(root / "data" / step / "rejected").to_pylist()
    return {r["id"] for r in rows if r["reason"] == reason}


def trained_ids(root) -> set[str]:
    ids = set()
    for p in PACKS:
        ids |= set(train_ids(root / "data" / p.key))
    for mix in (root / "data" / "mixes").glob("*/part-00000.parquet"):
        ids |= set(pq.read_table(mix, columns=["id"]).column("id").to_pylist())
    return ids


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    import os

    root = tmp_path_factory.mktemp("chain")
    old = os.getcwd()
    os.chdir(root)  # the review table (data.clustering.review_db) and the demo's truth live under data/
    try:
        run_chain(root)
        first = trained_ids(root)
        # before the review: which rows the classifier and semantic dedup reject (after it, a rejected cluster
        # may hold every semantic duplicate, since semantic dedup runs inside the leaf clusters that remain)
        curation_rejects = (
            rejected(root, "classified", "low_quality"),
            rejected(root, "semdeduped", "semantic_duplicate"),
        )
        clusters = [r for r in review_rows(root / "data" / "review.duckdb") if r["level"] == 0]
        target = max(clusters, key=lambda r: r["size"])
        set_decision(root / "data" / "review.duckdb", 0, target["cluster"], "reject", "not for training")
        run_chain(root)
    finally:
        os.chdir(old)
    return root, first, target, curation_rejects


def test_a_cluster_rejected_in_review_leaves_every_train_set_with_its_reason(chain):
    root, first, target, _ = chain
    gone = rejected(root, "clustered", "cluster_rejected")
    assert len(gone) == target["size"] and gone & first  # they trained before the review
    assert not gone & trained_ids(root)


def test_classifier_and_semantic_dedup_rejects_never_reach_training(chain):
    root, first, _, (low_quality, semantic) = chain
    assert low_quality and semantic
    assert not (low_quality | semantic) & first  # the run before the review
    assert not (low_quality | semantic) & trained_ids(root)  # and the one after it


def test_every_listed_object_is_trained_on_or_rejected_with_a_reason(chain):
    root, *_ = chain
    listed = set(pq.read_table(root / "data" / "source" / "listing.parquet", columns=["id"]).column("id").to_pylist())
    rejects = set()
    for step in [*MAIN_CHAIN, PACKS[0]]:  # the first rung trains on the whole pool (its mix: pretrain)
        rejects |= {r["id"] for r in read_dataset(root / "data" / step.key / "rejected").to_pylist()}
    kept = set(train_ids(root / "data" / PACKS[0].key))
    assert kept | rejects == listed and not kept & rejects
