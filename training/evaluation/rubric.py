"""Rubrics: a prompt decomposed into verifiable requirements, each checked on the image (GenEval-style).

A prompt set is a JSONL file, one `{"prompt": ..., "requirements": [{"attribute", "value", "question"}]}`
per line. A judge answers each requirement for an image with a score in [0, 1]; a rubric's score is the
mean over the prompt's requirements, and per attribute it is the accuracy the evaluation reports.

The judges:
- `DemoPixelJudge`: the demo profile's instance, the deterministic pixel checker of training/evaluation/prompt_check.py
  on the demo's scene grammar (a stand-in for a VLM judge, named as one: it only reads demo drawings);
  `DemoGradedPixelJudge` answers the same rules with graded scores, so group rewards rarely tie.
- `VLMJudge`: any VLM by path, asked each requirement's yes/no question about the image; the score is
  P(yes) from the first answer token's logits, the VLM labeller's method (assets/classify.py).
Requirements for prompts outside the demo's grammar are written by an LLM by path (`LLMRequirementWriter`;
`kiln rubric --prompts FILE --llm PATH --out DIR` turns a plain prompt file into a rubric set).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class Requirement:
    attribute: str  # what is checked: color, shape, count, position, background, text, or free-form
    value: str  # what it must be
    question: str  # the yes/no question a VLM judge is asked


@dataclass(frozen=True)
class RubricPrompt:
    prompt: str
    requirements: tuple[Requirement, ...] = field(default_factory=tuple)

    def to_json(self) -> str:
        return json.dumps(
            {"prompt": self.prompt, "requirements": [asdict(r) for r in self.requirements]}, sort_keys=True
        )

    @classmethod
    def from_dict(cls, d: dict) -> RubricPrompt:
        return cls(d["prompt"], tuple(Requirement(**r) for r in d.get("requirements", [])))


def write_prompt_set(path: Path, prompts: list[RubricPrompt]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(p.to_json() + "\n" for p in prompts))
    return path


def read_prompt_set(path: Path) -> list[RubricPrompt]:
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(RubricPrompt.from_dict(json.loads(line)))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(
                    f"{path}:{i}: not a rubric prompt ({e}); expected {{'prompt': ..., 'requirements': [...]}}"
                ) from None
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


# ------------------------------------------------------------------------------------ the demo grammar
def demo_requirements(spec) -> tuple[Requirement, ...]:
    """The requirements of a demo prompt (components.demo_scenes.PromptSpec), those the pixel checker verifies."""
    from training.evaluation.prompt_check import Expected

    checkable = Expected(spec.color, spec.position, spec.background, spec.shape, spec.count, spec.size).checkable()
    reqs = [
        Requirement("color", spec.color, f"Is the shape {spec.color}?"),
        Requirement("position", spec.position, f"Is the shape at the {spec.position} of the image?"),
        Requirement("background", spec.background, f"Is the background {spec.background}?"),
    ]
    if checkable["count"]:
        reqs.append(Requirement("count", str(spec.count), f"Are there exactly {spec.count} shapes?"))
    if checkable["shape"]:
        reqs.append(Requirement("shape", spec.shape, f"Is the shape a {spec.shape}?"))
    return tuple(reqs)


def demo_prompt_set(specs) -> list[RubricPrompt]:
    return [RubricPrompt(s.prompt, demo_requirements(s)) for s in specs]


def combination(spec) -> tuple:
    """What makes two demo prompts the same task for the checker: every attribute it reads."""
    return (spec.color, spec.shape, spec.count, spec.position, spec.size, spec.background)


def demo_rl_prompts(n: int, seed: int, exclude=None, family: str | None = None) -> list[RubricPrompt]:
    """`n` distinct demo prompts drawn from the scene grammar (single and counted shapes on plain backgrounds,
    or only `family`'s), none with an attribute combination of `exclude` (default: the evaluation's prompts),
    so the evaluation measures combinations RL never rewarded."""
    from components.demo_scenes import PromptSpec, caption_for, demo_prompts, sample_scene

    held_out = {combination(s) for s in (exclude if exclude is not None else demo_prompts())}
    rng = np.random.default_rng(seed)
    out: dict[tuple, RubricPrompt] = {}
    for _ in range(200 * n):
        scene = sample_scene(rng, family or ("single_shape" if rng.random() < 0.75 else "counted_shapes"))
        sh = scene.shapes[0]
        spec = PromptSpec(
            caption_for(scene), sh.color, sh.shape, sh.count, sh.position, sh.size, scene.background.color, scene
        )
        key = combination(spec)
        if key not in held_out and key not in out:
            out[key] = RubricPrompt(spec.prompt, demo_requirements(spec))
            if len(out) == n:
                return list(out.values())
    raise ValueError(
        f"the demo grammar gave only {len(out)} distinct prompts outside the held-out set; ask for fewer than {n}"
    )


def expected_of(rp: RubricPrompt):
    """The pixel checker's Expected from a demo rubric's requirements."""
    from training.evaluation.prompt_check import Expected

    v = {r.attribute: r.value for r in rp.requirements}
    missing = {"color", "position", "background"} - set(v)
    if missing:
        raise ValueError(
            f"prompt {rp.prompt!r} lacks the demo requirements {sorted(missing)}: the demo pixel judge reads only demo prompts"
        )
    count = int(v["count"]) if "count" in v else None
    return Expected(
        v["color"], v["position"], v["background"], v.get("shape"), count, "large" if "shape" in v else None
    )


# ------------------------------------------------------------------------------------------- judges
class Judge(Protocol):
    name: str

    def answer(self, prompt: RubricPrompt, images: np.ndarray) -> np.ndarray:
        """[N images, R requirements] scores in [0, 1] for uint8 [N, H, W, 3] images of one prompt."""
        ...


class DemoPixelJudge:
    """Demo stand-in: training/evaluation/prompt_check.py's pixel rules, exact 0/1 answers on demo drawings."""

    name = "demo_pixel_checker"

    def check(self, image: np.ndarray, expected) -> dict[str, float]:
        from training.evaluation.prompt_check import check_image

        return {a: float(ok) for a, ok in check_image(image, expected).items()}

    def answer(self, prompt: RubricPrompt, images: np.ndarray) -> np.ndarray:
        expected = expected_of(prompt)
        out = np.zeros((len(images), len(prompt.requirements)), np.float64)
        for i, im in enumerate(images):
            result = self.check(im, expected)
            out[i] = [result.get(r.attribute, 0.0) for r in prompt.requirements]
        return out


class DemoGradedPixelJudge(DemoPixelJudge):
    """Demo stand-in: the same rules answered as graded scores (training.evaluation.prompt_check.graded_check), above 0.5
    exactly where DemoPixelJudge says yes, so accuracies agree while a reward on it is dense, like a VLM's P(yes)."""

    name = "demo_graded_pixel_checker"

    def check(self, image: np.ndarray, expected) -> dict[str, float]:
        from training.evaluation.prompt_check import graded_check

        return graded_check(image, expected)


class VLMJudge:
    """Each requirement's question asked of a VLM by path; the answer is P(yes) (assets.classify's method)."""

    def __init__(self, path: str, positive: str = "yes", negative: str = "no", device: str = "cpu"):
        from components.vlm import load_vlm
        from components.yes_no import YesNo

        self.model, self.processor = load_vlm(path, device)
        self.answers = YesNo.of(self.processor.tokenizer, positive, negative, path)
        self.device = device
        self.name = f"vlm_judge:{Path(path).name}"

    def answer(self, prompt: RubricPrompt, images: np.ndarray) -> np.ndarray:
        import torch
        from PIL import Image

        from components.vlm import chat_text

        pil = [Image.fromarray(im) for im in images]
        out = np.zeros((len(images), len(prompt.requirements)), np.float64)
        for j, req in enumerate(prompt.requirements):
            text = chat_text(self.processor, req.question + " Answer yes or no.")
            inputs = self.processor(images=pil, text=[text] * len(pil), return_tensors="pt", padding=True).to(
                self.device
            )
            with torch.no_grad():
                out[:, j] = self.answers.p_yes(self.model(**inputs).logits[:, -1]).double().cpu().numpy()
        return out


class LLMRequirementWriter:
    """Requirements for any prompt, written by a causal LM by path: one yes/no question per line, greedy."""

    INSTRUCTION = (
        "List the visual requirements of this image prompt as yes/no questions about the image, one per line, "
        "each starting with 'Q:'.\nPrompt: {prompt}\n"
    )

    def __init__(self, path: str, max_new_tokens: int = 96, device: str = "cpu"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path).eval().to(device)
        self.max_new_tokens, self.device = max_new_tokens, device
        self.decoding = {
            "model": path,
            "instruction": self.INSTRUCTION,
            "max_new_tokens": max_new_tokens,
            "do_sample": False,
        }

    def write(self, prompt: str) -> RubricPrompt:
        import torch

        ids = self.tokenizer(self.INSTRUCTION.format(prompt=prompt), return_tensors="pt").to(self.device)
        with torch.no_grad():
            out = self.model.generate(
                **ids, max_new_tokens=self.max_new_tokens, do_sample=False, pad_token_id=self.tokenizer.eos_token_id
            )
        text = self.tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        return RubricPrompt(prompt, parse_questions(text))


def parse_questions(text: str) -> tuple[Requirement, ...]:
    """'Q: ...?' lines of an LLM's answer as free-form requirements (duplicates dropped, order kept)."""
    qs = [line.split("Q:", 1)[1].strip() for line in text.splitlines() if "Q:" in line]
    return tuple(Requirement("free", q, q) for q in dict.fromkeys(q for q in qs if q))


# ------------------------------------------------------------------------------- a rubric set from prompts
RUBRIC_FILE = "prompts.jsonl"


def write_rubric_set(
    prompts: list[str], write, out: Path, decoding: dict | None = None, overwrite: bool = False
) -> dict:
    """OUT/prompts.jsonl: the rubric prompt set (`post.prompts`, `post.eval_prompts`) of plain prompts, each with
    the requirements `write(prompt) -> RubricPrompt` gives it (LLMRequirementWriter.write for real prompts).
    A prompt given no requirement cannot be judged: it goes to OUT/rejected.jsonl with reason
    `no_requirements`, so every prompt is in one file or the other. OUT/rubric.json: counts and `decoding`."""
    from kiln.outputs import check_output, staged_output, write_marker
    from kiln.reasons import Reason

    out = Path(out)
    check_output(out, None, overwrite)
    kept, rejected = [], []
    for prompt in prompts:
        rp = write(prompt)
        if rp.requirements:
            kept.append(rp)
        else:
            rejected.append({"prompt": prompt, "reason": Reason.NO_REQUIREMENTS.value})
    report = {"prompts_in": len(prompts), "prompts": len(kept), "rejected": len(rejected), "decoding": decoding}
    with staged_output(out) as tmp:
        (tmp / RUBRIC_FILE).write_text("".join(p.to_json() + "\n" for p in kept))
        (tmp / "rejected.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rejected))
        (tmp / "rubric.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
        write_marker(tmp, "rubric")
    return report


# ------------------------------------------------------------------------------------------- scoring
def rubric_scores(judge: Judge, prompts: list[RubricPrompt], images: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
    """Per image, the mean requirement score ([P, N] for uint8 [P, N, H, W, 3]), and per attribute the mean
    over every image that was asked it, plus `all`: the share of images meeting every requirement (> 0.5), over
    the prompts that have requirements."""
    per_image = np.zeros(images.shape[:2], np.float64)
    by_attr: dict[str, list[float]] = {}
    all_right: list[bool] = []
    for p, (rp, ims) in enumerate(zip(prompts, images, strict=True)):
        answers = judge.answer(rp, ims) if rp.requirements else np.zeros((len(ims), 0))
        per_image[p] = answers.mean(1) if answers.shape[1] else 0.0
        for j, req in enumerate(rp.requirements):
            by_attr.setdefault(req.attribute, []).extend((answers[:, j] > 0.5).tolist())
        if rp.requirements:  # a prompt with nothing to check is no evidence either way
            all_right.extend((answers > 0.5).all(1).tolist())
    summary = {a: round(float(np.mean(v)), 4) for a, v in sorted(by_attr.items())}
    summary["all"] = round(float(np.mean(all_right)), 4) if all_right else 0.0
    return per_image, summary
