"""The report's text encoders by path: a whole T5, umT5 or T5Gemma checkpoint gives its encoder alone, a whole
Qwen3-VL checkpoint its language model alone (AutoModel would build the decoder or the vision tower, and
Qwen3VLTextModel without a key mapping loads nothing, silently); the states are the tower's own. A folder of
another slot, or one that leaves a weight of the tower uninitialised, is refused by name."""

import json

import pytest
import torch

from model.testing import WORDS, write_tiny_autoencoder_kl
from model.text_encoder import TextBackbone, load_text_model

SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}


def t5_tokenizer(directory):
    from transformers import T5Tokenizer

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [("\u2581" + w, -1.0) for w in WORDS]
    tok = T5Tokenizer(vocab=vocab, extra_ids=0)
    tok.save_pretrained(str(directory))
    return len(tok)


def write_t5(directory, kind):
    """A whole random encoder-decoder checkpoint (ForConditionalGeneration), as a lab downloads one."""
    import transformers

    v = t5_tokenizer(directory)
    torch.manual_seed(0)
    if kind == "t5gemma":
        mod = dict(vocab_size=v, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=16,
                   query_pre_attn_scalar=8, **SHAPE)  # fmt: skip
        model = transformers.T5GemmaForConditionalGeneration(
            transformers.T5GemmaConfig(encoder=mod, decoder=mod, vocab_size=v)
        )
    else:
        cfg = dict(vocab_size=v, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, relative_attention_max_distance=16, decoder_start_token_id=0)  # fmt: skip
        config_cls, model_cls = {
            "t5": ("T5Config", "T5ForConditionalGeneration"),
            "umt5": ("UMT5Config", "UMT5ForConditionalGeneration"),
        }[kind]
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**cfg))
    model.eval().save_pretrained(str(directory))
    return model


def write_qwen3_vl(directory):
    from test_text_encoder_decoder import write_tiny_decoder  # its byte-level BPE tokenizer
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    write_tiny_decoder(directory, "qwen3", "right")
    v = json.loads((directory / "config.json").read_text())["vocab_size"]
    (directory / "config.json").unlink()
    (directory / "model.safetensors").unlink()
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    text = dict(
        vocab_size=v, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rope_parameters=rope, **SHAPE
    )
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32, patch_size=4,
                  temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0])  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(text_config=text, vision_config=vision))
    model.eval().save_pretrained(str(directory))
    return model


@pytest.mark.parametrize("kind", ["t5", "umt5", "t5gemma"])
def test_a_whole_encoder_decoder_checkpoint_gives_its_encoders_states(tmp_path, kind):
    full = write_t5(tmp_path, kind)
    backbone = TextBackbone(tmp_path, layers=[-1, 0], max_length=8)
    assert "Encoder" in type(backbone.model).__name__ and backbone.hidden_size == 32
    out = backbone.encode(["a red circle", "two blue squares on the left"])
    tok = backbone.tokenizer(["a red circle"], return_tensors="pt")
    with torch.no_grad():
        own = full.get_encoder()(**tok, output_hidden_states=True).hidden_states
    n = int(tok["attention_mask"].sum())
    assert torch.allclose(out.hidden[0, 0, :n], own[-1][0, :n], atol=1e-5)
    assert torch.allclose(out.hidden[0, 1, :n], own[0][0, :n], atol=1e-5)


def test_a_whole_qwen3_vl_checkpoint_gives_its_language_models_states(tmp_path):
    full = write_qwen3_vl(tmp_path)
    backbone = TextBackbone(tmp_path, layers=[-1, -2], max_length=8)
    assert type(backbone.model).__name__ == "Qwen3VLTextModel"  # no vision tower loaded
    out = backbone.encode(["a red circle"])
    tok = backbone.tokenizer(["a red circle"], return_tensors="pt")
    with torch.no_grad():
        own = full.model.language_model(**tok, output_hidden_states=True).hidden_states
    n = int(tok["attention_mask"].sum())
    assert torch.allclose(out.hidden[0, 0, :n], own[-1][0, :n], atol=1e-5)
    assert torch.allclose(out.hidden[0, 1, :n], own[-2][0, :n], atol=1e-5)


def test_a_checkpoint_without_the_towers_weights_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    write_t5(tmp_path, "t5")
    weights = load_file(str(tmp_path / "model.safetensors"))
    kept = {k: v for k, v in weights.items() if not k.startswith("encoder.block.1.")}
    save_file(kept, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"T5EncoderModel left \d+ weights uninitialised \(encoder\.block\.1\."):
        load_text_model(tmp_path)


def test_a_folder_of_another_slot_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="names a AutoencoderKL folder, not a text model"):
        load_text_model(write_tiny_autoencoder_kl(tmp_path / "vae"))
    (tmp_path / "dino").mkdir()
    (tmp_path / "dino" / "config.json").write_text(json.dumps({"model_type": "dinov2"}))
    with pytest.raises(ValueError, match="names a dinov2 folder"):
        load_text_model(tmp_path / "dino")


def test_the_encoders_weights_load_in_the_configured_dtype(tmp_path):
    write_t5(tmp_path, "t5")
    backbone = TextBackbone(tmp_path, layers=[-1], max_length=8, dtype=torch.bfloat16)
    assert next(backbone.model.parameters()).dtype == torch.bfloat16  # half the memory of a large encoder
    assert backbone.encode(["a red circle"]).hidden.dtype == torch.float32  # what the DiT's fusion takes
