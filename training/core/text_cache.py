"""Caption embeddings computed at the step that needs them, with a cache of the recent ones bounded in bytes.

The text backbone is frozen, so a caption's hidden states never change during training; but encoding every
caption form of a lab's set up front, and keeping them on every rank, grows with the data (five forms of a
billion images). `TextCache` encodes the step's captions it has not seen lately, in one no-grad batch on the
training device, and keeps the recent ones up to `capacity_mb` (least recently used out). It stores each
caption's tokens only (the span its mask marks) in bfloat16, and hands back rows zero-padded outside that
span, in the backbone's dtype, hits and misses alike (a miss is rounded through bfloat16 too): the DiT masks
padding out, so the step is the same whatever the cache held (bit for bit, which an exact resume needs;
tests/test_text_cache.py checks both).

A small set whose drawable captions fit the budget is encoded up front instead (`prefill`, in batches of 64):
the same work, batched, and every step a hit, as a loop over precomputed embeddings runs. Those rows are
copied into one slab allocated at the budget's size (untouched pages cost no memory) and are never dropped:
thousands of small row tensors interleaved with the encoder's large temporaries fragment the C heap, and
with two threads a 500 MB prefill held 1.2 GB more than its rows until `malloc_trim`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

STORED = torch.bfloat16  # half the bytes of float32, so twice the captions per MB; a GPU step computes in bf16


@dataclass(frozen=True)
class _Row:
    hidden: torch.Tensor  # [n_layers, hi - lo, D], on the CPU
    lo: int
    hi: int

    @property
    def nbytes(self) -> int:
        return self.hidden.numel() * self.hidden.element_size()


class TextCache:
    """`batch(captions, device)`: the step's TextBatch, encoding the captions not held; at most `capacity_mb` held."""

    def __init__(self, gen, capacity_mb: float = 512):
        self.gen = gen
        self.capacity = int(capacity_mb * 1e6)
        self.rows: OrderedDict[str, _Row] = OrderedDict()  # least recently used first
        self.pinned: dict[str, _Row] = {}  # the prefilled rows: views of `_slab`, never dropped
        self._slab: torch.Tensor | None = None  # [n_layers, tokens, D] in STORED
        self._used = 0  # tokens of the slab written
        self.held = 0  # bytes
        self.encoded = 0  # captions encoded so far (a miss each)
        self.length: int | None = None  # the backbone's padded length
        self.dtype = torch.float32  # the backbone's output dtype: what the step gets back

    def __len__(self) -> int:
        return len(self.rows) + len(self.pinned)

    def _encode_spans(self, captions: list[str]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """The backbone's hidden states [B, n_layers, length, D] on the CPU and each caption's token span."""
        with torch.no_grad():
            enc = self.gen.encode_text(captions).to("cpu")
        self.length, self.dtype = enc.mask.shape[1], enc.hidden.dtype
        self.encoded += len(captions)
        spans = []
        for k in range(len(captions)):
            where = enc.mask[k].nonzero().flatten().tolist() or [0]
            spans.append((where[0], where[-1] + 1))
        return enc.hidden, spans

    def _encode(self, captions: list[str]) -> dict[str, _Row]:
        hidden, spans = self._encode_spans(captions)
        return {  # copies, not views of the batch (a bf16 backbone's .to would return one)
            c: _Row(hidden[k, :, lo:hi].to(STORED, copy=True), lo, hi)
            for k, (c, (lo, hi)) in enumerate(zip(captions, spans))
        }

    def _keep(self, fresh: dict[str, _Row]) -> None:
        for c, row in fresh.items():
            if row.nbytes <= self.capacity:
                self.rows[c] = row
                self.held += row.nbytes
        while self.held > self.capacity and self.rows:
            _, old = self.rows.popitem(last=False)
            self.held -= old.nbytes

    def _pin(
        self, captions: list[str], hidden: torch.Tensor, spans: list[tuple[int, int]], texts: int, per_token: int
    ) -> None:
        """Copy the captions' spans of `hidden` into the slab (allocated first for `texts` captions at most,
        `per_token` bytes a token)."""
        if self._slab is None:
            tokens = min(self.capacity // per_token, texts * hidden.shape[2])
            self._slab = torch.empty(hidden.shape[1], tokens, hidden.shape[3], dtype=STORED)
        for k, (c, (lo, hi)) in enumerate(zip(captions, spans)):
            view = self._slab[:, self._used : self._used + hi - lo]
            view.copy_(hidden[k, :, lo:hi])
            self._used += hi - lo
            self.pinned[c] = row = _Row(view, lo, hi)
            self.held += row.nbytes

    def prefill(self, texts: Sequence[str], batch: int = 64) -> int:
        """Encode `texts` in large batches before training, while they fit the budget (stopping at the first
        batch that would not), so a set whose captions all fit pays its encoding once, up front and batched,
        as a loop over precomputed embeddings would; the steps are the same either way. Returns how many."""
        for k in range(0, len(texts), batch):
            todo = [t for t in texts[k : k + batch] if t not in self.pinned and t not in self.rows]
            if not todo:
                continue
            hidden, spans = self._encode_spans(todo)
            per_token = hidden.shape[1] * hidden.shape[3] * STORED.itemsize
            if self.held + sum(hi - lo for lo, hi in spans) * per_token > self.capacity:
                break
            self._pin(todo, hidden, spans, len(texts), per_token)
        return len(self.pinned)

    def batch(self, captions: Sequence[str], device: torch.device | str = "cpu"):
        from model.text_encoder import TextBatch

        if not captions:  # a rank with no rows of this batch (training.core.data: a small last batch)
            return self.gen.null_text(1)[0:0].to(device)
        missing = sorted({c for c in captions if c not in self.rows and c not in self.pinned})
        fresh = self._encode(missing) if missing else {}
        rows = []
        for c in captions:
            row = fresh.get(c) or self.pinned.get(c)
            if row is None:
                row = self.rows[c]
                self.rows.move_to_end(c)
            rows.append(row)
        self._keep(fresh)
        n_layers, dim = rows[0].hidden.shape[0], rows[0].hidden.shape[2]
        hidden = torch.zeros(len(rows), n_layers, self.length, dim, dtype=self.dtype)
        mask = torch.zeros(len(rows), self.length, dtype=torch.bool)
        for k, row in enumerate(rows):
            hidden[k, :, row.lo : row.hi] = row.hidden
            mask[k, row.lo : row.hi] = True
        return TextBatch(hidden, mask).to(device)
