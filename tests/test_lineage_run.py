"""`kiln run` runs the definitions' jobs and says one line per asset on the terminal: rows in, kept,
rejected, seconds. Dagster's event stream stays in the run's event log (the UI), not on the terminal.
Every asset carries a code version, so the UI can say what a code or config edit made stale."""

from __future__ import annotations

import logging
import re

import pytest

ASSETS = ["raw_images", "manifest", "filtered"]


@pytest.fixture
def kiln_run(tmp_path, monkeypatch):
    """`materialize_all` in an empty folder of its own, the root logger's level restored after."""
    from dagster_project.run import materialize_all

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / ".dagster"))
    monkeypatch.setenv("KILN_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("KILN_OVERRIDES", "")  # materialize_all sets it for the graph; restored after
    level = logging.getLogger().level
    yield materialize_all
    logging.getLogger().setLevel(level)


@pytest.mark.slow
@pytest.mark.integration
def test_kiln_run_prints_one_concise_line_per_asset_and_no_dagster_event_stream(kiln_run, capfd):
    assert kiln_run(["data.demo.n=40"], select=ASSETS)
    out = capfd.readouterr()
    terminal = (out.out + out.err).splitlines()
    lines = [line for line in terminal if line.startswith("kiln run: ")]
    assert [line.split()[2] for line in lines] == ASSETS  # one line per asset, in the order they ran
    row = re.compile(r"^kiln run: (manifest|filtered)\s+\d+ in\s+\d+ kept\s+\d+ rejected\s+[\d.]+ s$")
    assert all(row.match(line) for line in lines[1:]), lines
    assert re.match(r"^kiln run: raw_images\s+40 objects listed\s+[\d.]+ s$", lines[0]), lines[0]
    events = [
        line for line in terminal if re.search(r"DEBUG|STEP_START|STEP_SUCCESS|ASSET_MATERIALIZATION|RUN_SUCCESS", line)
    ]
    assert not events, events[:5]


def test_every_asset_has_a_code_version():
    from dagster_project.definitions import defs

    graph = defs.resolve_asset_graph()
    unversioned = [
        k.to_user_string()
        for k in graph.get_all_asset_keys()
        if graph.get(k).is_materializable and graph.get(k).code_version is None
    ]
    assert unversioned == []


def test_an_asset_outside_the_stage_table_is_versioned_by_its_code_and_its_own_config_sections():
    from kiln.config import load_config
    from kiln.lineage import node_code_version
    from kiln.registry import node

    coverage = node("coverage", load_config([]))
    base = node_code_version(coverage, [])
    assert node_code_version(coverage, ["data.concepts.alpha=0.7"]) != base  # its own section
    assert node_code_version(coverage, ["data.filters.min_side=40"]) == base  # another stage's


def test_a_selection_names_what_its_assets_read_but_leaves_out():
    from dagster_project.run import unselected_parents

    assert unselected_parents(["coverage", "mixes"]) == {"coverage": ["rewritten"], "mixes": ["rewritten"]}
    assert unselected_parents(["raw_images", "manifest"]) == {}  # manifest reads raw_images, which is selected


@pytest.mark.slow
@pytest.mark.integration
def test_a_selected_asset_whose_input_was_never_made_fails_naming_the_asset_to_add(kiln_run, capfd):
    assert not kiln_run(["data.demo.n=40"], select=["filtered"])  # data/manifest does not exist
    out = capfd.readouterr()
    assert "kiln run: --select runs only the assets it names (filtered reads manifest)" in out.out
