"""Rewards: each maps (prompt, image) to a score with a name; post-training mixes them with weights.

- `rubric`: the prompt's requirements checked on the image (training/evaluation/rubric.py), mean score;
- `text`: OCR the image and score 1 - normalised edit distance to the text the prompt quotes;
- `aesthetic`: a Bradley-Terry head on an image embedder, trained on preference pairs (`BradleyTerry`);
- `artifact`: any Hugging Face image classifier by path: 1 - P(the artifact labels).

A reward sees a batch of one prompt's images (uint8 [N, H, W, 3]) and returns [N] floats; prompts that a
reward cannot score (no quoted text for `text`) get NaN, and the mix skips them for that reward.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from training.evaluation.rubric import Judge, RubricPrompt


class Reward(Protocol):
    name: str

    def score(self, prompt: RubricPrompt, images: np.ndarray) -> np.ndarray: ...


@dataclass
class RubricReward:
    judge: Judge
    name: str = "rubric"

    def score(self, prompt: RubricPrompt, images: np.ndarray) -> np.ndarray:
        answers = self.judge.answer(prompt, images)
        return answers.mean(1) if answers.shape[1] else np.full(len(images), np.nan)


QUOTED = re.compile(r"[\"“]([^\"”]+)[\"”]")


def quoted_text(prompt: str) -> str | None:
    """The text a prompt asks to render: its quoted spans, joined by spaces; None if it quotes nothing."""
    spans = QUOTED.findall(prompt)
    return " ".join(s.strip() for s in spans) if spans else None


def normalise_text(s: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", s.lower()).split())


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions each 1)."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def text_similarity(read: str, wanted: str) -> float:
    """1 - edit distance / the longer length, on lower-cased, punctuation-free text: 1 is exact."""
    a, b = normalise_text(read), normalise_text(wanted)
    if not a and not b:
        return 1.0
    return 1.0 - edit_distance(a, b) / max(len(a), len(b))


@dataclass
class TextRenderingReward:
    """OCR (assets.ocr's engines) read in reading order, compared with the quoted text."""

    engine: object  # components.ocr_engines.OCREngine
    upscale: int = 1  # small samples are read at this many times their size
    name: str = "text"

    def score(self, prompt: RubricPrompt, images: np.ndarray) -> np.ndarray:
        from PIL import Image

        from components.ocr_engines import reading_order

        wanted = quoted_text(prompt.prompt)
        if wanted is None:
            return np.full(len(images), np.nan)
        out = []
        for im in images:
            pil = Image.fromarray(im)
            if self.upscale > 1:
                pil = pil.resize((pil.width * self.upscale, pil.height * self.upscale), Image.Resampling.BICUBIC)
            read = " ".join(b.text for b in reading_order(self.engine.read(pil)))
            out.append(text_similarity(read, wanted))
        return np.asarray(out, np.float64)


# ------------------------------------------------------------------------------------ aesthetic (BT)
class BradleyTerry:
    """P(a preferred to b) = sigmoid(f(a) - f(b)) with f linear on image embeddings: a reward model head
    trained on preference pairs by logistic regression on embedding differences (no bias: it cancels)."""

    def __init__(self, weights: np.ndarray, embedder_name: str):
        self.weights, self.embedder_name = np.asarray(weights, np.float64), embedder_name

    @classmethod
    def fit(
        cls,
        winners: np.ndarray,
        losers: np.ndarray,
        embedder_name: str,
        l2: float = 1e-2,
        steps: int = 500,
        lr: float = 0.5,
    ) -> BradleyTerry:
        """Full-batch gradient descent on the BT log-likelihood of embedding pairs [P, D] (deterministic)."""
        d = np.asarray(winners, np.float64) - np.asarray(losers, np.float64)
        w = np.zeros(d.shape[1])
        for _ in range(steps):
            p = 1.0 / (1.0 + np.exp(-(d @ w)))
            grad = -((1.0 - p)[:, None] * d).mean(0) + l2 * w
            w -= lr * grad
        return cls(w, embedder_name)

    def utility(self, embeddings: np.ndarray) -> np.ndarray:
        return np.asarray(embeddings, np.float64) @ self.weights

    def prefers(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self.utility(a) > self.utility(b)

    def save(self, path: Path) -> Path:
        import json

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        np.save(path / "weights.npy", self.weights)
        (path / "reward_model.json").write_text(
            json.dumps(
                {"kind": "bradley_terry_linear", "embedder": self.embedder_name, "dim": len(self.weights)}, indent=2
            )
            + "\n"
        )
        return path

    @classmethod
    def load(cls, path: Path) -> BradleyTerry:
        import json

        meta = json.loads((Path(path) / "reward_model.json").read_text())
        return cls(np.load(Path(path) / "weights.npy"), meta["embedder"])


@dataclass
class AestheticReward:
    """sigmoid of the BT utility, so the reward is in (0, 1) and a utility gap is a preference probability."""

    model: BradleyTerry
    embedder: object  # model.image_encoders.Embedder
    name: str = "aesthetic"

    def score(self, prompt: RubricPrompt, images: np.ndarray) -> np.ndarray:
        from PIL import Image

        if getattr(self.embedder, "name", None) != self.model.embedder_name:
            raise ValueError(
                f"the reward model was trained on {self.model.embedder_name} embeddings, not {getattr(self.embedder, 'name', '?')}"
            )
        emb = self.embedder.embed([Image.fromarray(im) for im in images])
        return 1.0 / (1.0 + np.exp(-self.model.utility(emb)))


@dataclass
class ArtifactReward:
    """1 - P(artifact) from a Hugging Face image classifier by path, summed over its `labels` that name artifacts."""

    path: str
    labels: Sequence[str]
    name: str = "artifact"

    def __post_init__(self) -> None:
        from transformers import AutoImageProcessor, AutoModelForImageClassification

        self.processor = AutoImageProcessor.from_pretrained(self.path)
        self.model = AutoModelForImageClassification.from_pretrained(self.path).eval()
        names = self.model.config.id2label
        unknown = [lab for lab in self.labels if lab not in names.values()]
        if unknown:
            raise ValueError(f"{self.path} has no labels {unknown}; it has {sorted(names.values())}")
        self.ids = [i for i, n in names.items() if n in self.labels]

    def score(self, prompt: RubricPrompt, images: np.ndarray) -> np.ndarray:
        import torch
        from PIL import Image

        inputs = self.processor(images=[Image.fromarray(im) for im in images], return_tensors="pt")
        with torch.no_grad():
            probs = self.model(**inputs).logits.float().softmax(-1)
        return (1.0 - probs[:, self.ids].sum(-1)).double().numpy()


# ------------------------------------------------------------------------------------------- mixing
@dataclass
class RewardMix:
    """A weighted sum of rewards; a reward that returns NaN for a prompt drops out of that prompt's sum, and
    the remaining weights are renormalised, so prompts without quoted text are not penalised by `text`."""

    rewards: list[tuple[Reward, float]]

    def score(self, prompt: RubricPrompt, images: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        parts = {r.name: np.asarray(r.score(prompt, images), np.float64) for r, _ in self.rewards}
        total, weight = np.zeros(len(images)), np.zeros(len(images))
        for r, w in self.rewards:
            ok = ~np.isnan(parts[r.name])
            total[ok] += w * parts[r.name][ok]
            weight[ok] += w
        return np.where(weight > 0, total / np.maximum(weight, 1e-12), np.nan), parts


def make_judge(post) -> Judge:
    """The rubric judge a PostConfig names (the demo's pixel checker is a stand-in for demo drawings only)."""
    from training.evaluation.rubric import DemoGradedPixelJudge, DemoPixelJudge, VLMJudge

    if post.judge == "demo_pixel":
        return DemoPixelJudge()
    if post.judge == "demo_graded":
        return DemoGradedPixelJudge()
    if not post.judge_vlm_path:
        raise ValueError("post.judge=vlm needs post.judge_vlm_path (a VLM folder)")
    return VLMJudge(post.judge_vlm_path, device=post.device)


def make_reward_mix(post, embedder=None, judge: Judge | None = None) -> RewardMix:
    """The configured rewards with their weights (`post.rewards`); `embedder` scores the aesthetic reward;
    `judge`: the rubric's, when the caller has already loaded it (a VLM is loaded once)."""
    out: list[tuple[Reward, float]] = []
    for spec in post.rewards:
        if spec.name == "rubric":
            out.append((RubricReward(judge or make_judge(post)), spec.weight))
        elif spec.name == "text":
            from components.ocr_engines import RapidOCREngine

            out.append((TextRenderingReward(RapidOCREngine(), post.ocr_upscale), spec.weight))
        elif spec.name == "aesthetic":
            if not spec.path or embedder is None:
                raise ValueError(
                    "the aesthetic reward needs its reward_model folder (path) and the embedder it was trained on"
                )
            out.append((AestheticReward(BradleyTerry.load(Path(spec.path)), embedder), spec.weight))
        elif spec.name == "artifact":
            if not spec.path:
                raise ValueError("the artifact reward needs an image classifier folder (path)")
            out.append((ArtifactReward(spec.path, spec.labels), spec.weight))
    return RewardMix(out)


def configured_reward_mix(cfg, judge: Judge | None = None) -> RewardMix:
    """The mix `post.rewards` names, as pairs and GRPO use it: an aesthetic reward scores with the image embedder
    of `data.embed` (the one training.post.reward_model fit its head on; another embedder is refused by name)."""
    embedder = None
    if any(r.name == "aesthetic" for r in cfg.post.rewards):
        from model.image_encoders import make_embedder

        embedder = make_embedder(cfg.data.embed)
    return make_reward_mix(cfg.post, embedder, judge)


def reward_means(mix: RewardMix, prompts: list[RubricPrompt], images: np.ndarray) -> dict[str, float | None]:
    """The mix and each of its rewards averaged over uint8 [P, N, H, W, 3] images of `prompts` (a checkpoint's
    evaluation images): `mix` and one entry per reward name, over the images each could score (None: none)."""
    scored: dict[str, list[np.ndarray]] = {"mix": []}
    for rp, ims in zip(prompts, images, strict=True):
        total, parts = mix.score(rp, ims)
        scored["mix"].append(total)
        for name, v in parts.items():
            scored.setdefault(name, []).append(v)
    out: dict[str, float | None] = {}
    for name, vs in scored.items():
        v = np.concatenate(vs)
        out[name] = round(float(np.nanmean(v)), 6) if (~np.isnan(v)).any() else None
    return out


def post_problems(post) -> list[tuple[str, str]]:
    """(key, problem) for each model post-training would need and cannot find: checked before any work."""
    out = []
    if post.judge == "vlm" and any(r.name == "rubric" for r in post.rewards):
        if not post.judge_vlm_path:
            out.append(
                (
                    "post.judge_vlm_path",
                    "the rubric reward's VLM judge is not set (or post.judge=demo_pixel on demo drawings)",
                )
            )
        elif "://" not in post.judge_vlm_path and not Path(post.judge_vlm_path).exists():
            out.append(("post.judge_vlm_path", f"{post.judge_vlm_path} does not exist"))
    for i, r in enumerate(post.rewards):
        if r.name in ("aesthetic", "artifact") and (not r.path or not Path(r.path).exists()):
            out.append(
                (
                    f"post.rewards.{i}.path",
                    f"the {r.name} reward's model folder {r.path or 'is not set'}{'' if not r.path else ' does not exist'}",
                )
            )
    if post.prompts and not Path(post.prompts).exists():
        out.append(("post.prompts", f"{post.prompts} does not exist"))
    return out
