"""Causal language models by local path: the rewrite stage's LLM rewriter and the user-prompt stage's LLM writer load
theirs here, once per process (left-padded for batched generation)."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=2)
def load_llm(path: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), tok
