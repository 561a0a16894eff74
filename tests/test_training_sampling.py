"""What training samples from what curation made: a caption form per sample and epoch, drawn with
`data.rewrite.form_probs`, and rows drawn by their concept-coverage `sampling_weight`; both
deterministic, so a resumed stream is the uninterrupted one, and with every weight 1 nothing changes."""

import itertools
import json
from collections import Counter

import numpy as np
import pytest
from scipy.stats import binomtest, chisquare

from kiln.config import RewriteConfig
from training.core.data import DataPosition, TrainSet, next_position
from training.testing import scene_rows, write_pack_output

BUCKETS = ((8, 8), (8, 16))
DEFAULT_PROBS = RewriteConfig().form_probs  # long .5, medium .2, short .15, tags .1, json .05
TERSE_PROBS = {"short": 0.6, "tags": 0.3, "json": 0.1, "long": 0.0, "medium": 0.0}
# one row of each kind of weight, then weight-1 rows: 3 and 1 are exact, 0 never, 0.5 and 2.25 stochastically rounded
WEIGHTS = [3.0, 1.0, 0.0, 0.5, 2.25] + [1.0] * 7


def epochs(train_set: TrainSet, seed: int, n: int, start: DataPosition | None = None):
    """The stream's batches (from `start`, else the beginning) up to the end of epoch n - 1."""
    return list(itertools.takewhile(lambda b: b.position.epoch < n, train_set.stream(seed, start or DataPosition())))


def form_of_text(table) -> dict[tuple[str, str], str]:
    """(row id, caption text) -> the form it is; the test data's five texts of a row all differ."""
    out = {}
    for row_id, forms in zip(table.column("id").to_pylist(), table.column("caption_forms").to_pylist()):
        forms = json.loads(forms)
        assert len(set(forms.values())) == len(forms)
        out |= {(row_id, text): form for form, text in forms.items()}
    return out


@pytest.fixture(scope="module")
def many_rows():
    return scene_rows(400, seed=5, buckets=BUCKETS, batch_size=8)


@pytest.fixture(scope="module")
def weighted(tmp_path_factory):
    """A pack output whose rows carry WEIGHTS, and the folder it is in (to read it again, as a restarted process would)."""
    table = scene_rows(len(WEIGHTS), seed=6, buckets=BUCKETS, batch_size=4, weights=WEIGHTS)
    folder = write_pack_output(tmp_path_factory.mktemp("weighted"), table, shard_rows=5)
    return table, folder


def read_weighted(folder) -> TrainSet:
    return TrainSet.from_dir(folder, max_batch_size=4, form_probs=DEFAULT_PROBS)


@pytest.mark.parametrize("probs", [DEFAULT_PROBS, TERSE_PROBS], ids=["default", "terse"])
def test_the_loader_yields_caption_forms_at_the_configured_frequencies(many_rows, probs):
    train_set = TrainSet.from_table(many_rows, 8, form_probs=probs)
    which = form_of_text(many_rows)
    drawn = Counter(which[(i, c)] for b in epochs(train_set, seed=0, n=10) for i, c in zip(b.ids, b.captions))

    n = sum(drawn.values())
    assert n == 4000
    drawable = sorted(f for f, p in probs.items() if p > 0)
    assert set(drawn) == set(drawable)  # a form with probability 0 is never drawn
    result = chisquare([drawn[f] for f in drawable], [n * probs[f] / sum(probs.values()) for f in drawable])
    print(f"{probs}: {dict(drawn)}, chi-square p = {result.pvalue:.3f}")
    assert result.pvalue > 0.001


def test_a_sample_s_form_depends_only_on_seed_epoch_and_row(many_rows):
    a = TrainSet.from_table(many_rows, 8, form_probs=DEFAULT_PROBS)
    b = TrainSet.from_table(many_rows.slice(0, 200), 3, form_probs=DEFAULT_PROBS)  # other rows around it, other batches
    assert all(a.caption_text(i, 7, 2) == b.caption_text(i, 7, 2) for i in b.weights)
    first, again = epochs(a, seed=7, n=3), epochs(a, seed=7, n=3)
    assert [x.captions for x in first] == [x.captions for x in again]

    def captions(seed: int, epoch: int) -> list[str]:
        return [a.caption_text(i, seed, epoch) for i in sorted(a.weights)]

    assert captions(7, 1) != captions(7, 2) and captions(7, 1) != captions(8, 1)  # a new draw per epoch and per seed


def test_every_caption_the_stream_yields_is_in_the_text_cache_list(many_rows):
    train_set = TrainSet.from_table(many_rows, 8, form_probs=TERSE_PROBS)
    cached = set(train_set.captions())
    assert {c for b in epochs(train_set, seed=0, n=5) for c in b.captions} <= cached
    assert not any(
        json.loads(f)["long"] in cached for f in many_rows.column("caption_forms").to_pylist()
    )  # probability 0: not embedded


def test_sampling_weights_set_how_often_a_row_appears(weighted):
    table, folder = weighted
    train_set = read_weighted(folder)
    n_epochs = 400
    seen = Counter(i for b in epochs(train_set, seed=0, n=n_epochs) for i in b.ids)
    ids = table.sort_by("id").column("id").to_pylist()  # scene_rows names rows row00000.. in generation order
    w3, w1, w0, w_half, w_2q = (seen[ids[k]] for k in range(5))
    print(f"over {n_epochs} epochs: weight 3 -> {w3}, 1 -> {w1}, 0 -> {w0}, 0.5 -> {w_half}, 2.25 -> {w_2q}")
    assert (w3, w1, w0) == (3 * n_epochs, n_epochs, 0)  # whole weights are exact every epoch
    assert binomtest(w_half, n_epochs, 0.5).pvalue > 0.001  # floor(0.5) + one copy with probability 0.5
    assert w_2q >= 2 * n_epochs and binomtest(w_2q - 2 * n_epochs, n_epochs, 0.25).pvalue > 0.001
    assert all(seen[i] == n_epochs for i in ids[5:])


def test_weighted_batches_keep_one_bucket_and_each_row_s_own_pixels(weighted):
    table, folder = weighted
    train_set = read_weighted(folder)
    pixels = {r["id"]: r["pixels"] for r in table.to_pylist()}
    batches = epochs(train_set, seed=0, n=20)
    assert len({train_set.epoch_length(e, 0) for e in range(20)}) > 1  # a weighted epoch's length varies
    for b in batches:
        h, w = map(int, b.bucket.split("x"))
        assert b.pixels.shape == (b.size, h, w, 3) and 1 <= b.size <= 4
        assert all(b.pixels[j].tobytes() == pixels[i] for j, i in enumerate(b.ids))


def test_a_stream_resumed_mid_epoch_is_the_tail_of_the_uninterrupted_stream(weighted):
    table, folder = weighted
    train_set = read_weighted(folder)
    straight = epochs(train_set, seed=3, n=6)
    k = train_set.epoch_length(0, 3) + train_set.epoch_length(1, 3) + 1  # mid third epoch
    saved = next_position(straight[k - 1].position, train_set.epoch_length(straight[k - 1].position.epoch, 3))
    resumed = epochs(
        read_weighted(folder), seed=3, n=6, start=DataPosition.from_dict(saved.to_dict())
    )  # a restarted process
    assert saved == DataPosition(2, 1)
    assert [(b.position, b.ids, b.captions) for b in resumed] == [(b.position, b.ids, b.captions) for b in straight[k:]]
    assert all(np.array_equal(a.pixels, b.pixels) for a, b in zip(resumed, straight[k:]))
    last = straight[train_set.epoch_length(0, 3) - 1].position  # the end of an epoch rolls over to the next
    assert next_position(last, train_set.epoch_length(0, 3)) == DataPosition(1, 0)


def test_with_every_weight_one_epoch_zero_is_the_pack_order(many_rows, tmp_path):
    folder = write_pack_output(tmp_path / "pack", many_rows, shard_rows=64)
    train_set = TrainSet.from_dir(folder, max_batch_size=8, holdout=0, form_probs=DEFAULT_PROBS)
    assert not train_set.weighted
    epoch0 = epochs(train_set, seed=0, n=1)
    assert [i for b in epoch0 for i in b.ids] == many_rows.sort_by("order").column("id").to_pylist()
    assert [b.ids for b in epoch0] == [b.ids for b in train_set.batches]  # the packed batches, intact
    epoch1 = [b.ids for b in epochs(train_set, seed=0, n=2)[len(epoch0) :]]
    assert epoch1 == [
        train_set.batches[k].ids for k in train_set.epoch_order(1, seed=0)
    ]  # later epochs reorder packed batches
