"""The expander's language model: any Hugging Face causal LM by path, or the demo's tiny one built from config.

The demo's stand-in is trained from scratch and offline: a word-level tokenizer (the `tokenizers` package)
over the words of the training pairs and the demo grammar's vocabulary, and a small Llama (`tiny_*` of
ExpanderConfig), both saved with `save_pretrained` and read back with `from_pretrained`, the path any other
causal LM takes. `encode_pair` is where the loss mask is made: labels are -100 on the template tokens, so
only the target (and its end-of-text token) is learnt.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import torch

SPECIALS = {
    "pad_token": "[PAD]",
    "unk_token": "[UNK]",
    "bos_token": "[BOS]",
    "eos_token": "[EOS]",
}
WORD = re.compile(r"\w+|[^\w\s]")  # the word-level pre-tokenizer's split, for building its vocabulary


def demo_vocabulary() -> list[str]:
    """Every word the demo grammar writes (components/demo_scenes.py), so held-out prompts have no unknown words."""
    from components import demo_scenes as d

    words = [
        *d.COLORS,
        *d.SHAPES,
        *(s + "s" for s in d.SHAPES),
        *d.SIZES,
        *d.POSITIONS,
        *d.WORDS,
        *d.COUNT_WORDS.values(),
    ]
    words += " ".join(d.POSITION_PHRASE.values()).split() + [
        "sign",
        "with",
        "the",
        "word",
        "striped",
        "gradient",
        "to",
        "and",
        "background",
        "on",
        "a",
        '"',
        ",",
        ".",
    ]
    return words


def detokenize(text: str) -> str:
    """A word-level tokenizer decodes with a space before punctuation; put it back: 'a circle , on' -> 'a circle, on'."""
    return re.sub(r"\s+([,.!?:;])", r"\1", " ".join(text.split()))


def build_word_tokenizer(texts: Iterable[str], out: Path, extra_words: Iterable[str] = ()):
    """A word-level tokenizer over `texts` (+ `extra_words`), saved to `out` as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {t: i for i, t in enumerate(SPECIALS.values())}
    for text in [*texts, " ".join(extra_words)]:
        for w in WORD.findall(text):
            vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIALS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation()]
    )  # WORD's split
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIALS)
    fast.save_pretrained(out)
    return fast


def build_tiny_lm(cfg, vocab_size: int, out: Path, max_length: int):
    """A small Llama from ExpanderConfig's `tiny_*` (no dropout, untied head), saved to `out`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=cfg.tiny_hidden, intermediate_size=cfg.tiny_hidden * 4, num_hidden_layers=cfg.tiny_layers,
        num_attention_heads=cfg.tiny_heads, num_key_value_heads=cfg.tiny_heads, max_position_embeddings=max(max_length, cfg.max_new_tokens) * 2,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=2, eos_token_id=3,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    return model


def load_lm(path: Path | str, device: str = "cpu"):
    """(model, tokenizer) of a causal LM folder; the tokenizer pads on the left (generation) and has a pad token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    return model, tok


def prompt_text(template: str, prompt: str) -> str:
    return template.replace("{prompt}", prompt)


def encode_pair(tok, template: str, prompt: str, target: str, max_length: int) -> tuple[list[int], list[int]]:
    """(input ids, labels): the template with the prompt, then the target and end-of-text; labels are -100
    on the template part, so the loss counts target tokens only. Cut at `max_length` from the end."""
    head = tok(prompt_text(template, prompt), add_special_tokens=False)["input_ids"]
    body = tok(" " + target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = (head + body)[:max_length]
    labels = ([-100] * len(head) + body)[:max_length]
    return ids, labels


def collate(rows: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and labels (-100 on padding)."""
    n = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), n), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, (a, b) in enumerate(rows):
        ids[i, : len(a)], labels[i, : len(b)], mask[i, : len(a)] = (
            torch.tensor(a),
            torch.tensor(b),
            1,
        )
    return ids, mask, labels


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the positions whose label is not -100 (the target's tokens):
    position t predicts label t + 1."""
    pred, gold = logits[:, :-1].float(), labels[:, 1:]
    keep = gold != -100
    return torch.nn.functional.cross_entropy(pred[keep], gold[keep], reduction="mean")
