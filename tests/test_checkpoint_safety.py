"""Checkpoints are never lost, never trusted blindly, and never hold a diverged run.

* a fresh run into a folder with checkpoints is refused (nothing deleted) unless told to overwrite;
* an async save is complete as soon as its write is: a run SIGKILLed at step 25 resumes from step 20;
* every checkpoint carries checksums: a flipped or truncated file is named, a bad newest DCP checkpoint
  is skipped for the one before it, a corrupt export is refused by the next rung and by PMA;
* a non-finite loss stops the run (after `train.nonfinite_skip` skipped steps) and non-finite weights
  are never exported;
* a resume on another train set is refused unless allowed;
* a DCP checkpoint kiln did not sign is refused unless trusted, and even then its pickles run nothing.

A micro DiT on demo scenes, as in test_training_dcp.py; the signing key lives in tmp.
"""

import json
import logging
import os
import pickle
import textwrap
from pathlib import Path

import pytest
import torch
from fresh import run_until_killed
from safetensors.torch import load_file, save_file

from training.core.dcp import ResumeMismatch, complete_checkpoints, latest_checkpoint, manifest_name, step_dir
from training.core.dcp_safe import UnsafeCheckpoint, load_metadata, safe_load
from training.core.manifest import KEY_ENV, CheckpointCorrupt, CheckpointUntrusted, read_manifest, write_manifest
from training.core.telemetry import read_metrics
from training.core.trainer import NonFiniteTraining, train
from training.testing import scene_rows, tiny_config, write_pack_output

STEPS = 6


@pytest.fixture(scope="module", autouse=True)
def signing_key_in_tmp(tmp_path_factory):
    """This user's key, made on first use; tests that play another user point KEY_ENV elsewhere."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KEY_ENV, str(tmp_path_factory.mktemp("key") / "kiln-checkpoint.key"))
        yield


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_pack_output(tmp_path_factory.mktemp("pack") / "pack", scene_rows(32, seed=5, batch_size=8))


def _cfg(te, **train):
    return tiny_config(
        te, steps=STEPS, warmup_steps=1, holdout=0, **({"dcp": {"every": 2, "keep": 3, "async_save": False}} | train)
    )


def _flip(path: Path, offset: int = 64, n: int = 4096) -> None:
    raw = bytearray(path.read_bytes())
    for i in range(offset, min(offset + n, len(raw))):
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


def _shard(step: Path) -> Path:
    return next(step.glob("__0_*.distcp"))


def _weights_equal(a: Path, b: Path) -> bool:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return sorted(wa) == sorted(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def whole(tmp_path_factory, data, text_encoder_dir):
    """The uninterrupted run every resumed one must reproduce."""
    return train(data, tmp_path_factory.mktemp("whole") / "run", _cfg(text_encoder_dir))


# ------------------------------------------------------------------------------------- item 2: no loss
def test_a_fresh_run_into_a_folder_with_checkpoints_is_refused_and_deletes_nothing(tmp_path, data, text_encoder_dir):
    out = tmp_path / "run"
    train(data, out, _cfg(text_encoder_dir), stop_at=2)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(FileExistsError, match=r"dcp/step-000002.*--resume.*--overwrite"):
        train(data, out, _cfg(text_encoder_dir))
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before

    train(data, out, _cfg(text_encoder_dir), overwrite=True)  # asked for: the earlier run's checkpoints go
    assert [d.name for d in complete_checkpoints(out)] == ["step-000002", "step-000004", "step-000006"]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(1, STEPS + 1))


def test_kiln_train_refuses_a_folder_with_checkpoints_in_one_plain_line(tmp_path, data, text_encoder_dir, capsys):
    from kiln.cli import main

    out = tmp_path / "run"
    (out / "dcp" / "step-000010").mkdir(parents=True)  # what an earlier run leaves
    (out / "model.safetensors").write_bytes(b"earlier weights")
    assert main(["train", "--data", str(data), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln: ") and "--overwrite" in err and "Traceback" not in err
    assert (out / "model.safetensors").read_bytes() == b"earlier weights" and (out / "dcp" / "step-000010").is_dir()
    with pytest.raises(SystemExit):  # continuing a run and replacing it exclude each other
        main(["train", "--data", str(data), "--out", str(out), "--resume", "--overwrite"])


@pytest.mark.slow  # three short DPO runs
def test_post_training_into_a_folder_with_checkpoints_is_refused_too(tmp_path, text_encoder_dir, whole, capsys):
    """DPO, GRPO, style training and distillation share one runner (training/post/runner.py): a fresh run's
    saves would overwrite the earlier run's step folders and prune the rest, so it is refused like `kiln train`."""
    from test_dpo_train import demo_pairs, with_post

    from kiln.cli import main
    from training.post.dpo import dpo
    from training.style.train import style_train

    pairs, out = demo_pairs(tmp_path / "pairs"), tmp_path / "dpo"
    dpo(whole, pairs, out, with_post(_cfg(text_encoder_dir), dpo_steps=4, save_every=2))
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    shorter = with_post(_cfg(text_encoder_dir), dpo_steps=2, save_every=2)
    with pytest.raises(FileExistsError, match=r"dcp/step-000004.*--resume.*--overwrite"):
        dpo(whole, pairs, out, shorter)
    capsys.readouterr()
    assert main(["dpo", "--checkpoint", str(whole), "--pairs", str(pairs), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln: ") and "--overwrite" in err and "Traceback" not in err
    with pytest.raises(FileExistsError):  # refused before its `start` (the base with a reference pathway) is drawn
        style_train(whole, out, _cfg(text_encoder_dir))
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before

    dpo(whole, pairs, out, shorter, overwrite=True)  # asked for: the earlier run's steps go, none is mixed in
    assert [d.name for d in complete_checkpoints(out)] == ["step-000002"]


# ------------------------------------------------------------------------- item 3: complete when written
KILLER = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    import training.core.telemetry as telemetry
    from training.core.dcp import latest_checkpoint
    from training.testing import tiny_config
    from training.core.trainer import train

    data, out, te = map(Path, sys.argv[1:4])
    log = telemetry.Telemetry.log

    def log_then_die(self, record):
        log(self, record)
        if record.step == 25:  # the step-20 save's write has had 5 steps to finish: then the power goes
            deadline = time.monotonic() + 60
            while latest_checkpoint(out) is None or latest_checkpoint(out).name != "step-000020":
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)

    telemetry.Telemetry.log = log_then_die
    cfg = tiny_config(te, steps=30, warmup_steps=2, holdout=0, dcp={"every": 10, "keep": 3, "async_save": True})
    train(data, out, cfg)
    """
)


@pytest.mark.slow  # 55 steps in a subprocess
def test_a_run_killed_at_step_25_with_async_saves_every_10_resumes_from_step_20(tmp_path, data, text_encoder_dir):
    out = tmp_path / "run"
    run_until_killed(KILLER, str(data), str(out), str(text_encoder_dir))
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(1, 26))
    assert latest_checkpoint(out).name == "step-000020"  # not step 10: the save was marked when written

    cfg = tiny_config(
        text_encoder_dir, steps=30, warmup_steps=2, holdout=0, dcp={"every": 10, "keep": 3, "async_save": True}
    )
    logged_before = (out / "metrics.jsonl").read_text().splitlines()
    train(data, out, cfg, resume=True)
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 31))
    assert (out / "metrics.jsonl").read_text().splitlines()[:20] == logged_before[:20]  # steps 11-20 were not redone


# ----------------------------------------------------------------------------------- item 15: checksums
def test_every_checkpoint_carries_checksums_of_its_files(whole):
    step = step_dir(whole, STEPS)
    listed = read_manifest(step / manifest_name(0), key=None)["files"]
    assert {".metadata", "train_state.json", _shard(step).name} <= set(listed)
    export = read_manifest(whole / "checksums.json", key=None)["files"]
    assert {"model.safetensors", "config.json", "train_state.json", "train_data.json"} <= set(export)


def test_a_flipped_newest_checkpoint_is_skipped_for_the_one_before_it(tmp_path, data, text_encoder_dir, whole, caplog):
    out = tmp_path / "run"
    train(data, out, _cfg(text_encoder_dir), stop_at=4)
    _flip(_shard(step_dir(out, 4)))  # 4 KiB of the newest shard
    with caplog.at_level(logging.WARNING):
        train(data, out, _cfg(text_encoder_dir), resume=True)
    assert "step-000004" in caplog.text and "__0_0.distcp does not match its sha256" in caplog.text
    assert "falling back to step-000002" in caplog.text
    assert _weights_equal(out, whole)  # steps 3-6 redone from step 2: the uninterrupted run, not a corrupt one


def test_a_truncated_shard_is_named_and_nothing_is_resumed_from_it(tmp_path, data, text_encoder_dir):
    out = tmp_path / "run"
    train(data, out, _cfg(text_encoder_dir, dcp={"every": 0}), stop_at=2)  # one checkpoint only
    shard = _shard(step_dir(out, 2))
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointCorrupt, match=rf"{shard}.* bytes, .* were written: truncated"):
        train(data, out, _cfg(text_encoder_dir), resume=True)


def test_a_corrupt_export_is_refused_by_the_next_rung_and_by_pma(tmp_path, data, text_encoder_dir, whole):
    import shutil

    from training.core.pma import average_checkpoints

    bad = tmp_path / "bad"
    shutil.copytree(whole, bad, ignore=shutil.ignore_patterns("dcp"))
    _flip(bad / "model.safetensors", offset=4096, n=64)
    with pytest.raises(CheckpointCorrupt, match=rf"{bad / 'model.safetensors'} does not match its sha256"):
        train(data, tmp_path / "next", _cfg(text_encoder_dir, init_from=str(bad)))
    with pytest.raises(CheckpointCorrupt, match="model.safetensors"):
        average_checkpoints([whole, bad], tmp_path / "pma")


def test_pma_refuses_a_corrupt_step_checkpoint(tmp_path, data, text_encoder_dir):
    from training.core.pma import pma_from_run

    out = train(data, tmp_path / "run", _cfg(text_encoder_dir))
    _flip(step_dir(out, 4) / ".metadata", offset=8, n=16)
    with pytest.raises(CheckpointCorrupt, match=r"step-000004/\.metadata does not match"):
        pma_from_run(out, 3, tmp_path / "pma")


def _nan_start(tmp_path: Path, te) -> Path:
    """A previous rung whose export holds NaN weights (one diverged, or a file from elsewhere)."""
    from model.generator import Generator
    from model.testing import micro_model_config

    folder = tmp_path / "nan_start"
    Generator.build(micro_model_config(te)).save_pretrained(folder)
    weights = load_file(str(folder / "model.safetensors"))
    name = next(k for k in sorted(weights) if k.endswith("weight") and weights[k].ndim == 2)
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def test_a_non_finite_loss_stops_the_run_after_the_allowed_skips_and_exports_nothing(tmp_path, data, text_encoder_dir):
    out = tmp_path / "run"
    with pytest.raises(NonFiniteTraining, match=r"step 3: loss nan.*3 non-finite steps, train.nonfinite_skip=2"):
        train(
            data,
            out,
            _cfg(
                text_encoder_dir,
                init_from=str(_nan_start(tmp_path, text_encoder_dir)),
                nonfinite_skip=2,
                dcp={"every": 0},
            ),
        )
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    assert not (out / "model.safetensors").exists() and complete_checkpoints(out) == []


def test_non_finite_weights_are_never_exported_even_when_every_step_may_be_skipped(tmp_path, data, text_encoder_dir):
    out = tmp_path / "run"
    with pytest.raises(NonFiniteTraining, match="the weights hold NaN or inf"):
        train(
            data,
            out,
            _cfg(
                text_encoder_dir,
                init_from=str(_nan_start(tmp_path, text_encoder_dir)),
                nonfinite_skip=1000,
                dcp={"every": 0},
            ),
        )
    assert not (out / "model.safetensors").exists() and complete_checkpoints(out) == []


def test_post_training_never_exports_non_finite_weights_either(tmp_path, whole, text_encoder_dir):
    """DPO, GRPO, style training and distillation export through one runner: a policy whose weights went
    NaN (a diverged step the loop's own grad-norm checks missed) stops there, and no model.safetensors is
    written for the next stage to read."""
    from training.post.runner import open_run

    out = tmp_path / "grpo"
    with pytest.raises(NonFiniteTraining, match=r"grpo: the export to .* refused: the weights hold NaN or inf"):
        with open_run("grpo", whole, out, _cfg(text_encoder_dir), resume=False, lr=1e-4, step_key="iteration") as run:
            with torch.no_grad():
                next(run.policy.parameters()).fill_(float("nan"))
            run.export(whole, {"iterations": 1})
    assert not (out / "model.safetensors").exists() and not (out / "checksums.json").exists()


def test_a_step_with_a_non_finite_loss_applies_no_update(text_encoder_dir, tmp_path):
    from training.core.data import TrainSet
    from training.core.muon import make_optimizer
    from training.core.trainer import Learner, StepBatch, init_generator, setup_runtime, step_generator, train_step

    cfg = _cfg(text_encoder_dir).train
    gen = init_generator(_cfg(text_encoder_dir).model, 0)
    opt = make_optimizer(gen, cfg)
    batch = next(TrainSet.from_dir(write_pack_output(tmp_path / "pack", scene_rows(8, seed=1)), 8).stream(0))
    x0 = gen.autoencoder.encode(batch.pixels)
    text = gen.encode_text(list(batch.captions))
    before = {k: v.clone() for k, v in gen.state_dict().items()}
    x0[0, 0, 0, 0] = float("nan")
    result = train_step(
        Learner(gen, opt, cfg, setup_runtime(cfg)),
        StepBatch(x0, text, gen.null_text(batch.size)),
        step_generator(0, 0),
        1e-3,
        1.0,
    )
    assert result.skipped and result.loss != result.loss
    assert all(torch.equal(before[k], v) for k, v in gen.state_dict().items()) and not opt.state


def test_nonfinite_skip_has_bounds():
    from pydantic import ValidationError

    from kiln.config import TrainConfig

    with pytest.raises(ValidationError, match="nonfinite_skip"):
        TrainConfig(nonfinite_skip=-1)


# --------------------------------------------------------------------------------- item 16: the data
def test_a_resume_on_another_train_set_is_refused_unless_allowed(tmp_path, data, text_encoder_dir, caplog):
    from training.core.data import dataset_version

    out = tmp_path / "run"
    train(data, out, _cfg(text_encoder_dir), stop_at=2)
    assert json.loads((step_dir(out, 2) / "train_state.json").read_text())["train_set_version"] == dataset_version(data)
    other = write_pack_output(tmp_path / "other", scene_rows(32, seed=6, batch_size=8))
    with pytest.raises(
        ResumeMismatch,
        match=f"trained on train set {dataset_version(data)}, this run reads {dataset_version(other)}.*allow_train_set_change",
    ):
        train(other, out, _cfg(text_encoder_dir), resume=True)
    with caplog.at_level(logging.WARNING):
        train(
            other,
            out,
            _cfg(text_encoder_dir, dcp={"every": 2, "keep": 3, "async_save": False, "allow_train_set_change": True}),
            resume=True,
        )
    assert "allowed by train.dcp.allow_train_set_change" in caplog.text
    assert json.loads((step_dir(out, STEPS) / "train_state.json").read_text())["train_set_version"] == dataset_version(
        other
    )


# ------------------------------------------------------------------------------ item 18: code execution
def test_a_checkpoint_signed_with_another_key_is_refused_unless_trusted(
    tmp_path, data, text_encoder_dir, monkeypatch, whole
):
    out = tmp_path / "run"
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "someone-elses.key"))  # a checkpoint pulled from a DVC remote
    train(data, out, _cfg(text_encoder_dir), stop_at=4)
    monkeypatch.undo()
    with pytest.raises(
        CheckpointCorrupt,
        match=r"(?s)trust_unsigned=true.*step-000004/checksums-rank00000.json is not signed with this user's checkpoint key",
    ):
        train(data, out, _cfg(text_encoder_dir), resume=True)
    assert complete_checkpoints(out)  # refused, not deleted
    train(
        data,
        out,
        _cfg(text_encoder_dir, dcp={"every": 2, "keep": 3, "async_save": False, "trust_unsigned": True}),
        resume=True,
    )
    assert _weights_equal(out, whole)


class _RunsCode:
    """What a hostile checkpoint pickles: unpickling it creates `marker` (any command could run instead)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_crafted_dcp_metadata_runs_no_code_even_when_trusted(tmp_path, data, text_encoder_dir):
    out = tmp_path / "run"
    train(data, out, _cfg(text_encoder_dir, dcp={"every": 0}), stop_at=2)
    step = step_dir(out, 2)
    marker = tmp_path / "pwned"
    (step / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    listed = read_manifest(step / manifest_name(0), key=None)
    write_manifest(
        step,
        manifest_name(0),
        [n for n in listed["files"] if n != "train_state.json"],
        b"an attacker's key" * 2,
        pending={"train_state.json": (step / "train_state.json").read_bytes()},
    )

    with pytest.raises(CheckpointCorrupt, match="not signed"):  # untrusted: refused before a byte is unpickled
        train(data, out, _cfg(text_encoder_dir), resume=True)
    with pytest.raises(UnsafeCheckpoint, match=r"\.metadata: .*names pathlib\.Path\.touch"):
        train(data, out, _cfg(text_encoder_dir, dcp={"every": 0, "trust_unsigned": True}), resume=True)
    with pytest.raises(UnsafeCheckpoint):
        load_metadata(step / ".metadata")
    assert not marker.exists()


def test_the_metadata_of_a_real_checkpoint_reads_with_the_restricted_unpickler(whole):
    metadata = load_metadata(step_dir(whole, STEPS) / ".metadata")
    assert any(k.startswith("model.") for k in metadata.state_dict_metadata)


def test_pickled_values_inside_shards_run_no_code(tmp_path):
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "pwned"
    folder = tmp_path / "ckpt"
    dcp.save({"w": torch.zeros(2), "hyper": _RunsCode(marker)}, checkpoint_id=str(folder), no_dist=True)
    state = {"w": torch.ones(2), "hyper": None}
    with pytest.raises(UnsafeCheckpoint, match="the pickled value hyper is refused by weights_only loading"):
        safe_load(state, folder, no_dist=True)
    assert not marker.exists()


def test_an_unsigned_manifest_is_untrusted():
    with pytest.raises(CheckpointUntrusted, match="has no checksum manifest"):
        read_manifest(Path("/nonexistent/checksums.json"), key=b"k" * 32)


# ------------------------------------------------------------------------------------ two ranks (gloo)
def _rank_worker(rank: int, world: int, port: int, data: str, out: str, te: str, key: str, resume: bool) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        **{KEY_ENV: key},
    )
    cfg = _cfg(Path(te), dcp={"every": 2, "keep": 3, "async_save": True})
    train(Path(data), Path(out), cfg, resume=resume, stop_at=None if resume else 4)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_sign_their_own_shards_and_fall_back_together_from_a_corrupt_one(tmp_path, data, text_encoder_dir):
    """Each rank hashes its own files when its write is done; on resume each verifies its share, and one
    rank's bad file moves every rank back to the same earlier checkpoint (no rank loads a different step)."""
    import socket

    import torch.multiprocessing as mp

    def launch(resume: bool) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(
            _rank_worker,
            args=(2, port, str(data), str(out), str(text_encoder_dir), os.environ[KEY_ENV], resume),
            nprocs=2,
            join=True,
        )

    out = tmp_path / "run"
    launch(resume=False)
    step = step_dir(out, 4)
    assert [d.name for d in complete_checkpoints(out)] == ["step-000002", "step-000004"]
    assert {json.loads((step / manifest_name(r)).read_text())["rank"] for r in (0, 1)} == {0, 1}
    _flip(next(step.glob("__1_*.distcp")))  # rank 1's shard of the newest checkpoint
    launch(resume=True)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(1, STEPS + 1))
    assert json.loads((step_dir(out, STEPS) / "train_state.json").read_text())["world_size"] == 2
