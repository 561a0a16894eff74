"""The training loader over the pack stage's output: one bucket per batch, seeded epochs, exact resume."""

import itertools

import pyarrow as pa
import pytest
from fresh import in_fresh_process

from kiln.schemas import TRAIN
from training.core.data import DataPosition, TrainSet, holdout_ids, next_position
from training.testing import scene_rows, write_pack_output

BUCKETS = ((32, 32), (24, 40))


@pytest.fixture(scope="module")
def table():
    return scene_rows(40, seed=3, buckets=BUCKETS, batch_size=6)


@pytest.fixture(scope="module")
def pack(table, tmp_path_factory):
    return write_pack_output(tmp_path_factory.mktemp("pack"), table, shard_rows=16)


@pytest.fixture(scope="module")
def train_set(pack):
    return TrainSet.from_dir(pack, max_batch_size=4, holdout=5)


def test_every_batch_comes_from_one_bucket_with_pixels_of_that_size(train_set):
    for b in train_set.batches:
        h, w = map(int, b.bucket.split("x"))
        assert b.pixels.shape == (b.size, h, w, 3)
        assert 1 <= b.size <= 4


def test_an_epoch_yields_every_training_row_once_and_never_a_held_out_row(train_set, table):
    held = holdout_ids(table.column("id").to_pylist(), 5)
    epoch = list(itertools.islice(train_set.stream(seed=0), len(train_set)))
    ids = [i for b in epoch for i in b.ids]
    assert len(ids) == len(set(ids)) == table.num_rows - 5
    assert set(ids) | held == set(table.column("id").to_pylist())


def test_epoch_zero_keeps_pack_order_and_later_epochs_reshuffle_deterministically(train_set, pack):
    assert train_set.epoch_order(0, seed=7) == list(range(len(train_set)))
    code = (
        f"import json, pathlib; from training.core.data import TrainSet\n"
        f"s = TrainSet.from_dir(pathlib.Path({str(pack)!r}), max_batch_size=4, holdout=5); print(json.dumps(s.epoch_order(1, seed=7)))"
    )
    assert in_fresh_process(code) == train_set.epoch_order(
        1, seed=7
    )  # what a resumed run, or another rank, shuffles to
    assert train_set.epoch_order(1, seed=7) != train_set.epoch_order(2, seed=7)
    assert train_set.epoch_order(1, seed=7) != train_set.epoch_order(1, seed=8)
    assert sorted(train_set.epoch_order(3, seed=7)) == list(range(len(train_set)))


def test_resuming_from_a_saved_position_continues_the_same_batch_sequence(train_set):
    straight = list(itertools.islice(train_set.stream(seed=1), 3 * len(train_set)))
    k = len(train_set) + 2  # mid second epoch
    saved = next_position(straight[k - 1].position, len(train_set))
    restored = DataPosition.from_dict(saved.to_dict())
    resumed = list(itertools.islice(train_set.stream(seed=1, start=restored), len(straight) - k))
    assert [b.ids for b in resumed] == [b.ids for b in straight[k:]]
    assert resumed[0].position == saved


def test_hold_out_depends_only_on_which_rows_exist():
    ids = [f"r{i}" for i in range(50)]
    assert holdout_ids(ids, 4) == holdout_ids(list(reversed(ids)), 4)
    assert len(holdout_ids(ids, 4)) == 4


def test_a_packed_batch_that_mixes_buckets_is_refused(table):
    rows = table.to_pylist()
    rows[1] = rows[1] | {
        "batch": rows[0]["batch"],
        "bucket": "8x8",
        "height": 8,
        "width": 8,
        "pixels": bytes(8 * 8 * 3),
    }
    with pytest.raises(ValueError, match="mixes buckets"):
        TrainSet.from_table(
            pa.Table.from_pylist(rows, schema=TRAIN).sort_by([("batch", "ascending"), ("order", "ascending")]), 4
        )


def test_read_ahead_keeps_the_stream_order_whatever_the_worker_count(train_set):
    from model.autoencoder import PixelAutoencoder
    from training.core.loader import Prefetcher, StepInput

    ae = PixelAutoencoder()

    def prepare(batch):
        return StepInput(batch, ae.encode(batch.pixels))

    def first(workers: int, n: int = 12):
        with Prefetcher(train_set.stream(seed=0), prepare, workers) as loader:
            return [next(loader) for _ in range(n)]

    plain, threaded = first(0), first(3)
    assert [i.batch.position for i in threaded] == [i.batch.position for i in plain]
    assert all((a.x0 == b.x0).all() for a, b in zip(plain, threaded))


def test_the_loader_reads_ahead_on_gpus_but_not_on_cpus_unless_told():
    """A loader thread on CPU starts its own OpenMP team and slows the step (benchmarks/bench_trainer_overhead.py)."""
    from kiln.config import load_config
    from training.core.loader import loader_workers

    assert load_config([]).train.loader_workers is None
    assert loader_workers(None, "cpu") == 0
    assert loader_workers(None, "cuda") == 1
    assert loader_workers(2, "cpu") == 2 and loader_workers(0, "cuda") == 0


def test_the_latent_cache_encodes_each_image_once_and_returns_the_same_latents(train_set, tmp_path):
    from model.autoencoder import LatentCache, PixelAutoencoder

    ae = PixelAutoencoder()
    batch = train_set.batches[0]
    cache = LatentCache(tmp_path, ae)
    first = cache.encode(batch.pixels)
    files = sorted(cache.root.glob("*.safetensors"))
    assert len(files) == batch.size and not list(cache.root.glob("*.tmp"))
    assert (cache.encode(batch.pixels) == first).all() and (first == ae.encode(batch.pixels)).all()
    assert sorted(cache.root.glob("*.safetensors")) == files  # read back, not written again
