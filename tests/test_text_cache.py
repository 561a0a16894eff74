"""Caption embeddings at the step: encoded when not held, kept up to a byte budget, and the same rows for the
model whether they were just encoded or held (the DiT never sees the padding), so a resumed run, whose cache
starts empty, trains bit for bit as the uninterrupted one."""

import torch

from model.testing import micro_model_config
from training.core.text_cache import TextCache
from training.core.trainer import init_generator

CAPTIONS = [f"a {c} {s} on the {p}" for c in ("red", "blue") for s in ("circle", "square") for p in ("left", "top")]


def test_held_and_fresh_rows_give_the_model_the_same_input(text_encoder_dir):
    gen = init_generator(micro_model_config(text_encoder_dir), 0).eval()
    torch.manual_seed(0)
    with torch.no_grad():  # off its zero-initialised gates, so the text reaches the output
        for p in gen.parameters():
            p.add_(0.05 * torch.randn_like(p))
    cache = TextCache(gen, capacity_mb=10)
    first = cache.batch(CAPTIONS[:5])
    again = cache.batch(CAPTIONS[:5])  # every row held now
    assert cache.encoded == 5 and torch.equal(first.hidden, again.hidden) and torch.equal(first.mask, again.mask)
    encoded = gen.encode_text(CAPTIONS[:5])
    direct = type(encoded)(encoded.hidden.to(torch.bfloat16).to(encoded.hidden.dtype), encoded.mask)  # as stored
    assert torch.equal(first.mask, direct.mask) and first.hidden.dtype == encoded.hidden.dtype
    assert all(row.hidden.dtype == torch.bfloat16 for row in cache.rows.values())  # half float32's bytes
    tokens = first.mask[:, None, :, None].expand_as(first.hidden)
    assert torch.equal(first.hidden[tokens], direct.hidden[tokens])  # the caption's tokens as encoded, in bf16
    x, t = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(0)), torch.linspace(0.1, 0.9, 5)
    with torch.no_grad():
        v = gen(x, t, first)
        assert torch.equal(v, gen(x, t, direct))  # zero padding: the same velocities, bit for bit
        other = cache.batch([" ".join(["shape"] * k) for k in range(1, 6)])  # other lengths: the tiny vocabulary
        assert not torch.equal(v, gen(x, t, other))  # the text does reach them


def test_the_cache_holds_at_most_its_budget_and_drops_the_least_recently_used(text_encoder_dir):
    gen = init_generator(micro_model_config(text_encoder_dir), 0)
    one = TextCache(gen, capacity_mb=1)
    one.batch(CAPTIONS[:1])
    row_bytes = one.held
    cache = TextCache(gen, capacity_mb=3.5 * row_bytes / 1e6)  # room for three rows
    cache.batch(CAPTIONS[:3])
    cache.batch(CAPTIONS[:1])  # the first is the most recent now
    cache.batch(CAPTIONS[3:4])
    assert list(cache.rows) == [CAPTIONS[2], CAPTIONS[0], CAPTIONS[3]] and cache.held <= cache.capacity
    assert cache.encoded == 4
    empty = TextCache(gen, capacity_mb=0)
    assert len(empty.batch(CAPTIONS[:2])) == 2 and len(empty) == 0  # nothing held: every step encodes


def test_prefill_encodes_up_front_while_the_budget_lasts_and_the_steps_are_then_hits(text_encoder_dir):
    gen = init_generator(micro_model_config(text_encoder_dir), 0)
    one = TextCache(gen, capacity_mb=1)
    one.batch(CAPTIONS[:1])
    cache = TextCache(gen, capacity_mb=4.5 * one.held / 1e6)  # about four rows
    assert cache.prefill(CAPTIONS[:6], batch=2) == 4 and cache.held <= cache.capacity  # the third pair does not fit
    cache.batch(CAPTIONS[:4])
    assert cache.encoded == 6  # two batches kept, the third encoded and dropped; the steps then all hit
    whole = TextCache(gen, capacity_mb=10)
    assert whole.prefill(CAPTIONS[:6], batch=4) == 6
    assert torch.equal(whole.batch(CAPTIONS[:3]).hidden, TextCache(gen, capacity_mb=10).batch(CAPTIONS[:3]).hidden)


def test_prefilled_rows_share_one_slab_and_are_never_dropped(text_encoder_dir):
    """Thousands of small row tensors between the encoder's temporaries fragment the C heap: the prefilled rows
    are views of one buffer instead, and the least-recently-used eviction of later misses never takes them."""
    gen = init_generator(micro_model_config(text_encoder_dir), 0)
    one = TextCache(gen, capacity_mb=1)
    one.batch(CAPTIONS[:1])
    cache = TextCache(gen, capacity_mb=5.5 * one.held / 1e6)  # four prefilled rows and about one more
    assert cache.prefill(CAPTIONS[:4], batch=3) == 4
    storages = {row.hidden.untyped_storage().data_ptr() for row in cache.pinned.values()}
    assert len(storages) == 1 and len(cache.rows) == 0
    cache.batch(CAPTIONS[4:7])  # misses beyond the budget: the LRU part drops them, the pinned rows stay
    assert set(cache.pinned) == set(CAPTIONS[:4]) and cache.held <= cache.capacity and len(cache.rows) <= 1
    before = cache.encoded
    cache.batch(CAPTIONS[:4])
    assert cache.encoded == before  # every prefilled caption is still a hit
