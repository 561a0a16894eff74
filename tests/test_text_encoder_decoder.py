"""A decoder-only text backbone (Qwen2 / Qwen3 `AutoModel` from a folder) through kiln's own path: loaded from
`model.text_encoder.path`, its causal states of the configured layers are the HF model's own for the caption's
tokens, whatever padding the batch adds on either side (the mask reaches the model), through the trainer's
TextCache too; and the empty caption, zero tokens for a tokenizer with no BOS, keeps one position (the text
refiner's attention needs a key; the cache and null_text then agree) and gives a finite velocity."""

import json

import pytest
import torch

from model.testing import WORDS, micro_model_config
from training.core.text_cache import TextCache
from training.core.trainer import init_generator

SHORT, LONG = "a red circle", "two large blue squares on the left of a green tree"
LAYERS = [-1, -2, 0]


def write_tiny_decoder(directory, arch: str, padding_side: str):
    """A random Qwen2Model / Qwen3Model (hidden 32, 2 layers, GQA) + Qwen2's tokenizer class (byte-level BPE, no
    BOS, pad <|endoftext|>) over merges learnt from a small vocabulary, saved with save_pretrained."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Config, Qwen2Model, Qwen3Config, Qwen3Model
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(
        [" ".join(WORDS)] * 4,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Qwen2Tokenizer(vocab=model["vocab"], merges=merges, padding_side=padding_side)
    tok.save_pretrained(str(directory))
    shape = {
        "vocab_size": len(tok),
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 64,
    }
    config, cls = (
        (Qwen2Config(**shape), Qwen2Model) if arch == "qwen2" else (Qwen3Config(head_dim=8, **shape), Qwen3Model)
    )
    torch.manual_seed(0)
    cls(config).eval().save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module", params=[(a, s) for a in ("qwen2", "qwen3") for s in ("right", "left")], ids=str)
def decoder(request, tmp_path_factory):
    arch, side = request.param
    return write_tiny_decoder(tmp_path_factory.mktemp(f"{arch}-{side}"), arch, side), arch, side


def _hf_states(directory, caption: str) -> torch.Tensor:
    """The HF model's own hidden states of LAYERS for the caption alone, unpadded: [n_layers, tokens, D]."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(str(directory)).eval()
    ids = AutoTokenizer.from_pretrained(str(directory))(caption, return_tensors="pt")
    with torch.no_grad():
        states = model(**ids, output_hidden_states=True).hidden_states
    return torch.stack([states[i][0] for i in LAYERS])


def test_caption_states_are_the_models_own_whatever_the_padding(decoder):
    directory, arch, side = decoder
    gens = [
        init_generator(
            micro_model_config(directory, text_encoder={"path": str(directory), "max_length": n, "layers": LAYERS}), 0
        )
        for n in (16, 24)
    ]
    backbone = gens[0].backbone.model
    assert type(backbone).__name__ == f"{arch.capitalize()}Model" and gens[0].backbone.tokenizer.padding_side == side
    for caption in (SHORT, LONG):
        want = _hf_states(directory, caption)
        assert 2 < want.shape[1] < 16  # a real span, untruncated at either length
        for gen in gens:
            for batch in ([caption], [SHORT, LONG, caption]):  # alone, and beside other lengths
                k = len(batch) - 1
                # direct, and the trainer's path, whose cache keeps rows in bfloat16 (one ulp: 2**-7 relative)
                for text, rtol in ((gen.encode_text(batch), 1e-4), (TextCache(gen).batch(batch), 2**-7)):
                    mask = text.mask[k]
                    assert int(mask.sum()) == want.shape[1]
                    assert not mask[0] if side == "left" else not mask[-1]  # padded on the tokenizer's side
                    torch.testing.assert_close(text.hidden[k][:, mask], want, atol=1e-5, rtol=rtol)


def test_the_empty_caption_keeps_one_position_and_gives_a_finite_velocity(decoder):
    directory, _, _ = decoder
    gen = init_generator(micro_model_config(directory), 0).eval()
    null = gen.null_text(2)
    assert null.mask.sum(dim=1).tolist() == [1, 1]  # no BOS gives "" no token: its first position stands in
    cached = TextCache(gen, capacity_mb=1).batch([""])
    kept = cached.hidden[:, :, :1]  # the model never sees the rest (masked)
    assert torch.equal(cached.mask, null.mask[:1]) and torch.equal(kept, null.hidden[:1, :, :1].bfloat16().float())
    x, t = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0)), torch.tensor([0.2, 0.8])
    with torch.no_grad():
        v = gen(x, t, null)
        both = gen(x, t, null.where(torch.tensor([True, False]), gen.encode_text([SHORT, SHORT])))
    assert torch.isfinite(v).all() and torch.isfinite(both).all()
