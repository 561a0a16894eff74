"""Expander RL (GDPO): G sampled expansions per short prompt, scored by faithfulness, image and diversity
rewards behind a safety gate, each reward normalised in its group (training/expander/rewards.py).

    train_rl(sft_dir, checkpoint, out, cfg)   sft_dir: the expander SFT export; checkpoint: the DiT that draws
    out/   the exported expander (from_pretrained), out/dcp/ checkpoints, expander_rl_history.jsonl, expander.json

Each iteration draws `rl_prompts` short prompts, samples `group_size` expansions of each at `temperature`
(the rollout), has the DiT draw every expansion with the prompt's own noise (so a group's images differ only
by their expansions), and scores them; diversity counts only for expansions that keep every attribute. The update is the GRPO token-level clipped surrogate with the
GDPO advantage of each sequence, plus `kl` x the k3 estimate of the KL to the frozen SFT model. A one-device
loop like the SFT; every draw is a pure function of (seed, iteration), so a killed run resumes to the
weights of an uninterrupted one.

The short prompts: `post.prompts` (a rubric JSONL, the prompts as written), or on the demo the grammar's RL
prompts (none of the evaluation's combinations) made short as the user_prompts stage makes them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kiln.config import KilnConfig
from kiln.progress import log
from training.evaluation.rubric import RubricPrompt
from training.expander.model import collate, detokenize, load_lm, prompt_text
from training.expander.rewards import (
    IntentRubricReward,
    diversity,
    diversity_of_faithful,
    faithfulness,
    gate,
    gdpo_advantages,
    make_extractor,
)
from training.expander.sft import _history, check_expander
from training.post.policy_gradient import clipped_policy_loss
from training.post.runner import iteration_seed, last_step

REWARDS = ("faithfulness", "image", "diversity")


@dataclass(frozen=True)
class ShortPrompt:
    short: str  # what the user typed
    rubric: RubricPrompt  # the full prompt with its requirements (the image reward scores those `short` states)


def make_short(caption: str, key: str, cfg: KilnConfig) -> str:
    """A demo caption made short and put in a user's style, as the prompt_pairs and user_prompts stages do."""
    from components.rule_text import draw, make_prompt, pick_style, rule_prompt

    up = cfg.data.user_prompts
    pair, _ = make_prompt(caption, key, cfg.data.rewrite.pair_drop, cfg.data.rewrite.seed)
    return rule_prompt(
        pair,
        pick_style(up.styles, up.seed, key),
        int(draw(up.seed, key, "template") * 2**31),
    )


def short_prompts(rubric: list[RubricPrompt], cfg: KilnConfig, demo: bool) -> list[ShortPrompt]:
    return [ShortPrompt(make_short(r.prompt, f"rl{i}", cfg) if demo else r.prompt, r) for i, r in enumerate(rubric)]


def rl_prompt_set(cfg: KilnConfig) -> list[ShortPrompt]:
    from training.evaluation.rubric import demo_rl_prompts, read_prompt_set

    if cfg.post.prompts:
        return short_prompts(read_prompt_set(Path(cfg.post.prompts)), cfg, demo=False)
    return short_prompts(demo_rl_prompts(128, cfg.expander.seed), cfg, demo=True)


def heldout_prompt_set(cfg: KilnConfig) -> list[ShortPrompt]:
    """The evaluation's prompts made short: `post.eval_prompts`, else the demo's 12 held-out prompts."""
    from components.demo_scenes import demo_prompts
    from training.evaluation.rubric import demo_prompt_set, read_prompt_set

    if cfg.post.eval_prompts:
        return short_prompts(read_prompt_set(Path(cfg.post.eval_prompts)), cfg, demo=False)
    return short_prompts(demo_prompt_set(demo_prompts()), cfg, demo=True)


def wide_heldout_prompt_set(cfg: KilnConfig, n: int = 120) -> list[ShortPrompt]:
    """`n` more demo prompts made short, none the evaluation's nor RL's (the demo grammar drawn with another
    seed, RL's captions removed): twelve prompts move faithfulness in steps of ~0.03, these in ~0.003.
    Empty with `post.eval_prompts` (a real profile has no grammar to draw from)."""
    from training.evaluation.rubric import demo_rl_prompts

    if cfg.post.eval_prompts:
        return []
    seen = {p.rubric.prompt for p in rl_prompt_set(cfg)}
    drawn = demo_rl_prompts(2 * n + len(seen), cfg.expander.seed + 1)
    return short_prompts([r for r in drawn if r.prompt not in seen][:n], cfg, demo=True)


# ---------------------------------------------------------------------------------------- rollouts
def completion(ids: list[int], eos: int, pad: int) -> list[int]:
    """Generated ids up to and including the first end-of-text (padding after it dropped)."""
    out = []
    for t in ids:
        out.append(t)
        if t == eos:
            break
    return [t for t in out if t != pad or t == eos]


@torch.no_grad()
def sample_expansions(
    model,
    tok,
    short: str,
    template: str,
    g: int,
    temperature: float,
    max_new: int,
    seed: int,
) -> tuple[list[int], list[list[int]], list[str]]:
    """(template ids, G completions' ids, their texts) sampled at `temperature` from a generator seeded by `seed`."""
    head = tok(prompt_text(template, short), add_special_tokens=False)["input_ids"]
    torch.manual_seed(seed)
    model.eval()
    ids = model.generate(
        input_ids=torch.tensor([head] * g), attention_mask=torch.ones(g, len(head), dtype=torch.long), max_new_tokens=max_new,
        do_sample=True, temperature=temperature, top_k=0, top_p=1.0, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    comps = [completion(row[len(head) :].tolist(), tok.eos_token_id, tok.pad_token_id) for row in ids]
    return (
        head,
        comps,
        [detokenize(tok.decode(c, skip_special_tokens=True)) for c in comps],
    )


def token_logps(model, heads: list[list[int]], comps: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities of each completion after its head, and the mask of completion tokens."""
    ids, attn, labels = collate([(h + c, [-100] * len(h) + c) for h, c in zip(heads, comps)], pad)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    gold = labels[:, 1:]
    mask = gold != -100
    lp = torch.log_softmax(logits, -1).gather(-1, gold.clamp(min=0)[..., None])[..., 0]
    return lp * mask, mask


# ---------------------------------------------------------------------------------------- the scorer
class ExpansionScorer:
    """Faithfulness (text), then the DiT's images of the expansions for the image and diversity rewards."""

    def __init__(self, cfg: KilnConfig, checkpoint: Path | None):
        self.cfg, self.ex = cfg, cfg.expander
        self.extractor = make_extractor(self.ex)
        self.gen = None
        if checkpoint is not None:
            from model.generator import Generator
            from model.image_encoders import ClassicalEmbedder
            from training.evaluation.rewards import make_judge
            from training.evaluation.sampling import checkpoint_resolution, sampling_shift

            self.gen = Generator.from_pretrained(Path(checkpoint)).eval()
            self.hw = checkpoint_resolution(Path(checkpoint), cfg)
            self.shift = sampling_shift(self.gen, *self.hw, cfg.train)
            self.image_reward = IntentRubricReward(make_judge(cfg.post))
            self.embedder = ClassicalEmbedder()

    def images(self, texts: list[str], seed: int) -> np.ndarray:
        """uint8 [len(texts), H, W, 3], every text drawn from the same noise (`seed`)."""
        from model.sampler import sample

        return np.concatenate(
            [
                sample(
                    self.gen,
                    [t],
                    *self.hw,
                    steps=self.ex.image_steps,
                    cfg_scale=self.ex.image_cfg,
                    seed=seed,
                    shift=self.shift,
                )
                for t in texts
            ]
        )

    def score(self, p: ShortPrompt, texts: list[str], seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        from PIL import Image

        rewards = {"faithfulness": faithfulness(self.extractor, p.short, texts)}
        if self.gen is not None:
            ims = self.images(texts, seed)
            rewards["image"] = self.image_reward.score(p.rubric, ims, p.short)
            rewards["diversity"] = diversity(self.embedder.embed([Image.fromarray(i) for i in ims]))
        return gate(rewards, texts, self.ex.blocklist)


# -------------------------------------------------------------------------------------------- loop
def train_rl(
    sft_dir: Path,
    checkpoint: Path | None,
    out: Path,
    cfg: KilnConfig,
    resume: bool = False,
    stop_at: int | None = None,
    prompts: list[ShortPrompt] | None = None,
    overwrite: bool = False,
) -> Path | None:
    """GDPO from the SFT expander into `out`; `checkpoint` None scores faithfulness only (no DiT rewards).
    None when stopped early at `stop_at`. A fresh run into a folder with an earlier run's checkpoints is
    refused unless `overwrite`."""
    from training.core.data import DataPosition
    from training.core.dcp import Checkpointer, RunState
    from training.core.runtime import prepare_output

    ex, out = cfg.expander, Path(out)
    check_expander(ex)
    prompts = prompts or rl_prompt_set(cfg)
    prepare_output(out, resume, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    policy, tok = load_lm(sft_dir)
    reference, _ = load_lm(sft_dir)
    reference.eval().requires_grad_(False)
    template = (
        json.loads((Path(sft_dir) / "expander.json").read_text()).get("template", ex.template)
        if (Path(sft_dir) / "expander.json").exists()
        else ex.template
    )
    opt = torch.optim.AdamW(policy.parameters(), lr=ex.rl_lr, weight_decay=0.0)
    ckpt = Checkpointer(out, keep=2, async_save=False, mesh_facts={"kind": "expander_rl"})
    start = ((ckpt.load_latest(policy, opt) if resume else None) or RunState(0, DataPosition())).step
    history = _history(out, "expander_rl", start, resume)
    scorer = ExpansionScorer(cfg, checkpoint)
    weights = {k: w for k, w in ex.reward_weights.items() if scorer.gen is not None or k == "faithfulness"}
    P, G = min(ex.rl_prompts, len(prompts)), ex.group_size
    end = last_step(ex.rl_iterations, stop_at)
    for it in range(start, end):
        t0 = time.perf_counter()
        pick = np.random.default_rng(iteration_seed(ex.seed, it, "prompts")).choice(len(prompts), size=P, replace=False)
        heads, comps, parts, blocked = [], [], {k: [] for k in weights}, []
        for j, i in enumerate(pick):
            head, cs, texts = sample_expansions(
                policy,
                tok,
                prompts[i].short,
                template,
                G,
                ex.temperature,
                ex.max_new_tokens,
                iteration_seed(ex.seed, it, f"rollout{j}"),
            )
            r, mask = scorer.score(prompts[i], texts, iteration_seed(ex.seed, it, f"noise{j}") % 2**31)
            r = diversity_of_faithful(r)
            heads += [head] * G
            comps += cs
            blocked.append(mask)
            for k in weights:
                parts[k].append(r[k])
        rewards = {k: torch.tensor(np.stack(v), dtype=torch.float32) for k, v in parts.items()}
        adv = gdpo_advantages(rewards, weights).flatten()
        policy.train()
        with torch.no_grad():
            old, mask = token_logps(policy, heads, comps, tok.pad_token_id)
            ref, _ = token_logps(reference, heads, comps, tok.pad_token_id)
        new, _ = token_logps(policy, heads, comps, tok.pad_token_id)
        tok_adv = adv[:, None].expand_as(new)
        pg, clipped = clipped_policy_loss(new[mask], old[mask], tok_adv[mask], ex.clip)
        d = ref[mask] - new[mask]
        kl = (torch.exp(d) - d - 1).mean()  # k3: an unbiased, positive estimate of KL(policy || reference)
        loss = pg + ex.kl * kl
        if not torch.isfinite(loss):
            raise FloatingPointError(f"expander RL iteration {it}: non-finite loss; nothing exported")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        record = {
            "step": it + 1,
            "loss": float(loss.detach()),
            "kl": float(kl.detach()),
            "clipped": float(clipped),
        }
        record |= {
            f"reward_{k}": float(np.nanmean(v.numpy())) if not torch.isnan(v).all() else float("nan")
            for k, v in rewards.items()
        }
        record |= {
            "blocked": int(np.concatenate(blocked).sum()),
            "seconds": round(time.perf_counter() - t0, 3),
        }
        with history.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        if (it + 1) % ex.save_every == 0 or it + 1 == ex.rl_iterations:
            ckpt.save(policy, opt, RunState(it + 1, DataPosition()))
        log.info(
            "expander rl %d: faithfulness %.3f loss %.4f",
            it + 1,
            record["reward_faithfulness"],
            record["loss"],
        )
    ckpt.wait()
    if end < ex.rl_iterations:
        return None
    policy.save_pretrained(out)
    tok.save_pretrained(out)
    rec = {
        "stage": "rl",
        "from": str(sft_dir),
        "checkpoint": str(checkpoint) if checkpoint else None,
        "iterations": ex.rl_iterations,
        "weights": weights,
        "template": template,
        "max_new_tokens": ex.max_new_tokens,
    }
    (out / "expander.json").write_text(json.dumps(rec, indent=2) + "\n")
    return out
