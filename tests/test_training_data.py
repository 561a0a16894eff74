"""The training stream over the pack stage's shards: one bucket per batch, seeded epochs, exact resume, and
each data-parallel rank reading only its own rows."""

import itertools
import json

import pytest
from fresh import in_fresh_process

from training.core.data import DataPosition, TrainSet, holdout_ids
from training.testing import scene_rows, write_pack_output

BUCKETS = ((32, 32), (24, 40))


@pytest.fixture(scope="module")
def table():
    return scene_rows(40, seed=3, buckets=BUCKETS, batch_size=6)


@pytest.fixture(scope="module")
def pack(table, tmp_path_factory):
    return write_pack_output(tmp_path_factory.mktemp("pack"), table, shard_bytes=8_000)  # several shards


@pytest.fixture(scope="module")
def train_set(pack):
    return TrainSet.from_dir(pack, max_batch_size=4, holdout=5)


def one_epoch(train_set, seed=0, epoch=0, **rank):
    stream = train_set.stream(seed=seed, start=DataPosition(epoch), **rank)
    return list(itertools.takewhile(lambda b: b.position.epoch == epoch, stream))


def test_the_set_is_cut_into_several_shards_between_packed_batches(train_set):
    assert len(train_set.manifest.shards) >= 3
    for k in range(len(train_set.manifest.shards)):
        packed = train_set.open_shard(k).column("batch")
        assert packed == sorted(packed)  # a batch lies in one shard
    others = [set(train_set.open_shard(k).column("batch")) for k in range(len(train_set.manifest.shards))]
    assert all(not (a & b) for a, b in itertools.combinations(others, 2))


def test_every_batch_comes_from_one_bucket_with_pixels_of_that_size(train_set):
    for b in one_epoch(train_set):
        h, w = map(int, b.bucket.split("x"))
        assert b.pixels.shape == (b.size, h, w, 3)
        assert 1 <= b.size <= 4


def test_an_epoch_yields_every_training_row_once_and_never_a_held_out_row(train_set, table):
    held = holdout_ids(table.column("id").to_pylist(), 5)
    for epoch in (0, 1):
        ids = [i for b in one_epoch(train_set, epoch=epoch) for i in b.ids]
        assert len(ids) == len(set(ids)) == table.num_rows - 5
        assert set(ids) | held == set(table.column("id").to_pylist())


def test_epoch_zero_keeps_pack_order_and_later_epochs_reshuffle_deterministically(train_set, table, pack):
    order = [i for i in table.sort_by("order").column("id").to_pylist() if i not in train_set.held_out]
    assert [i for b in one_epoch(train_set) for i in b.ids] == order
    code = (
        "import itertools, json, pathlib; from training.core.data import TrainSet, DataPosition\n"
        f"s = TrainSet.from_dir(pathlib.Path({str(pack)!r}), max_batch_size=4, holdout=5)\n"
        "print(json.dumps([p.ids for p in itertools.islice(s.planned(7, DataPosition(1)), 8)]))"
    )
    ids = [list(p.ids) for p in itertools.islice(train_set.planned(7, DataPosition(1)), 8)]
    assert in_fresh_process(code) == ids  # what a resumed run, or another rank, shuffles to
    assert train_set.shard_order(1, seed=7) != train_set.shard_order(2, seed=7) or ids != [
        list(p.ids) for p in itertools.islice(train_set.planned(7, DataPosition(2)), 8)
    ]
    assert [b.ids for b in one_epoch(train_set, seed=7, epoch=1)] != [
        b.ids for b in one_epoch(train_set, seed=8, epoch=1)
    ]


def test_resuming_from_a_saved_position_continues_the_same_batch_sequence(train_set):
    straight = list(itertools.islice(train_set.stream(seed=1), 40))
    k = 17  # mid second epoch
    restored = DataPosition.from_dict(straight[k - 1].after.to_dict())
    resumed = list(itertools.islice(train_set.stream(seed=1, start=restored), len(straight) - k))
    assert [b.ids for b in resumed] == [b.ids for b in straight[k:]]
    assert resumed[0].position == straight[k - 1].after and straight[k].position == restored


def test_two_ranks_read_disjoint_shares_whose_union_is_each_global_batch(train_set):
    whole = list(itertools.islice(train_set.stream(seed=2), 30))
    ranks = [list(itertools.islice(train_set.stream(seed=2, dp_rank=r, dp_size=2), 30)) for r in (0, 1)]
    for g, a, b in zip(whole, *ranks):
        assert not set(a.ids) & set(b.ids) and a.ids + b.ids == g.ids
        assert a.total == b.total == g.size and (a.pixels == g.pixels[a.rows]).all()


def test_a_run_resumed_on_one_rank_after_two_repeats_and_skips_nothing(train_set):
    two = [list(itertools.islice(train_set.stream(seed=2, dp_rank=r, dp_size=2), 13)) for r in (0, 1)]
    after = two[0][-1].after
    assert two[1][-1].after == after  # every rank stands at the same global position
    one = list(itertools.islice(train_set.stream(seed=2, start=after), 9))
    straight = list(itertools.islice(train_set.stream(seed=2), 22))
    seen = [a.ids + b.ids for a, b in zip(*two)] + [b.ids for b in one]
    assert seen == [b.ids for b in straight]


def test_hold_out_depends_only_on_which_rows_exist():
    ids = [f"r{i}" for i in range(50)]
    assert holdout_ids(ids, 4) == holdout_ids(list(reversed(ids)), 4)
    assert len(holdout_ids(ids, 4)) == 4 and holdout_ids(ids, 0) == set()


def test_read_ahead_keeps_the_stream_order_whatever_the_worker_count(train_set):
    from model.autoencoder import PixelAutoencoder
    from training.core.loader import Prefetcher, StepInput

    ae = PixelAutoencoder()

    def prepare(work):
        batch = train_set.read(work)
        return StepInput(batch, ae.encode(batch.pixels))

    def first(workers: int, n: int = 12):
        with Prefetcher(train_set.work(seed=0), prepare, workers) as loader:
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
    batch = next(train_set.stream(seed=0))
    cache = LatentCache(tmp_path, ae)
    first = cache.encode(batch.pixels)
    files = sorted(cache.root.glob("*.safetensors"))
    assert len(files) == batch.size and not list(cache.root.glob("*.tmp"))
    assert (cache.encode(batch.pixels) == first).all() and (first == ae.encode(batch.pixels)).all()
    assert sorted(cache.root.glob("*.safetensors")) == files  # read back, not written again


def test_a_missing_shard_stops_the_run_naming_it_or_is_skipped_and_recorded(table, pack, tmp_path):
    import shutil

    from kiln.trainshards import ShardError

    bad = tmp_path / "set"
    shutil.copytree(pack, bad)
    lost = TrainSet.from_dir(pack, 4).manifest.shards[1]
    (bad / lost.tar).unlink()
    with pytest.raises(ShardError, match=r"shard-000001\.tar: missing"):
        TrainSet.from_dir(bad, max_batch_size=4)
    skipping = TrainSet.from_dir(bad, max_batch_size=4, on_bad_shard="skip")
    gone = set(TrainSet.from_dir(pack, 4).open_shard(1).column("id"))
    ids = [i for b in one_epoch(skipping) for i in b.ids]
    assert sorted(ids) == sorted(set(table.column("id").to_pylist()) - gone)  # nothing else is lost
    assert {r["uri"] for r in skipping.skipped} == {str(bad / lost.tar)} and skipping.num_rows == len(ids)


def test_the_texts_to_encode_up_front_are_every_drawable_form_of_the_training_rows(pack, table):
    probs = {"short": 0.5, "long": 0.5, "medium": 0.0, "tags": 0.0, "json": 0.0}
    data = TrainSet.from_dir(pack, 8, holdout=4, form_probs=probs)
    texts = data.drawable_texts(limit=table.num_rows)
    forms = [
        json.loads(f)
        for i, f in zip(table.column("id").to_pylist(), table.column("caption_forms").to_pylist())
        if i not in data.held_out
    ]
    assert texts == sorted({f[k] for f in forms for k in ("short", "long")})  # nothing of p = 0, no held-out row
    drawn = {c for b in itertools.islice(data.stream(0), 40) for c in b.captions}
    assert drawn <= set(texts)  # what the stream draws over several epochs
    assert data.drawable_texts(limit=table.num_rows - 1) is None  # a larger set: nothing read, nothing up front
