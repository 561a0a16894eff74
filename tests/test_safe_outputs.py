"""Stage outputs are safe to write: kiln never deletes what it did not write, swaps outputs whole, and a reader
notices a shard that changed after its stage wrote it (docs/safe-outputs.md)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pyarrow as pa
import pytest

from kiln.cli import main
from kiln.config import load_config
from kiln.outputs import MARKER, ChecksumError, OutputError, output_hash, staged_output, swap_in
from kiln.schemas import REJECTED
from kiln.stage import (
    StageOutput,
    get_stage,
    read_dataset,
    run_stage,
    write_stage_output,
)

INPROCESS = ["cluster.executor=inprocess"]


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> Path:
    """Six pictures ingested into a manifest (three shards of two), once for the module; tests copy it if they change it."""
    from samples import encoded, scene

    root = tmp_path_factory.mktemp("safe")
    for i in range(6):
        (root / "raw" / f"{i}.png").parent.mkdir(parents=True, exist_ok=True)
        (root / "raw" / f"{i}.png").write_bytes(encoded(scene(i), "PNG"))
    run_stage("ingest", root / "raw", root / "manifest", load_config([*INPROCESS, "data.ingest.shard_size=2"]))
    return root / "manifest"


def kiln_stage(*args: str) -> int:
    return main(["stage", *args, *INPROCESS])


def files_under(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(parent: Path) -> list[str]:
    """Temporary or set-aside folders a write left beside its output (not .profiles/, the drift checks' store
    of each output's previous profile, kept beside the outputs on purpose: assets/drift.py)."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".") and p.name != ".profiles")


# ------------------------------------------------------------------------------- the input is never an output
@pytest.mark.parametrize(
    "output, message",
    [
        (lambda m: m, "is the input"),
        (lambda m: m / "filtered", "is inside the input"),
        (lambda m: m.parent, "contains the input"),
    ],
    ids=["equal", "inside", "containing"],
)
def test_an_output_that_overlaps_the_input_is_refused_and_nothing_is_deleted(manifest, output, message, capsys):
    before = files_under(manifest)
    assert kiln_stage("filter", "--input", str(manifest), "--output", str(output(manifest)), "--overwrite") == 2
    assert message in capsys.readouterr().err
    assert files_under(manifest) == before


def test_the_raw_images_survive_an_ingest_whose_output_is_their_folder(manifest, capsys):
    raw = manifest.parent / "raw"
    before = files_under(raw)
    assert kiln_stage("ingest", "--input", str(raw), "--output", str(raw)) == 2
    assert "is the input" in capsys.readouterr().err
    assert files_under(raw) == before


def test_the_slurm_array_door_refuses_before_submitting_anything(manifest):
    from kiln.executors.slurm_array import run_stage_array

    with pytest.raises(OutputError, match="is the input"):  # no Slurm needed: the check comes before any job
        run_stage_array("filter", manifest, manifest, load_config(["cluster=test"]))


# ----------------------------------------------------------------------------- what kiln did not write stays
def test_a_folder_that_is_no_kiln_output_is_refused_unless_overwrite(manifest, tmp_path, capsys):
    out = tmp_path / "photos"
    out.mkdir()
    (out / "holiday.jpg").write_bytes(b"precious")
    assert kiln_stage("filter", "--input", str(manifest), "--output", str(out)) == 2
    err = capsys.readouterr().err
    assert "is not a kiln stage output" in err and "holiday.jpg" in err
    assert (out / "holiday.jpg").read_bytes() == b"precious"

    assert kiln_stage("filter", "--input", str(manifest), "--output", str(out), "--overwrite") == 0
    assert not (out / "holiday.jpg").exists() and (out / MARKER).is_file()


def test_a_file_added_to_a_kiln_output_is_named_and_kept(manifest, tmp_path, capsys):
    out = tmp_path / "filtered"
    assert kiln_stage("filter", "--input", str(manifest), "--output", str(out)) == 0
    (out / "kept" / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert kiln_stage("filter", "--input", str(manifest), "--output", str(out)) == 2
    err = capsys.readouterr().err
    assert "holds files kiln did not write" in err and "kept/notes.txt" in err
    assert (out / "kept" / "notes.txt").read_text() == "mine"


def test_a_kiln_output_is_replaced_by_a_rerun_as_dagster_and_dvc_do(manifest, tmp_path):
    out = tmp_path / "filtered"
    first = run_stage("filter", manifest, out, load_config(INPROCESS))
    (out / "kept" / "part-00000.parquet").write_bytes(
        b"stale"
    )  # kiln's own file, whatever its bytes: a rerun replaces it
    again = run_stage("filter", manifest, out, load_config(INPROCESS))
    assert again == first and read_dataset(out / "kept").num_rows == first.kept
    assert leftovers(tmp_path) == []


def test_an_output_of_a_kiln_from_before_the_marker_is_still_replaced(manifest, tmp_path):
    out = tmp_path / "filtered"
    run_stage("filter", manifest, out, load_config(INPROCESS))
    (out / MARKER).unlink()  # what an older kiln wrote: kept/, rejected/, summary.json naming its stage
    run_stage("filter", manifest, out, load_config(INPROCESS))
    assert (out / MARKER).is_file()


# -------------------------------------------------------------------------------------- the swap and its mode
def test_a_failed_write_leaves_the_old_output_and_no_temporary_folder(manifest, tmp_path):
    out = tmp_path / "filtered"
    run_stage("filter", manifest, out, load_config(INPROCESS))
    before = files_under(out)
    not_the_schema = StageOutput(
        pa.table({"id": ["a"]}), REJECTED.empty_table()
    )  # kept rows without the filter's columns
    with pytest.raises((ValueError, pa.ArrowInvalid)):  # raised while writing kept/, inside the staged folder
        write_stage_output(get_stage("filter"), 2, [not_the_schema], out, load_config(INPROCESS))
    assert files_under(out) == before
    assert leftovers(tmp_path) == []


def test_staged_output_is_removed_when_its_writer_raises(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError), staged_output(out) as tmp:
        (tmp / "half.parquet").write_bytes(b"half")
        raise RuntimeError("the stage failed")
    assert not out.exists() and leftovers(tmp_path) == []


def test_a_swap_whose_new_folder_cannot_move_in_puts_the_old_one_back(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text("old")
    with pytest.raises(FileNotFoundError):
        swap_in(tmp_path / "never-written", out)
    assert (out / "summary.json").read_text() == "old" and leftovers(tmp_path) == []


def test_output_folders_follow_the_umask(manifest, tmp_path):
    old = os.umask(0o027)
    try:
        run_stage("filter", manifest, tmp_path / "filtered", load_config(INPROCESS))
    finally:
        os.umask(old)
    for folder in (tmp_path / "filtered", tmp_path / "filtered" / "kept"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o750, folder


# ------------------------------------------------------------------------------------------- shard checksums
def test_every_file_of_an_output_has_its_sha256_in_the_marker(manifest):
    marker = json.loads((manifest / MARKER).read_text())
    assert marker["stage"] == "ingest"
    assert set(marker["sha256"]) == {f for f in files_under(manifest) if f != MARKER}


def test_the_marker_keeps_the_output_hash_deterministic(manifest, tmp_path):
    run_stage("filter", manifest, tmp_path / "a", load_config(INPROCESS))
    run_stage("filter", manifest, tmp_path / "b", load_config(INPROCESS))
    assert files_under(tmp_path / "a") == files_under(tmp_path / "b")
    assert output_hash(tmp_path / "a") == output_hash(tmp_path / "b")


def test_dvc_hashes_the_marker_as_the_output_hash_does(manifest, tmp_path):
    """Dagster's data version of a step is the md5 dvc.lock records: both see the hidden marker."""
    from dvc_data.hashfile.build import build
    from dvc_data.hashfile.db import HashFileDB
    from dvc_objects.fs.local import LocalFileSystem

    fs = LocalFileSystem()
    _, _, obj = build(HashFileDB(fs, str(tmp_path / "cache")), str(manifest), fs, "md5")
    assert output_hash(manifest) == obj.hash_info.value


def _copy(folder: Path, to: Path) -> Path:
    for rel, data in files_under(folder).items():
        (to / rel).parent.mkdir(parents=True, exist_ok=True)
        (to / rel).write_bytes(data)
    return to


def test_a_flipped_shard_stops_the_next_stage_naming_the_shard(manifest, tmp_path, capsys):
    src = _copy(manifest, tmp_path / "manifest")
    shard = src / "kept" / "part-00001.parquet"
    data = bytearray(shard.read_bytes())
    data[100:164] = bytes(64)  # 64 bytes zeroed inside the data pages
    shard.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="part-00001.parquet"):
        run_stage("filter", src, tmp_path / "filtered", load_config(INPROCESS))
    assert kiln_stage("filter", "--input", str(src), "--output", str(tmp_path / "filtered")) == 2
    assert "part-00001.parquet" in capsys.readouterr().err
    assert not (tmp_path / "filtered").exists()


def test_a_shard_the_stage_never_wrote_is_refused(manifest, tmp_path):
    src = _copy(manifest, tmp_path / "manifest")
    (src / "kept" / "part-00009.parquet").write_bytes((src / "kept" / "part-00000.parquet").read_bytes())
    with pytest.raises(ChecksumError, match="did not write: part-00009.parquet"):
        read_dataset(src / "kept")


# ------------------------------------------------------------------------------------- plain command-line words
def test_a_missing_input_says_it_does_not_exist(tmp_path, capsys):
    assert kiln_stage("filter", "--input", str(tmp_path / "nowhere"), "--output", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "nowhere does not exist" in err and "Traceback" not in err


def test_an_empty_input_warns_and_gives_an_empty_output(tmp_path, caplog):
    (tmp_path / "empty").mkdir()
    with caplog.at_level("WARNING", logger="kiln"):
        assert kiln_stage("filter", "--input", str(tmp_path / "empty"), "--output", str(tmp_path / "out")) == 0
    assert "is empty (0 rows)" in caplog.text
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["input_rows"] == 0


# ------------------------------------------------------------------------------------ doors that own their output
@pytest.mark.slow
@pytest.mark.integration
def test_dagster_rematerializes_into_its_own_outputs(tmp_path, monkeypatch):
    import dagster as dg

    from dagster_project.run import job_for

    monkeypatch.chdir(tmp_path)
    job = job_for(["raw_images", "manifest", "filtered"], everything=False)
    run_config = {
        "resources": {"kiln": {"config": {"overrides": ["data.demo.n=40"], "data_dir": str(tmp_path / "data")}}}
    }
    versions = []
    for _ in range(2):  # the second run replaces the first run's outputs: kiln wrote them, the marker says so
        result = job.execute_in_process(run_config=run_config, instance=dg.DagsterInstance.ephemeral())
        assert result.success
        versions.append(result.asset_materializations_for_node("filtered")[0].tags["dagster/data_version"])
    assert versions[0] == versions[1] == output_hash(tmp_path / "data" / "filtered")
    assert leftovers(tmp_path / "data") == []


@pytest.mark.slurm
@pytest.mark.integration
def test_a_slurm_array_task_checks_its_shard_and_the_merge_leaves_no_scratch(manifest, tmp_path, slurm_cluster):
    from kiln.executors.slurm_array import run_stage_array
    from slurm.jobs import SlurmJobFailed

    cfg = load_config(["cluster=test", f"cluster.log_dir={tmp_path / 'slurm'}", "cluster.poll_s=0.3"])
    src = _copy(manifest, tmp_path / "manifest")
    run_stage_array("filter", src, tmp_path / "filtered", cfg, log=lambda _: None)
    assert (tmp_path / "filtered" / MARKER).is_file()

    shard = src / "kept" / "part-00001.parquet"
    data = bytearray(shard.read_bytes())
    data[100:164] = bytes(64)
    shard.write_bytes(bytes(data))
    with pytest.raises(SlurmJobFailed, match="part-00001.parquet"):
        run_stage_array("filter", src, tmp_path / "filtered", cfg, log=lambda _: None)
    assert (tmp_path / "filtered" / MARKER).is_file()  # the first output stands
    assert leftovers(tmp_path) == []  # no .filtered.array scratch, no temporary folder
