"""Yes/no answers read from a language model's next-token logits: the classify stage's VLM labeller
(assets.classify) and the rubric's VLM judge (training.evaluation.rubric) both read answers this way."""

from __future__ import annotations

from dataclasses import dataclass


def answer_token_ids(tokenizer, word: str) -> list[int]:
    """The tokens an answer `word` can start with: the first non-blank token of "yes", " yes", "Yes", " Yes".

    Models answer with or without a leading space and capitalised or not; scoring every spelling's first
    token (their probabilities summed) does not depend on which one a given model prefers. Spellings the
    tokenizer does not know (its unknown token) are left out."""
    ids: list[int] = []
    for form in dict.fromkeys([word.strip(), word.strip().lower(), word.strip().capitalize()]):
        for text in (form, " " + form):
            for t in tokenizer.encode(text, add_special_tokens=False):
                if tokenizer.decode([t]).strip():  # SentencePiece may emit a lone "▁" first: skip it
                    if t != tokenizer.unk_token_id and t not in ids:
                        ids.append(t)
                    break
    return ids


@dataclass(frozen=True)
class YesNo:
    """A yes/no answer read from next-token logits: p = softmax(logsumexp(positive), logsumexp(negative))[0].
    The VLM labeller and the rubric's VLM judge (training/evaluation/rubric.py) both read answers this way."""

    positive_ids: list[int]
    negative_ids: list[int]

    @classmethod
    def of(cls, tokenizer, positive: str, negative: str, path: str) -> YesNo:
        pos, neg = answer_token_ids(tokenizer, positive), answer_token_ids(tokenizer, negative)
        shared = set(pos) & set(neg)
        out = cls([t for t in pos if t not in shared], [t for t in neg if t not in shared])
        for word, ids in ((positive, out.positive_ids), (negative, out.negative_ids)):
            if not ids:
                raise ValueError(
                    f"answer word {word!r} has no token of its own in {path}'s tokenizer "
                    f"(unknown, or its first token is shared with the other answer)"
                )
        return out

    def p_yes(self, logits):
        """P(positive) per row of raw next-token logits [B, vocab]."""
        import torch

        logp = logits.float().log_softmax(-1)
        pair = torch.stack([logp[:, self.positive_ids].logsumexp(-1), logp[:, self.negative_ids].logsumexp(-1)], -1)
        return pair.softmax(-1)[:, 0]
