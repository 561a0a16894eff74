"""Expander SFT: a causal LM fine-tuned on (user prompt -> long caption), the loss masked to the caption.

    train_sft(pairs, out, cfg)   pairs: rows with prompt, target, sampling_weight, optionally prompts (the
                                 user_prompts asset: one pair per user prompt of a row, sft_pairs)
    out/                         config.json, model.safetensors, tokenizer files: `from_pretrained(out)` works
    out/dcp/step-NNNNNN/         DCP checkpoints (training/core/dcp.py) every `expander.save_every` steps
    out/expander_sft_history.jsonl, out/expander.json

A documented one-device loop (the expander fits one device; the DiT's FSDP2 + TP runner is not needed):
AdamW at a constant LR, gradient clipping at 1, each step's batch drawn with replacement by the rows'
`sampling_weight` (distribution shaping, data.user_prompts) from a generator seeded by (seed, step), so a
run killed and resumed from its newest checkpoint draws and computes what the uninterrupted run did.
Non-finite loss stops the run. The base is `expander.path` (any HF causal LM), or for `base=tiny` a small
Llama and a word-level tokenizer built from config in `out/init/` (training/expander/model.py).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from kiln.config import ExpanderConfig, KilnConfig
from kiln.progress import log
from training.expander.model import (
    build_tiny_lm,
    build_word_tokenizer,
    collate,
    demo_vocabulary,
    detokenize,
    encode_pair,
    load_lm,
    masked_lm_loss,
    prompt_text,
)
from training.post.runner import iteration_seed, last_step

INIT = "init"


def expander_problems(cfg: ExpanderConfig) -> list[tuple[str, str]]:
    """(key, problem) for each model the expander needs and cannot find: checked before any work."""
    out = []
    for key, used, path, what in (
        (
            "expander.path",
            cfg.base == "path",
            cfg.path,
            "the expander's causal LM folder",
        ),
        (
            "expander.extractor_path",
            cfg.extractor == "llm",
            cfg.extractor_path,
            "the attribute extractor's LLM folder",
        ),
    ):
        if used and not path:
            out.append((key, f"{what} is not set"))
        elif used and "://" not in path and not Path(path).exists():
            out.append((key, f"{what} {path} does not exist"))
    return out


def check_expander(cfg: ExpanderConfig) -> None:
    if problems := expander_problems(cfg):
        raise ValueError("the expander cannot run:\n" + "\n".join(f"  {k}: {p}" for k, p in problems))


def read_pairs(folder: Path) -> list[dict]:
    """The kept rows of a user_prompts output folder (or a folder of its Parquet shards), in order."""
    from kiln.stage import read_dataset

    folder = Path(folder)
    table = read_dataset(folder / "kept" if (folder / "kept").is_dir() else folder)
    cols = [c for c in ("id", "prompt", "target", "sampling_weight", "prompts") if c in table.column_names]
    return table.select(cols).to_pylist()


def sft_pairs(rows: list[dict]) -> list[dict]:
    """One (user prompt, caption) pair per user prompt of each row: a row written with several prompts
    (`prompts`, data.user_prompts.per_pair) gives one pair each, splitting the row's sampling weight so a
    caption weighs the same however many prompts it got; a row without `prompts` is one pair."""
    out = []
    for r in rows:
        variants = json.loads(r["prompts"]) if r.get("prompts") else [{"prompt": r["prompt"]}]
        w = float(r["sampling_weight"]) / len(variants)
        out += [
            {"id": r.get("id"), "prompt": v["prompt"], "target": r["target"], "sampling_weight": w} for v in variants
        ]
    return out


def base_folder(pairs: list[dict], out: Path, cfg: ExpanderConfig) -> Path:
    """Where the model to fine-tune is: `cfg.path`, or the tiny LM built once in `out/init` (kept for resume)."""
    if cfg.base == "path":
        return Path(cfg.path)
    init = Path(out) / INIT
    if not (init / "config.json").exists():
        texts = [prompt_text(cfg.template, p["prompt"]) + " " + p["target"] for p in pairs]
        tok = build_word_tokenizer(texts, init, demo_vocabulary())
        build_tiny_lm(cfg, len(tok), init, cfg.max_length)
    return init


def _history(out: Path, kind: str, start: int, resume: bool) -> Path:
    path = Path(out) / f"{kind}_history.jsonl"
    if not resume:
        path.unlink(missing_ok=True)
    elif path.exists():  # lines past the resumed step are written again
        kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= start]
        path.write_text("".join(line + "\n" for line in kept))
    return path


def train_sft(
    pairs: list[dict],
    out: Path,
    cfg: KilnConfig,
    resume: bool = False,
    stop_at: int | None = None,
    overwrite: bool = False,
) -> Path | None:
    """Fine-tune and export to `out`; None when stopped early at `stop_at` (a pre-emption, a test's kill).
    A fresh run into a folder with an earlier run's checkpoints is refused unless `overwrite`, as `kiln
    train` does; `overwrite` also rebuilds the tiny base (its vocabulary comes from the pairs)."""
    from training.core.data import DataPosition
    from training.core.dcp import Checkpointer, RunState
    from training.core.runtime import prepare_output

    ex, out = cfg.expander, Path(out)
    check_expander(ex.model_copy(update={"extractor": "demo_grammar"}))  # SFT reads no extractor
    if not pairs:
        raise ValueError("expander SFT: no pairs (the user_prompts asset kept no rows)")
    pairs = sft_pairs(pairs)
    prepare_output(out, resume, overwrite)
    if overwrite and not resume:
        shutil.rmtree(out / INIT, ignore_errors=True)  # kiln's own build, from the earlier run's pairs
    out.mkdir(parents=True, exist_ok=True)
    base = base_folder(pairs, out, ex)
    torch.manual_seed(ex.seed)
    model, tok = load_lm(base)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=ex.sft_lr, weight_decay=0.0)
    ckpt = Checkpointer(out, keep=2, async_save=False, mesh_facts={"kind": "expander_sft"})
    start = ((ckpt.load_latest(model, opt) if resume else None) or RunState(0, DataPosition())).step
    history = _history(out, "expander_sft", start, resume)
    encoded = [encode_pair(tok, ex.template, p["prompt"], p["target"], ex.max_length) for p in pairs]
    weights = torch.tensor([float(p["sampling_weight"]) for p in pairs], dtype=torch.float64)
    end, loss_v = last_step(ex.sft_steps, stop_at), float("nan")
    for step in range(start, end):
        g = torch.Generator().manual_seed(iteration_seed(ex.seed, step, "sft_batch"))
        idx = torch.multinomial(weights, ex.sft_batch, replacement=True, generator=g).tolist()
        ids, mask, labels = collate([encoded[i] for i in idx], tok.pad_token_id)
        loss = masked_lm_loss(model(input_ids=ids, attention_mask=mask).logits, labels)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"expander SFT: non-finite loss at step {step}; nothing exported")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_v = float(loss.detach())
        with history.open("a") as f:
            f.write(json.dumps({"step": step + 1, "loss": loss_v}) + "\n")
        if (step + 1) % ex.save_every == 0 or step + 1 == ex.sft_steps:
            ckpt.save(model, opt, RunState(step + 1, DataPosition()))
        if step % 50 == 0:
            log.info("expander sft: step %d loss %.4f", step + 1, loss_v)
    ckpt.wait()
    if end < ex.sft_steps:
        return None
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "expander.json").write_text(
        json.dumps(
            {
                "stage": "sft",
                "base": str(base),
                "steps": ex.sft_steps,
                "pairs": len(pairs),
                "final_loss": loss_v,
                "template": ex.template,
                "max_new_tokens": ex.max_new_tokens,
            },
            indent=2,
        )
        + "\n"
    )
    return out


# --------------------------------------------------------------------------------------------- expand
@torch.no_grad()
def expand(
    model,
    tok,
    prompts: list[str],
    template: str,
    max_new_tokens: int,
    batch_size: int = 32,
) -> list[str]:
    """Greedy expansions of `prompts` (what serving and the evaluations use)."""
    model.eval()
    out = []
    for s in range(0, len(prompts), batch_size):
        enc = tok(
            [prompt_text(template, p) for p in prompts[s : s + batch_size]],
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        )
        ids = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=tok.pad_token_id,
        )
        out += [detokenize(t) for t in tok.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)]
    return out


def load_expander(folder: Path | str, device: str = "cpu"):
    """(model, tokenizer, template, max_new_tokens) of an exported expander folder."""
    model, tok = load_lm(folder, device)
    rec = json.loads((Path(folder) / "expander.json").read_text()) if (Path(folder) / "expander.json").exists() else {}
    return (
        model.eval(),
        tok,
        rec.get("template", ExpanderConfig.model_fields["template"].default),
        rec.get("max_new_tokens", 48),
    )


def mean_loss(history: Path, last: int = 10) -> float:
    lines = [json.loads(x) for x in Path(history).read_text().splitlines()][-last:]
    return sum(x["loss"] for x in lines) / max(len(lines), 1) if lines else math.nan


def expander_from(folder: Path | str) -> Callable[[list[str]], list[str]]:
    """An exported expander as a function of prompts: greedy expansions (what `kiln sample --expand` feeds the DiT)."""
    model, tok, template, max_new = load_expander(folder)
    return lambda prompts: expand(model, tok, prompts, template, max_new)
