"""`kiln map`: a stage over the warehouse queue writes what `kiln stage` writes, on Postgres and embedded alike."""

from __future__ import annotations

import pytest

from kiln.config import load_config
from kiln.databases import connect as db_connect
from kiln.stage import read_dataset, run_stage
from kiln.warehouse.run import run_map


def _ids(folder):
    return sorted(read_dataset(folder / "kept").column("id").to_pylist()), sorted(
        read_dataset(folder / "rejected").column("id").to_pylist()
    )


@pytest.fixture(autouse=True)
def warehouse_in_tmp(tmp_path, monkeypatch):
    """The embedded warehouse lives under the artifact root (KILN_DATA, default ./data): a test's, not the checkout's."""
    monkeypatch.setenv("KILN_DATA", str(tmp_path / "data"))


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    from assets.demo_corpus import write_demo_corpus

    root = tmp_path_factory.mktemp("q")
    write_demo_corpus(root / "raw", n=60, seed=3)
    run_stage("ingest", root / "raw" / "images", root / "manifest", load_config(["cluster.workers=1"]))
    return root


@pytest.mark.integration
def test_map_on_the_embedded_warehouse_matches_the_stage(manifest, tmp_path):
    cfg = load_config(["cluster.workers=1"])
    ref = run_stage("filter", manifest / "manifest", tmp_path / "ref", cfg)
    got = run_map(
        "filter", manifest / "manifest", tmp_path / "q", cfg, dsn=None, workers=2, table="manifest", log=lambda _: None
    )
    assert (got.kept, got.rejected, got.by_reason) == (ref.kept, ref.rejected, ref.by_reason)
    assert _ids(tmp_path / "q") == _ids(tmp_path / "ref")


@pytest.mark.postgres
@pytest.mark.integration
def test_map_on_postgres_matches_the_stage(manifest, tmp_path, dsn):
    from kiln.warehouse import postgres as pg

    with db_connect(dsn) as conn:
        pg.drop_job(conn, "cli_manifest", "filter")
        pg.drop_table(conn, "cli_manifest")
    cfg = load_config(["cluster.workers=1"])
    ref = run_stage("filter", manifest / "manifest", tmp_path / "ref", cfg)
    got = run_map(
        "filter",
        manifest / "manifest",
        tmp_path / "q",
        cfg,
        dsn=dsn,
        workers=2,
        table="cli_manifest",
        log=lambda _: None,
    )
    assert (got.kept, got.rejected, got.by_reason) == (ref.kept, ref.rejected, ref.by_reason)
    assert _ids(tmp_path / "q") == _ids(tmp_path / "ref")


@pytest.mark.postgres
def test_watch_finds_the_jobs_of_a_stage_by_itself(dsn):
    """`kiln map` keys its table names, so `kiln watch STAGE` looks the job up instead of being told the table."""
    import kiln.warehouse as wh
    from kiln.cli.warehouse import job_tables
    from kiln.warehouse import postgres as pg
    from kiln.warehouse.probes import FILTERLIKE, probe_rows

    with db_connect(dsn) as conn:
        pg.drop_job(conn, "q_watch", FILTERLIKE.name)
    assert "q_watch" not in job_tables(FILTERLIKE.name, dsn)
    wh.map(FILTERLIKE, probe_rows(5), dsn=dsn, workers=0, table="q_watch", cfg=load_config())
    assert "q_watch" in job_tables(FILTERLIKE.name, dsn)
    with db_connect(dsn) as conn:
        pg.drop_job(conn, "q_watch", FILTERLIKE.name)


def test_map_refuses_an_output_over_its_input_before_any_work(manifest, tmp_path):
    from kiln.outputs import OutputError

    before = sorted(p.name for p in (manifest / "manifest" / "kept").iterdir())
    with pytest.raises(OutputError):
        run_map(
            "filter",
            manifest / "manifest",
            manifest / "manifest",
            load_config([]),
            dsn=None,
            workers=1,
            log=lambda _: None,
        )
    assert sorted(p.name for p in (manifest / "manifest" / "kept").iterdir()) == before
