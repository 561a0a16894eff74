"""Text embeddings per training step: encoded at the step (the demo's MiniLM, a 0.5B-class decoder) against the
DiT step they feed, and what a precompute stage would store and read back instead.

The setting is the demo's (`kiln config show`): batch 16, the nano DiT on 32x32 pixels (patch 4), captions padded
to `model.text_encoder.max_length` (32) tokens, hidden states of `model.text_encoder.layers` ([-1, -3, -5]) fused,
one caption form drawn per row with `data.rewrite.form_probs`. Per step, on this machine's CPU (all its cores):

  a) the DiT step alone: `training.core.trainer.train_step` (flow loss and the demo's REPA term, backward, clip,
     AdamW) on embeddings computed beforehand, once with each encoder's width (the fusion's input differs);
  b) encoding the step's 16 captions with the demo's MiniLM through the trainer's own path (`TextCache.batch`,
     one no-grad batch), cold: a fresh cache and 16 captions never seen, so all 16 are misses;
  c) the same with a decoder of Qwen2-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864) with
     random weights, written with save_pretrained and loaded by kiln's TextBackbone from `model.text_encoder.path`.
     Its vocabulary is shrunk to 32,000 (Qwen's is 151,936: the embedding lookup costs nothing next to the layers)
     and its tokenizer is Qwen2's class over byte-level BPE merges learnt from the demo captions (Qwen's files are
     not to be had offline); the cost does not depend on it, every caption being padded to the same 32 tokens;
  d) precomputing instead: bytes per caption of stored hidden states (layers x tokens x hidden, bf16), padded to
     max_length and as the caption's own tokens only; and the time to read a step's 16 rows back from a local
     file of fixed-size bf16 records (one pread per row, into the float32 TextBatch the step takes), warm (in the
     page cache) and cold (the file's pages dropped with posix_fadvise DONTNEED before each step).

Each figure is the median over a run's steps, best of `--repeats` runs, the runs alternating (a, b, c, d, a, ...)
so a noisy machine hits them alike; ratios are to (a) with the same encoder. CPU only: nothing here says what a
GPU would do.

    .venv/bin/python benchmarks/bench_text_encoder.py [--steps 20 --decoder-steps 2 --repeats 3 --rows 1024]
        [--decoder-dtype float32|bfloat16] [--decoder-dir DIR] [--no-decoder] [overrides ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kiln.config import KilnConfig, load_config

QWEN2_05B = {  # Qwen2-0.5B's shape (its config.json), the vocabulary aside
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
VOCAB = 32_000  # Qwen2's is 151,936: the embedding lookup costs nothing next to the layers


def caption_pool(cfg: KilnConfig, n: int) -> list[str]:
    """`n` distinct captions of demo scenes (every family), each row's form drawn as training draws it."""
    from components.demo_scenes import FAMILIES, caption_for, sample_scene
    from kiln.sampling import pick_form
    from training.testing import rule_caption_forms

    rng, out, seen = np.random.default_rng(0), [], set()
    for k in range(100 * n):
        forms = json.loads(rule_caption_forms(caption_for(sample_scene(rng, FAMILIES[k % len(FAMILIES)]))))
        c = forms[pick_form(f"row{k:07d}", cfg.data.rewrite.form_probs, cfg.train.seed)]
        if c not in seen:
            seen.add(c)
            out.append(c)
            if len(out) == n:
                return out
    raise RuntimeError(f"fewer than {n} distinct demo captions")


def qwen2_tokenizer(texts: list[str], vocab_size: int):
    """Qwen2's tokenizer class (byte-level BPE, no BOS, pad <|endoftext|>) over merges learnt from `texts`: Qwen's
    own files are not to be had offline, and its 151k-token vocabulary splits English captions about as finely."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(texts, trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return Qwen2Tokenizer(vocab=model["vocab"], merges=merges)


def write_decoder(folder: Path, dtype: str, texts: list[str]) -> Path:
    """A Qwen2-0.5B-shaped Qwen2Model with random weights + a Qwen2Tokenizer, saved with save_pretrained."""
    from transformers import Qwen2Config, Qwen2Model

    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    tok = qwen2_tokenizer(texts, VOCAB)
    tok.save_pretrained(str(folder))
    torch.manual_seed(0)
    model = Qwen2Model(Qwen2Config(vocab_size=VOCAB, **QWEN2_05B)).eval()
    model.to(getattr(torch, dtype)).save_pretrained(str(folder))
    return folder


class Setting:
    """One encoder's generator, optimiser and REPA term, as the trainer builds them, and the step's inputs."""

    def __init__(self, cfg: KilnConfig, encoder_path: str | None, batches: list[list[str]]):
        from kiln.trainshards import decode_image
        from model.autoencoder import from_uint8_nhwc
        from training.core.muon import make_optimizer
        from training.core.objective import num_image_tokens, timestep_shift
        from training.core.repa import build_repa
        from training.core.runtime import Runtime, init_generator
        from training.core.trainer import Learner
        from training.testing import scene_rows

        te = cfg.model.text_encoder.model_copy(update={"path": encoder_path})
        model_cfg = cfg.model.model_copy(update={"text_encoder": te})
        tc = cfg.train
        self.batches, self.tc = batches, tc
        started = time.perf_counter()
        self.gen = init_generator(model_cfg, tc.seed)
        self.load_s = time.perf_counter() - started
        side = cfg.data.pack.resolution
        rows = scene_rows(tc.batch_size, seed=1, buckets=((side, side),), batch_size=tc.batch_size).to_pylist()
        pixels = np.stack([decode_image(r["image"]) for r in rows])
        self.x0 = self.gen.autoencoder.encode(pixels)
        self.images = from_uint8_nhwc(pixels)
        with torch.no_grad():
            self.text = self.gen.encode_text(batches[0])
        one = self.gen.null_text(1)
        self.null = type(one)(one.hidden.expand(len(batches[0]), -1, -1, -1), one.mask.expand(len(batches[0]), -1))
        repa = build_repa(self.gen, tc.repa, tc.parallel, torch.device("cpu")) if tc.repa.teacher_path else None
        opt = make_optimizer(self.gen, tc)
        self.learner = Learner(
            self.gen,
            opt,
            tc,
            Runtime(torch.device("cpu"), None),
            1,
            repa,
            repa.make_optimizer(None, tc) if repa else None,
        )
        self.shift = timestep_shift(
            num_image_tokens(side, side, cfg.model.patch_size), tc.timestep_shift, tc.timestep_max_shift
        )
        self.gen.train()
        self.step = 0

    def train_steps(self, steps: int) -> float:
        from training.core.runtime import step_generator
        from training.core.trainer import StepBatch, train_step

        seconds = []
        for _ in range(steps):
            t0 = time.perf_counter()
            train_step(
                self.learner,
                StepBatch(self.x0, self.text, self.null, self.images),
                step_generator(self.tc.seed, self.step),
                self.tc.lr,
                self.shift,
            )
            seconds.append(time.perf_counter() - t0)
            self.step += 1
        return statistics.median(seconds)

    def encode_steps(self, steps: int, first: int) -> float:
        """`steps` steps of cold encoding: a fresh TextCache each step, the batches from `first` on (unseen)."""
        from training.core.text_cache import TextCache

        seconds = []
        for k in range(steps):
            captions = self.batches[(first + k) % len(self.batches)]
            t0 = time.perf_counter()
            cache = TextCache(self.gen, self.tc.text_cache_mb)
            cache.batch(captions, "cpu")
            seconds.append(time.perf_counter() - t0)
            assert cache.encoded == len(captions), "a cold step must encode every caption"
        return statistics.median(seconds)


class Stored:
    """A precompute stage's output for one encoder: `rows` fixed-size bf16 records [n_layers, length, D] and the
    token span of each, read back a step's rows at a time."""

    def __init__(self, path: Path, rows: int, n_layers: int, length: int, dim: int, spans: list[int]):
        self.path, self.rows, self.shape = path, rows, (n_layers, length, dim)
        self.record = n_layers * length * dim * 2
        self.spans = np.asarray([spans[k % len(spans)] for k in range(rows)])
        gen = torch.Generator().manual_seed(0)
        with open(path, "wb") as f:
            for _ in range(rows):
                f.write(torch.randn(self.shape, generator=gen).to(torch.bfloat16).view(torch.int16).numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())  # clean pages, so DONTNEED can drop them
        self.rng = np.random.default_rng(0)

    def read_steps(self, steps: int, batch: int, cold: bool) -> float:
        from model.text_encoder import TextBatch

        seconds = []
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for _ in range(steps):
                idx = self.rng.choice(self.rows, batch, replace=False)
                if cold:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                t0 = time.perf_counter()
                raw = bytearray().join(os.pread(fd, self.record, int(i) * self.record) for i in idx)
                hidden = torch.frombuffer(raw, dtype=torch.bfloat16).view(batch, *self.shape).float()
                mask = torch.arange(self.shape[1])[None, :] < torch.as_tensor(self.spans[idx])[:, None]
                TextBatch(hidden, mask)
                seconds.append(time.perf_counter() - t0)
        finally:
            os.close(fd)
        return statistics.median(seconds)


def token_spans(gen, captions: list[str]) -> list[int]:
    """Tokens of each caption after truncation to max_length (what the mask marks)."""
    bb = gen.backbone
    tok = bb.tokenizer(captions, padding="max_length", truncation=True, max_length=bb.max_length)
    return [sum(m) for m in tok["attention_mask"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="steps per run of (a), (b) and (d)")
    ap.add_argument("--decoder-steps", type=int, default=2, help="steps per run of (c): seconds each on 2 cores")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, default=1024, help="records in each precomputed file of (d)")
    ap.add_argument("--decoder-dtype", choices=["float32", "bfloat16"], default="float32", help="as saved and loaded")
    ap.add_argument("--decoder-dir", type=Path, default=None, help="keep the 0.5B decoder here (written if missing)")
    ap.add_argument("--no-decoder", action="store_true", help="MiniLM only: skip building the 0.5B decoder")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = load_config(args.overrides)
    torch.set_num_threads(cfg.train.threads or os.cpu_count() or 1)
    b = cfg.train.batch_size
    runs = args.repeats * (args.steps + args.decoder_steps) + 2
    pool = caption_pool(cfg, b * runs)
    batches = [pool[k : k + b] for k in range(0, len(pool), b)]
    te = cfg.model.text_encoder
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        settings = {"minilm": Setting(cfg, te.path, batches)}
        if not args.no_decoder:
            t0 = time.perf_counter()
            folder = write_decoder(args.decoder_dir or tmp / "decoder", args.decoder_dtype, pool)
            write_s = time.perf_counter() - t0
            settings["decoder_0.5b"] = Setting(cfg, str(folder), batches)
            print(
                f"decoder: written in {write_s:.0f} s, loaded in {settings['decoder_0.5b'].load_s:.0f} s, "
                f"{sum(p.numel() for p in settings['decoder_0.5b'].gen.backbone.model.parameters()) / 1e6:.0f}M params",
                flush=True,
            )
        spans = {k: token_spans(s.gen, pool) for k, s in settings.items()}
        stored = {
            k: Stored(tmp / f"{k}.bin", args.rows, len(te.layers), te.max_length, s.gen.backbone.hidden_size, spans[k])
            for k, s in settings.items()
        }
        best: dict[str, float] = {}

        def keep(name: str, seconds: float) -> None:
            best[name] = min(best.get(name, float("inf")), seconds)

        for s in settings.values():  # warm-up: first-touch allocations, thread start-up
            s.train_steps(2)
            s.encode_steps(1, len(batches) - 1)
        first = 0
        for r in range(args.repeats):
            for k, s in settings.items():
                keep(f"a_train_step[{k}]", s.train_steps(args.steps))
                n = args.steps if k == "minilm" else args.decoder_steps
                keep(f"encode_cold[{k}]", s.encode_steps(n, first))
                first += n
                keep(f"read_warm[{k}]", stored[k].read_steps(args.steps, b, cold=False))
                keep(f"read_cold[{k}]", stored[k].read_steps(args.steps, b, cold=True))
            print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{n} {v:.4f}" for n, v in best.items()), flush=True)

    table = {}
    for k in settings:
        a = best[f"a_train_step[{k}]"]
        for name in ("a_train_step", "encode_cold", "read_warm", "read_cold"):
            table[f"{name}[{k}]"] = {"s_per_step": best[f"{name}[{k}]"], "ratio_to_a": best[f"{name}[{k}]"] / a}
    sizes = {}
    for k, s in settings.items():
        per_token = len(te.layers) * s.gen.backbone.hidden_size * 2
        sizes[k] = {
            "hidden_size": s.gen.backbone.hidden_size,
            "bytes_per_caption_padded": per_token * te.max_length,
            "mean_tokens": float(np.mean(spans[k])),
            "bytes_per_caption_span": per_token * float(np.mean(spans[k])),
            "truncated_share": float(np.mean([n >= te.max_length for n in spans[k]])),
        }
    print(f"\n{'':28} {'s/step':>9} {'x (a)':>7}")
    for name, v in table.items():
        print(f"{name:28} {v['s_per_step']:9.4f} {v['ratio_to_a']:7.2f}")
    print(f"\n{'':14} {'bytes padded':>13} {'mean tokens':>12} {'bytes span':>11}")
    for k, v in sizes.items():
        print(
            f"{k:14} {v['bytes_per_caption_padded']:13,} {v['mean_tokens']:12.1f} {v['bytes_per_caption_span']:11,.0f}"
        )
    print(
        json.dumps(
            {
                "threads": torch.get_num_threads(),
                "batch_size": b,
                "max_length": te.max_length,
                "layers": te.layers,
                "dit": cfg.model.size,
                "steps": args.steps,
                "decoder_steps": args.decoder_steps,
                "repeats": args.repeats,
                "decoder_dtype": None if args.no_decoder else args.decoder_dtype,
                "per_step": table,
                "precompute_bytes": sizes,
            }
        )
    )


if __name__ == "__main__":
    main()
