"""`kiln --help` is quick because it loads nothing heavy, and the stage commands name their stages: in their
help, and when the stage is missing or misspelled (a usage error, exit 2, never "overrides is required")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kiln.stage_names import STAGE_MODULES

KILN = str(Path(sys.executable).parent / "kiln")
HEAVY = ("torch", "dagster", "duckdb", "numpy", "pyarrow", "pydantic", "PIL")


def kiln(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([KILN, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", ["stage", "map", "watch"])
def test_the_help_of_a_stage_command_lists_every_stage(command):
    r = kiln(command, "--help")
    assert r.returncode == 0
    listed = " ".join(r.stdout.split())  # argparse wraps the list
    assert all(name in listed for name in STAGE_MODULES), listed


@pytest.mark.parametrize("command", ["stage", "map", "watch"])
def test_a_missing_stage_is_named_and_overrides_are_never_required(command):
    r = kiln(command)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "required: STAGE" in r.stderr and "overrides" not in r.stderr.splitlines()[-1]


@pytest.mark.parametrize("command", ["stage", "map", "watch"])
def test_an_unknown_stage_is_a_usage_error_that_lists_the_stages(command):
    r = kiln(command, "bogus", "--input", "in", "--output", "out") if command != "watch" else kiln(command, "bogus")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "unknown stage 'bogus'; stages: ingest, filter" in r.stderr


def test_the_top_level_help_lists_every_command_even_those_whose_parsers_load_late():
    r = kiln("--help")
    assert r.returncode == 0
    assert all(f" {c} " in r.stdout for c in ("stage", "map", "watch", "train", "run", "review", "annotate"))


def test_kiln_help_imports_no_heavy_module():
    """The guard behind a fast `kiln --help`: the parser and the help path import none of torch, dagster,
    duckdb, numpy, pyarrow, pydantic or PIL (each command imports what it needs when it runs)."""
    probe = (
        "import sys\n"
        "from kiln.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        f"print('imported:', *(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "imported:"


def test_a_deferred_command_still_parses_its_own_options():
    r = kiln("review", "--help")
    assert r.returncode == 0 and "{list,approve,reject,pending}" in r.stdout
