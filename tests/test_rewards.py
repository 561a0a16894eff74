"""Rewards, one interface: the rubric on demo drawings and through a VLM by path, text rendering through real
OCR, a Bradley-Terry aesthetic head that ranks held-out pairs, an artifact classifier by path, and the mix."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from training.evaluation.rewards import (
    BradleyTerry,
    RewardMix,
    RubricReward,
    edit_distance,
    quoted_text,
    text_similarity,
)
from training.evaluation.rubric import (
    DemoGradedPixelJudge,
    DemoPixelJudge,
    Requirement,
    RubricPrompt,
    demo_prompt_set,
    parse_questions,
    read_prompt_set,
    rubric_scores,
    write_prompt_set,
)


def demo_images(size: int = 32) -> tuple[list[RubricPrompt], np.ndarray]:
    """The demo prompts and their scenes drawn by the renderer itself: images that meet every requirement."""
    from components.demo_scenes import demo_prompts, render

    specs = demo_prompts()
    images = np.stack([np.asarray(render(s.scene, size, size))[None] for s in specs])  # [P, 1, H, W, 3]
    return demo_prompt_set(specs), images


def test_a_demo_prompt_decomposes_into_the_requirements_its_grammar_makes_checkable():
    prompts, _ = demo_images()
    first = prompts[0]  # "a large red circle on the left, on a blue background"
    assert [(r.attribute, r.value) for r in first.requirements] == [
        ("color", "red"),
        ("position", "left"),
        ("background", "blue"),
        ("count", "1"),
        ("shape", "circle"),
    ]
    assert all(r.question.endswith("?") for r in first.requirements)


def test_the_rubric_gives_the_renderers_own_images_full_marks_and_anothers_image_less():
    prompts, images = demo_images()
    judge = DemoPixelJudge()
    per_image, summary = rubric_scores(judge, prompts, images)
    assert per_image.mean() > 0.9 and summary["color"] == 1.0 and summary["background"] == 1.0
    shuffled = np.roll(images, 1, axis=0)  # each prompt paired with the previous prompt's drawing
    wrong, wrong_summary = rubric_scores(judge, prompts, shuffled)
    assert wrong.mean() < per_image.mean() - 0.3 and wrong_summary["all"] < summary["all"]
    reward = RubricReward(judge)
    assert reward.score(prompts[0], images[0]).tolist() == per_image[0].tolist()


def test_a_prompt_set_round_trips_through_its_jsonl_file_and_a_bad_line_is_named(tmp_path):
    prompts, _ = demo_images()
    path = write_prompt_set(tmp_path / "prompts.jsonl", prompts)
    assert read_prompt_set(path) == prompts
    path.write_text(path.read_text() + "{not json\n")
    with pytest.raises(ValueError, match=r"prompts.jsonl:13: not a rubric prompt"):
        read_prompt_set(path)


def test_llm_written_requirements_are_read_from_its_q_lines():
    text = "Sure.\nQ: Is there a red circle?\nQ: Is the background blue?\nQ: Is there a red circle?\nthanks"
    assert [r.question for r in parse_questions(text)] == ["Is there a red circle?", "Is the background blue?"]


def test_the_llm_requirement_writer_loads_a_causal_lm_by_path_and_returns_a_rubric(tmp_path):
    from caption_fixtures import write_tiny_causal_lm

    from training.evaluation.rubric import LLMRequirementWriter

    writer = LLMRequirementWriter(str(write_tiny_causal_lm(tmp_path / "llm")), max_new_tokens=8)
    rp = writer.write("a red circle")
    assert rp.prompt == "a red circle" and all(r.attribute == "free" for r in rp.requirements)
    assert writer.decoding["do_sample"] is False


def test_a_rubric_set_keeps_prompts_given_requirements_and_rejects_the_rest_with_a_reason(tmp_path):
    """What an LLM answers is parsed into requirements; a prompt it wrote no question for is rejected, not lost."""
    import json

    from training.evaluation.rubric import RUBRIC_FILE, write_rubric_set

    answers = {
        "a red circle on a blue background": "Q: Is there a circle?\nQ: Is it red?\nQ: Is the background blue?",
        "a feeling of calm": "I cannot say.",
    }
    report = write_rubric_set(
        list(answers), lambda p: RubricPrompt(p, parse_questions(answers[p])), tmp_path / "rubric", {"model": "llm"}
    )
    assert report == {"prompts_in": 2, "prompts": 1, "rejected": 1, "decoding": {"model": "llm"}}
    (kept,) = read_prompt_set(tmp_path / "rubric" / RUBRIC_FILE)
    assert (
        kept.prompt == "a red circle on a blue background"
        and [r.question for r in kept.requirements][-1] == "Is the background blue?"
    )
    rejected = [json.loads(x) for x in (tmp_path / "rubric" / "rejected.jsonl").read_text().splitlines()]
    assert rejected == [{"prompt": "a feeling of calm", "reason": "no_requirements"}]


def test_kiln_rubric_writes_a_prompt_set_with_a_causal_lm_by_path(tmp_path, capsys):
    import json

    from caption_fixtures import write_tiny_causal_lm

    from kiln.cli import main

    llm = write_tiny_causal_lm(tmp_path / "llm")
    (tmp_path / "prompts.txt").write_text('# real prompts\na red circle\n\na sign that says "OPEN"\n')
    argv = [
        "rubric",
        "--prompts",
        str(tmp_path / "prompts.txt"),
        "--llm",
        str(llm),
        "--out",
        str(tmp_path / "rubric"),
        "--max-new-tokens",
        "8",
    ]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prompts_in"] == 2 and report["prompts"] + report["rejected"] == 2  # every prompt kept or rejected
    assert report["decoding"]["model"] == str(llm) and report["decoding"]["do_sample"] is False
    assert json.loads((tmp_path / "rubric" / "rubric.json").read_text()) == report


def test_a_vlm_judge_answers_each_requirement_with_a_probability(vlm):
    from training.evaluation.rubric import VLMJudge

    prompts, images = demo_images()
    judge = VLMJudge(str(vlm))
    answers = judge.answer(prompts[0], images[0].repeat(2, axis=0))
    assert answers.shape == (2, len(prompts[0].requirements)) and ((answers > 0) & (answers < 1)).all()
    assert np.allclose(answers[0], answers[1])  # the same image gets the same answers
    assert np.allclose(judge.answer(prompts[0], images[0]), answers[:1])


# ------------------------------------------------------------------------------------------- text
def test_edit_distance_and_text_similarity_by_hand():
    assert edit_distance("kitten", "sitting") == 3 and edit_distance("", "abc") == 3
    assert text_similarity("OPEN  daily!", "open daily") == 1.0
    assert text_similarity("opem daily", "open daily") == pytest.approx(0.9)
    assert (
        quoted_text('a sign with the word "OPEN" and "DAILY"') == "OPEN DAILY" and quoted_text("a red circle") is None
    )


def sign(text: str, size=(320, 96)) -> np.ndarray:
    im = Image.new("RGB", size, "white")
    ImageDraw.Draw(im).text(
        (size[0] // 2, size[1] // 2), text, fill="black", font=ImageFont.truetype("DejaVuSans.ttf", 40), anchor="mm"
    )
    return np.asarray(im)


@pytest.mark.slow
def test_the_text_reward_reads_the_image_with_real_ocr_and_compares_it_with_the_quoted_text():
    from components.ocr_engines import RapidOCREngine
    from training.evaluation.rewards import TextRenderingReward

    reward = TextRenderingReward(RapidOCREngine())
    images = np.stack([sign("PIZZA"), sign("PASTA"), np.full((96, 320, 3), 255, np.uint8)])
    scores = reward.score(RubricPrompt('a sign with the word "PIZZA"'), images)
    assert scores[0] == 1.0 and 0.0 < scores[1] < 0.7 and scores[2] == 0.0
    assert np.isnan(reward.score(RubricPrompt("a red circle"), images)).all()  # nothing quoted: not scored


# -------------------------------------------------------------------------------------- aesthetic
def test_a_bradley_terry_head_on_the_offline_descriptor_ranks_held_out_pairs_above_chance():
    """Preference: a clean drawing over the same drawing degraded (blur + noise). Trained on some scenes'
    pairs, tested on scenes it never saw."""
    from PIL import ImageFilter

    from components.demo_scenes import render, sample_scene
    from model.image_encoders import ClassicalEmbedder

    rng = np.random.default_rng(0)
    clean = [render(sample_scene(rng, "single_shape"), 64, 64) for _ in range(80)]
    noisy_rng = np.random.default_rng(1)

    def degrade(im):
        a = np.asarray(im.filter(ImageFilter.GaussianBlur(2)), np.float32) + noisy_rng.normal(0, 18, (64, 64, 3))
        return Image.fromarray(np.clip(a, 0, 255).astype(np.uint8))

    emb = ClassicalEmbedder()
    good, bad = emb.embed(clean), emb.embed([degrade(im) for im in clean])
    flip = np.arange(80) % 2 == 1  # half the pairs listed loser-first, so order carries no signal
    model = BradleyTerry.fit(good[:50], bad[:50], emb.name)
    held_out = model.prefers(good[50:], bad[50:])
    assert held_out.mean() >= 0.8, held_out.mean()
    swapped = np.where(flip[50:, None], bad[50:], good[50:]), np.where(flip[50:, None], good[50:], bad[50:])
    assert (model.prefers(*swapped) != flip[50:]).mean() >= 0.8
    untrained = BradleyTerry(np.zeros(good.shape[1]), emb.name)
    assert untrained.prefers(good[50:], bad[50:]).mean() == 0.0  # ties are not preferences: the fit is what ranks


def test_a_reward_model_saves_and_loads_and_refuses_another_embedder(tmp_path):
    from training.evaluation.rewards import AestheticReward

    model = BradleyTerry(np.array([1.0, -1.0]), "emb:a")
    loaded = BradleyTerry.load(model.save(tmp_path / "rm"))
    assert loaded.weights.tolist() == [1.0, -1.0] and loaded.embedder_name == "emb:a"

    class Other:
        name = "emb:b"

        def embed(self, images):
            return np.zeros((len(images), 2))

    with pytest.raises(ValueError, match="trained on emb:a embeddings"):
        AestheticReward(loaded, Other()).score(RubricPrompt("x"), np.zeros((1, 8, 8, 3), np.uint8))


def test_an_aesthetic_reward_named_in_config_scores_with_the_embedder_its_head_was_fit_on(tmp_path):
    """`post.rewards` may name the aesthetic reward by its reward_model folder: the mix pairs and GRPO build
    then embeds with `data.embed` (the demo's offline descriptor) and prefers what the head was fit to prefer."""
    from PIL import ImageFilter

    from components.demo_scenes import render, sample_scene
    from kiln.config import load_config
    from model.image_encoders import ClassicalEmbedder
    from training.evaluation.rewards import configured_reward_mix

    rng = np.random.default_rng(0)
    clean = [render(sample_scene(rng, "single_shape"), 64, 64) for _ in range(40)]
    blurred = [im.filter(ImageFilter.GaussianBlur(3)) for im in clean]
    emb = ClassicalEmbedder()
    BradleyTerry.fit(emb.embed(clean[:30]), emb.embed(blurred[:30]), emb.name).save(tmp_path / "reward_model")
    cfg = load_config([f"post.rewards=[{{name: aesthetic, path: {tmp_path / 'reward_model'}}}]"])
    mix = configured_reward_mix(cfg)
    images = np.stack([np.asarray(im) for im in clean[30:] + blurred[30:]])
    total, parts = mix.score(RubricPrompt("a shape"), images)
    assert set(parts) == {"aesthetic"} and ((total > 0) & (total < 1)).all()
    assert (total[:10] > total[10:]).mean() >= 0.8  # held-out scenes: the sharp drawing over its blurred copy


# ---------------------------------------------------------------------------------------- artifact
def tiny_classifier(path, labels=("clean", "artifact")):
    import torch
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(0)
    cfg = ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                    id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)})  # fmt: skip
    ViTForImageClassification(cfg).save_pretrained(path)
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(path)
    return str(path)


def test_the_artifact_reward_is_one_minus_the_classifiers_artifact_probability(tmp_path):
    from training.evaluation.rewards import ArtifactReward

    path = tiny_classifier(tmp_path / "clf")
    reward = ArtifactReward(path, ["artifact"])
    scores = reward.score(RubricPrompt("x"), np.random.default_rng(0).integers(0, 255, (3, 32, 32, 3), dtype=np.uint8))
    assert scores.shape == (3,) and ((scores > 0) & (scores < 1)).all()
    with pytest.raises(ValueError, match="has no labels"):
        ArtifactReward(path, ["blurry"])


# --------------------------------------------------------------------------------------------- mix
def test_the_mix_renormalises_weights_where_a_reward_cannot_score_a_prompt():
    class Const:
        def __init__(self, name, values):
            self.name, self.values = name, np.asarray(values, float)

        def score(self, prompt, images):
            return self.values

    mix = RewardMix([(Const("rubric", [1.0, 0.0]), 3.0), (Const("text", [np.nan, 1.0]), 1.0)])
    total, parts = mix.score(RubricPrompt("p", (Requirement("color", "red", "?"),)), np.zeros((2, 4, 4, 3), np.uint8))
    assert total.tolist() == [1.0, 0.25] and set(parts) == {"rubric", "text"}


def test_reward_means_average_the_mix_and_each_reward_over_the_images_it_could_score():
    """What a post-training checkpoint's page reports before and after: the mix's mean and each reward's."""
    from training.evaluation.rewards import reward_means

    class ByPrompt:
        def __init__(self, name, table):
            self.name, self.table = name, table

        def score(self, prompt, images):
            return np.asarray(self.table[prompt.prompt], float)

    mix = RewardMix(
        [
            (ByPrompt("rubric", {"a": [1.0, 0.0], "b": [0.5, 0.5]}), 1.0),
            (ByPrompt("text", {"a": [np.nan, np.nan], "b": [1.0, 0.0]}), 1.0),
        ]
    )
    means = reward_means(mix, [RubricPrompt("a"), RubricPrompt("b")], np.zeros((2, 2, 4, 4, 3), np.uint8))
    # mix per image: a -> [1, 0] (text cannot score it), b -> [0.75, 0.25]; text only over b's two images
    assert means == {"mix": 0.5, "rubric": 0.5, "text": 0.5}
    nothing = RewardMix([(ByPrompt("text", {"a": [np.nan]}), 1.0)])
    assert reward_means(nothing, [RubricPrompt("a")], np.zeros((1, 1, 4, 4, 3), np.uint8)) == {
        "mix": None,
        "text": None,
    }


def test_the_evaluations_prompt_following_is_the_rubric_over_a_prompt_set_file(tmp_path):
    """post.eval_prompts names a GenEval-style set for any checkpoint; the demo profile's judge is the pixel checker,
    named as the stand-in it is; without a file the evaluation scores the 12 demo prompts."""
    from kiln.config import load_config
    from training.evaluation.evaluate import eval_rubric

    prompts, _ = demo_images()
    path = write_prompt_set(tmp_path / "eval.jsonl", prompts[3:5])
    chosen, judge = eval_rubric(load_config([f"post.eval_prompts={path}"]))
    assert chosen == prompts[3:5] and judge.name == "demo_pixel_checker"
    assert eval_rubric(load_config([]))[0] == prompts
    with pytest.raises(ValueError, match="judge_vlm_path"):  # a real profile's judge is a VLM by path
        eval_rubric(load_config(["post.judge=vlm"]))


def test_a_prompt_without_requirements_does_not_count_as_all_right():
    prompts, images = demo_images()
    wrong = np.roll(images, 1, axis=0)  # every prompt gets another prompt's drawing: few are all right
    _, summary = rubric_scores(DemoPixelJudge(), prompts, wrong)
    unscored = RubricPrompt("a feeling of calm")  # e.g. an LLM found nothing to check
    _, with_it = rubric_scores(DemoPixelJudge(), [*prompts, unscored], np.concatenate([wrong, wrong[:1]]))
    assert with_it == summary


def test_the_rubric_with_the_pixel_judge_scores_exactly_what_the_demo_checker_did():
    """The evaluation's prompt following moved onto the rubric; on the demo its numbers are the checker's."""
    from components.demo_scenes import demo_prompts
    from training.evaluation.prompt_check import accuracy, expected_from_specs

    prompts, images = demo_images()
    rng = np.random.default_rng(3)
    mixed = np.concatenate(
        [images, np.roll(images, 2, axis=0), rng.integers(0, 255, images.shape, dtype=np.uint8)], axis=1
    )  # [P, 3, ...]
    _, summary = rubric_scores(DemoPixelJudge(), prompts, mixed)
    assert summary == accuracy(mixed, expected_from_specs(demo_prompts()))


def demo_requirements_of(color: str, position: str, background: str) -> tuple[Requirement, ...]:
    return (
        Requirement("color", color, ""),
        Requirement("position", position, ""),
        Requirement("background", background, ""),
    )


def disc_image(bg: str, fg: str, cx: int, cy: int, r: int = 6, size: int = 32, ground=None) -> np.ndarray:
    """One flat disc on a flat ground (`ground`: an RGB to paint instead of the palette's `bg`)."""
    from components.demo_scenes import COLORS

    yy, xx = np.mgrid[0:size, 0:size]
    img = np.empty((size, size, 3), np.uint8)
    img[:] = COLORS[bg] if ground is None else np.asarray(ground, np.uint8)
    img[(xx - cx) ** 2 + (yy - cy) ** 2 <= r * r] = COLORS[fg]
    return img


def test_the_graded_judge_agrees_with_the_pixel_judge_on_every_verdict_and_ranks_within_them():
    """Graded answers sit above 0.5 exactly where the checker says yes, so the evaluation's accuracies are
    unchanged; within a verdict they order images by how near they are to the request."""
    from components.demo_scenes import demo_prompts
    from training.evaluation.prompt_check import accuracy, expected_from_specs

    prompts, images = demo_images()
    rng = np.random.default_rng(11)  # not the seed of the exact-match test above
    mixed = np.concatenate(
        [images, np.roll(images, 5, axis=0), rng.integers(0, 255, images.shape, dtype=np.uint8)], axis=1
    )
    hard, graded = DemoPixelJudge(), DemoGradedPixelJudge()
    for rp, ims in zip(prompts, mixed, strict=True):
        assert np.array_equal(graded.answer(rp, ims) > 0.5, hard.answer(rp, ims) > 0.5)
    _, summary = rubric_scores(graded, prompts, mixed)
    assert summary == accuracy(mixed, expected_from_specs(demo_prompts()))

    # a red disc on the left of a blue ground, asked for a red shape on the left of a purple ground:
    # the background fails either way, but a ground halfway to purple is nearer than the blue one,
    # and a disc moved from the left edge towards the right is further from what was asked
    from components.demo_scenes import COLORS

    rp = RubricPrompt("a red shape on the left, on a purple background", demo_requirements_of("red", "left", "purple"))
    base = disc_image("blue", "red", 8, 16)
    nearer_ground = disc_image("blue", "red", 8, 16, ground=(np.array(COLORS["blue"]) + np.array(COLORS["purple"])) / 2)
    drifted = disc_image("blue", "red", 11, 16)
    a = graded.answer(rp, np.stack([base, nearer_ground, drifted]))  # columns: color, position, background
    assert (a[:, 2] < 0.5).all() and a[1, 2] > a[0, 2]
    assert (a[:, 1] > 0.5).all() and a[0, 1] > a[2, 1]
