"""The trainer streams its train set: two gloo ranks read disjoint shares whose union is every global batch;
a run reading its shards from S3 and killed with SIGKILL resumes to the uninterrupted run's weights, bit for
bit; and a run started on two ranks continues on one with the very next global batch."""

from __future__ import annotations

import itertools
import json
import os
import socket
from pathlib import Path

import pytest
import torch
from fresh import run_until_killed
from safetensors.torch import load_file

from training.core.data import DataPosition, TrainSet
from training.core.telemetry import read_metrics
from training.testing import scene_rows, tiny_config, write_pack_output

PROBS = {"long": 0.5, "medium": 0.2, "short": 0.15, "tags": 0.1, "json": 0.05}
WEIGHTS = [1.0, 2.0, 0.5, 0.0, 1.5] * 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _environ(rank: int, world: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )


def _stream_worker(rank: int, world: int, port: int, data: str, out: str) -> None:
    import torch.distributed as dist

    _environ(rank, world, port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    train_set = TrainSet.from_dir(data, max_batch_size=4, holdout=3, form_probs=PROBS)
    mine = [
        (b.position.to_dict(), list(b.ids), list(b.captions))
        for b in itertools.islice(train_set.stream(5, DataPosition(), rank, world), 40)
    ]
    every = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        Path(out).write_text(json.dumps(every))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def weighted(tmp_path_factory):
    table = scene_rows(len(WEIGHTS), seed=8, buckets=((32, 32), (24, 40)), batch_size=4, weights=WEIGHTS)
    return write_pack_output(tmp_path_factory.mktemp("weighted"), table, shard_bytes=4_000)


@pytest.mark.distributed
def test_two_gloo_ranks_read_disjoint_shares_whose_union_is_each_global_batch(weighted, tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "ranks.json"
    mp.spawn(_stream_worker, args=(2, _free_port(), str(weighted), str(out)), nprocs=2, join=True)
    rank0, rank1 = json.loads(out.read_text())
    whole = list(itertools.islice(TrainSet.from_dir(weighted, 4, 3, PROBS).stream(5), 40))
    assert len({b.position.epoch for b in whole}) >= 3  # several weighted epochs, each drawn anew
    for (pos0, ids0, caps0), (pos1, ids1, caps1), b in zip(rank0, rank1, whole):
        assert pos0 == pos1 == b.position.to_dict()
        assert not set(ids0) & set(ids1) or len(set(b.ids)) < len(b.ids)  # only a row drawn twice may be on both
        assert ids0 + ids1 == list(b.ids) and caps0 + caps1 == list(b.captions)  # the weighted draw, the forms


KILLER = """
import os, signal, sys, time
from pathlib import Path
import training.core.telemetry as telemetry
from training.core.dcp import latest_checkpoint
from training.testing import tiny_config
from training.core.trainer import train

data, out, te = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
log = telemetry.Telemetry.log

def log_then_die(self, record):
    log(self, record)
    if record.step == 6:  # mid-epoch, two steps after the step-4 checkpoint
        while latest_checkpoint(out) is None or latest_checkpoint(out).name != "step-000004":
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)

telemetry.Telemetry.log = log_then_die
train(data, out, tiny_config(te, steps=8, warmup_steps=2, holdout=0, dcp={"every": 4, "keep": 2, "async_save": False}))
"""


def _cfg(te: Path):
    return tiny_config(te, steps=8, warmup_steps=2, holdout=0, dcp={"every": 4, "keep": 2, "async_save": False})


def _train_worker(rank: int, world: int, port: int, data: str, out: str, te: str) -> None:
    from training.core.trainer import train

    _environ(rank, world, port)
    train(data, Path(out), _cfg(Path(te)), stop_at=4)


@pytest.fixture(scope="module")
def on_s3(s3_server, tmp_path_factory):
    import boto3

    local = write_pack_output(
        tmp_path_factory.mktemp("pack"), scene_rows(80, seed=9, buckets=((32, 32),), batch_size=8), shard_bytes=10_000
    )
    s3 = boto3.client("s3", endpoint_url=s3_server)
    s3.create_bucket(Bucket="train-sets")
    for p in local.rglob("*"):
        if p.is_file():
            s3.put_object(Bucket="train-sets", Key=f"scenes/{p.relative_to(local)}", Body=p.read_bytes())
    return "s3://train-sets/scenes"


@pytest.fixture(scope="module")
def uninterrupted(on_s3, text_encoder_dir, tmp_path_factory):
    from training.core.trainer import train

    return train(on_s3, tmp_path_factory.mktemp("whole") / "run", _cfg(text_encoder_dir))


@pytest.mark.s3
@pytest.mark.slow
def test_a_run_streaming_from_s3_killed_mid_epoch_resumes_bit_identical(
    on_s3, uninterrupted, text_encoder_dir, tmp_path
):
    from training.core.trainer import train

    out = tmp_path / "run"
    run_until_killed(KILLER, on_s3, str(out), str(text_encoder_dir))
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(1, 7))
    train(on_s3, out, _cfg(text_encoder_dir), resume=True)
    a, b = load_file(str(out / "model.safetensors")), load_file(str(uninterrupted / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in read_metrics(out / "metrics.jsonl")] == [
        r["loss"] for r in read_metrics(uninterrupted / "metrics.jsonl")
    ]


@pytest.mark.s3
@pytest.mark.slow
@pytest.mark.distributed
def test_a_run_started_on_two_ranks_continues_on_one_with_the_next_global_batch(
    on_s3, uninterrupted, text_encoder_dir, tmp_path
):
    import torch.multiprocessing as mp

    from training.core.checkpoint import read_train_state
    from training.core.trainer import train

    out = tmp_path / "run"
    mp.spawn(_train_worker, args=(2, _free_port(), on_s3, str(out), str(text_encoder_dir)), nprocs=2, join=True)
    assert json.loads((out / "dcp" / "step-000004" / "train_state.json").read_text())["world_size"] == 2
    train(on_s3, out, _cfg(text_encoder_dir), resume=True)  # one process now

    assert read_train_state(out).position == read_train_state(uninterrupted).position  # nothing repeated or skipped
    resumed, whole = read_metrics(out / "metrics.jsonl"), read_metrics(uninterrupted / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, 9))
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in whole], rel=1e-4)  # the same batches
