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
from kiln.trainshards import decode_image
from training.core.data import DataPosition, TrainSet
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
def many_rows_pack(many_rows, tmp_path_factory):
    return write_pack_output(tmp_path_factory.mktemp("many"), many_rows, shard_bytes=20_000)


def stream_of(pack, batch_size: int, probs) -> TrainSet:
    return TrainSet.from_dir(pack, max_batch_size=batch_size, form_probs=probs)


@pytest.fixture(scope="module")
def weighted(tmp_path_factory):
    """A pack output whose rows carry WEIGHTS, and the folder it is in (to read it again, as a restarted process would)."""
    table = scene_rows(len(WEIGHTS), seed=6, buckets=BUCKETS, batch_size=4, weights=WEIGHTS)
    folder = write_pack_output(tmp_path_factory.mktemp("weighted"), table, shard_bytes=1_000)
    return table, folder


def read_weighted(folder) -> TrainSet:
    return TrainSet.from_dir(folder, max_batch_size=4, form_probs=DEFAULT_PROBS)


@pytest.mark.parametrize("probs", [DEFAULT_PROBS, TERSE_PROBS], ids=["default", "terse"])
def test_the_loader_yields_caption_forms_at_the_configured_frequencies(many_rows, many_rows_pack, probs):
    train_set = stream_of(many_rows_pack, 8, probs)
    which = form_of_text(many_rows)
    drawn = Counter(which[(i, c)] for b in epochs(train_set, seed=0, n=10) for i, c in zip(b.ids, b.captions))

    n = sum(drawn.values())
    assert n == 4000
    drawable = sorted(f for f, p in probs.items() if p > 0)
    assert set(drawn) == set(drawable)  # a form with probability 0 is never drawn
    result = chisquare([drawn[f] for f in drawable], [n * probs[f] / sum(probs.values()) for f in drawable])
    print(f"{probs}: {dict(drawn)}, chi-square p = {result.pvalue:.3f}")
    assert result.pvalue > 0.001


def test_a_sample_s_form_depends_only_on_seed_epoch_and_row(many_rows, many_rows_pack, tmp_path):
    a = stream_of(many_rows_pack, 8, DEFAULT_PROBS)
    fewer = write_pack_output(tmp_path / "fewer", many_rows.slice(0, 200), shard_bytes=5_000)
    b = stream_of(fewer, 3, DEFAULT_PROBS)  # other rows around it, other batches, other shards

    def captions(train_set, seed: int, epoch: int) -> dict[str, str]:
        batches = epochs(train_set, seed, epoch + 1, DataPosition(epoch))
        return {i: c for x in batches for i, c in zip(x.ids, x.captions)}

    in_b = captions(b, 7, 2)
    assert in_b and all(captions(a, 7, 2)[i] == c for i, c in in_b.items())
    assert captions(a, 7, 2) == captions(a, 7, 2)
    assert captions(a, 7, 1) != captions(a, 7, 2) and captions(a, 7, 1) != captions(
        a, 8, 1
    )  # a new draw per epoch, seed


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
    pixels = {r["id"]: decode_image(r["image"]).tobytes() for r in table.to_pylist()}
    batches = epochs(train_set, seed=0, n=20)
    assert len(set(Counter(b.position.epoch for b in batches for _ in b.ids).values())) > 1  # an epoch's size varies
    for b in batches:
        h, w = map(int, b.bucket.split("x"))
        assert b.pixels.shape == (b.size, h, w, 3) and 1 <= b.size <= 4
        assert all(b.pixels[j].tobytes() == pixels[i] for j, i in enumerate(b.ids))


def test_a_stream_resumed_mid_epoch_is_the_tail_of_the_uninterrupted_stream(weighted):
    table, folder = weighted
    train_set = read_weighted(folder)
    straight = epochs(train_set, seed=3, n=6)
    k = sum(b.position.epoch < 2 for b in straight) + 1  # mid third epoch
    saved = straight[k - 1].after
    resumed = epochs(
        read_weighted(folder), seed=3, n=6, start=DataPosition.from_dict(saved.to_dict())
    )  # a restarted process
    assert saved.epoch == 2 and saved == straight[k].position
    assert [(b.position, b.ids, b.captions) for b in resumed] == [(b.position, b.ids, b.captions) for b in straight[k:]]
    assert all(np.array_equal(a.pixels, b.pixels) for a, b in zip(resumed, straight[k:]))
    last = [b for b in straight if b.position.epoch == 0][-1]  # the end of an epoch rolls over to the next
    assert last.after == DataPosition(1, 0, 0)


def test_with_every_weight_one_epoch_zero_is_the_pack_order(many_rows, tmp_path):
    folder = write_pack_output(tmp_path / "pack", many_rows)
    train_set = TrainSet.from_dir(folder, max_batch_size=8, holdout=0, form_probs=DEFAULT_PROBS)
    assert not train_set.weighted
    epoch0 = epochs(train_set, seed=0, n=1)
    rows = many_rows.sort_by("order")
    assert [i for b in epoch0 for i in b.ids] == rows.column("id").to_pylist()
    packed = [
        tuple(i for i, _ in group)
        for _, group in itertools.groupby(
            zip(rows.column("id").to_pylist(), rows.column("batch").to_pylist()), key=lambda r: r[1]
        )
    ]
    assert [b.ids for b in epoch0] == packed  # the packed batches, intact
    epoch1 = [b.ids for b in epochs(train_set, seed=0, n=2)[len(epoch0) :]]
    assert sorted(epoch1) == sorted(packed) and epoch1 != packed  # later epochs reorder packed batches
