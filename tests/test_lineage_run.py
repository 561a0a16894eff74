"""`kiln run` runs the definitions' jobs and says one line per asset on the terminal: rows in, kept,
rejected, seconds. Dagster's event stream stays in the run's event log (the UI), not on the terminal."""

from __future__ import annotations

import logging
import re

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ASSETS = ["raw_images", "manifest", "filtered"]


def test_kiln_run_prints_one_concise_line_per_asset_and_no_dagster_event_stream(tmp_path, monkeypatch, capfd):
    from dagster_project.run import materialize_all

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / ".dagster"))
    monkeypatch.setenv("KILN_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("KILN_OVERRIDES", "")  # materialize_all sets it for the graph; restored after
    level = logging.getLogger().level
    try:
        assert materialize_all(["data.demo.n=40"], select=ASSETS)
    finally:
        logging.getLogger().setLevel(level)
    out = capfd.readouterr()
    terminal = (out.out + out.err).splitlines()
    lines = [line for line in terminal if line.startswith("kiln run: ")]
    assert [line.split()[2] for line in lines] == ASSETS  # one line per asset, in the order they ran
    row = re.compile(r"^kiln run: (manifest|filtered)\s+\d+ in\s+\d+ kept\s+\d+ rejected\s+[\d.]+ s$")
    assert all(row.match(line) for line in lines[1:]), lines
    assert re.match(r"^kiln run: raw_images\s+40 objects listed\s+[\d.]+ s$", lines[0]), lines[0]
    events = [line for line in terminal if re.search(r"DEBUG|STEP_START|STEP_SUCCESS|ASSET_MATERIALIZATION|RUN_SUCCESS", line)]
    assert not events, events[:5]
