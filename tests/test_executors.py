"""One executor interface: the same input gives the same kept and rejected rows, row for row, whichever executor
the profile picks (in-process, a process pool, the warehouse queue, a Slurm array)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from kiln.config import load_config
from kiln.executors import execute, executor_of
from kiln.stage import read_dataset, run_stage


def rows(out) -> tuple[list[dict], list[dict]]:
    kept = read_dataset(out / "kept").sort_by("id").to_pylist()
    rejected = read_dataset(out / "rejected").sort_by("id").to_pylist()
    return kept, rejected


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    """The mixed file zoo, ingested in shards of 4 so that the pool and the queue really split it."""
    from samples import mixed_files

    root = tmp_path_factory.mktemp("executors")
    for name, (data, _) in mixed_files().items():
        (root / "raw" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "raw" / name).write_bytes(data)
    run_stage("ingest", root / "raw", root / "manifest", load_config(["data.ingest.shard_size=4"]))
    return root


def test_the_profile_picks_the_executor():
    assert executor_of(load_config()) == "pool"
    assert executor_of(load_config(["cluster=test"])) == "slurm_array"
    assert executor_of(load_config(["cluster.executor=queue"])) == "queue"


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["filter", "dedup"])
def test_inprocess_pool_and_embedded_queue_give_the_same_rows(manifest, tmp_path, monkeypatch, stage):
    monkeypatch.delenv("KILN_PG_DSN", raising=False)
    monkeypatch.setenv("KILN_DATA", str(tmp_path / "data"))  # the embedded queue's warehouse, not the checkout's data/
    source = manifest / "manifest"
    if stage == "dedup":
        execute("filter", source, tmp_path / "src", load_config(["cluster.executor=inprocess"]))
        source = tmp_path / "src"
    outs = {}
    for executor in ("inprocess", "pool", "queue"):
        cfg = load_config([f"cluster.executor={executor}", "cluster.workers=2", "data.ingest.shard_size=4"])
        summary = execute(stage, source, tmp_path / executor, cfg)
        assert summary.input_rows == summary.kept + summary.rejected
        outs[executor] = rows(tmp_path / executor)
    assert outs["pool"] == outs["inprocess"] and outs["queue"] == outs["inprocess"]
    kept, rejected = outs["inprocess"]
    assert kept and (rejected or stage == "dedup")  # the zoo has broken files for the filter to reject


@pytest.mark.postgres
def test_the_postgres_queue_gives_the_same_rows(manifest, tmp_path, monkeypatch, dsn):
    monkeypatch.setenv("KILN_PG_DSN", dsn)
    execute("filter", manifest / "manifest", tmp_path / "pg", load_config(["cluster.executor=queue"]))
    execute("filter", manifest / "manifest", tmp_path / "ref", load_config(["cluster.executor=inprocess"]))
    assert rows(tmp_path / "pg") == rows(tmp_path / "ref")


@pytest.mark.slurm
@pytest.mark.integration
def test_a_slurm_array_gives_the_same_rows(manifest, tmp_path, slurm_cluster):
    cfg = load_config(["cluster=test", f"cluster.log_dir={tmp_path / 'slurm'}", "cluster.poll_s=0.3"])
    execute("filter", manifest / "manifest", tmp_path / "array", cfg)
    execute("filter", manifest / "manifest", tmp_path / "ref", load_config(["cluster.executor=inprocess"]))
    assert rows(tmp_path / "array") == rows(tmp_path / "ref")


def test_a_stage_is_set_up_once_per_worker_before_its_first_shard(monkeypatch):
    import kiln.stage as stage_module
    from kiln.schemas import REJECTED
    from kiln.stage import Stage, StageOutput, run_on_tables

    calls = []
    schema = pa.schema([pa.field("id", pa.string(), nullable=False)])
    probe = Stage(
        "probe",
        lambda t, cfg: StageOutput(t, REJECTED.empty_table()),
        schema,
        schema,
        setup=lambda cfg: calls.append("setup"),
    )
    monkeypatch.setattr(stage_module, "get_stage", lambda name: probe)
    shards = [pa.table({"id": [f"{i}-{j}" for j in range(3)]}, schema=schema) for i in range(4)]
    out = run_on_tables(probe, shards, load_config(), workers=1)
    assert calls == ["setup"] and sum(o.kept.num_rows for o in out) == 12
