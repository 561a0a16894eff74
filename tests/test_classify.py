"""Pseudo-label heads: a labeller (a rule, or a VLM asked a yes / no prompt) labels a sample, a calibrated
head learns it from embeddings, filters every row."""

import numpy as np
import pyarrow as pa
import pytest
from caption_fixtures import deduped_rows, scene_image, shape, sign
from held_out import HELD_OUT_SEEDS, held_out_demo

from assets.classify import Labeller, RuleLabeller, VLMLabeller, classify_rows, make_labeller, sample_order
from assets.embed import embed_rows
from kiln.config import ConfigError, load_config
from kiln.reasons import Reason
from kiln.schemas import EMBEDDED, check_schema
from kiln.stage import check_accounting, read_dataset
from model.image_encoders import ClassicalEmbedder


def test_rule_labeller_reads_or_clauses():
    t = pa.table({"a": [1.0, 5.0, 9.0], "b": [0.0, 0.0, 3.0]})
    assert RuleLabeller("a < 2 or b >= 3").label(t).tolist() == [True, False, True]
    with pytest.raises(ValueError, match="cannot parse"):
        RuleLabeller("a <")
    with pytest.raises(KeyError, match="nope"):
        RuleLabeller("nope > 1").label(t)


def test_sample_does_not_depend_on_row_order():
    ids = [f"id{i}" for i in range(50)]
    a = [ids[i] for i in sample_order(ids, 0)]
    b = [ids[::-1][i] for i in sample_order(ids[::-1], 0)]
    assert a == b and a != [ids[i] for i in sample_order(ids, 1)]


def heads(rule, threshold, reject=True, reason="artifact"):
    """One head; half the ~120-row labelled sample held out, so precision and recall rest on ~10 positives."""
    return [
        f"data.classify.heads=[{{name: h, reason: {reason}, rule: '{rule}', threshold: {threshold}, reject: {str(reject).lower()}}}]",
        "data.classify.holdout=0.5",
    ]


@pytest.fixture(scope="module")
def held_out_embedded(tmp_path_factory):
    """EMBEDDED rows of three demo corpora the head's settings were never tried on (seeds 1-3)."""
    tables = []
    for seed in HELD_OUT_SEEDS:
        root = tmp_path_factory.mktemp(f"demo-seed{seed}")
        held_out_demo(root, seed, until="embed")
        tables.append(read_dataset(root / "embedded" / "kept"))
    return tables


@pytest.mark.slow
def test_head_learns_a_visual_pseudo_label_on_held_out_corpora(held_out_embedded):
    """Busy texture (signs, stripes) is visible in the embedding: a head trained on 70 % of each corpus's
    labelled sample finds it in the other 30 %. Precision and recall are pooled over the three corpora
    (about 18 held-out positives; one corpus alone has 6, too few to hold to a bound), with the bounds
    docs/curation.md states; the base rate is about 0.15."""
    tp = predicted = positives = 0
    for table in held_out_embedded:
        out, [report] = classify_rows(
            table, load_config([*heads("laplacian_var > 300", 0.5), "data.classify.holdout=0.3"])
        )
        check_accounting("classify", table, out)
        assert report.trained and report.positives_holdout > 0
        assert set(out.rejected.column("reason").to_pylist()) <= {Reason.ARTIFACT}
        assert min(out.rejected.column("value").to_pylist(), default=1.0) >= 0.5
        assert out.kept.schema.equals(table.schema)
        hits = round((report.recall or 0) * report.positives_holdout)
        tp, positives = tp + hits, positives + report.positives_holdout
        predicted += round(hits / report.precision) if report.precision else 0
    assert predicted > 0, "no head predicted a single held-out positive"
    print("held-out precision", tp / predicted, "recall", tp / positives, "positives", positives)
    assert tp / predicted >= 0.6 and tp / positives >= 0.5


def test_high_threshold_removes_only_the_very_poor_and_report_only_heads_reject_nothing(demo_embedded):
    overrides, root = demo_embedded
    table = read_dataset(root / "embedded" / "kept")
    lax, _ = classify_rows(table, load_config([*overrides, *heads("laplacian_var > 300", 0.5)]))
    strict, _ = classify_rows(table, load_config([*overrides, *heads("laplacian_var > 300", 0.95)]))
    assert strict.rejected.num_rows < lax.rejected.num_rows
    quiet, [rep] = classify_rows(table, load_config([*overrides, *heads("laplacian_var > 300", 0.5, reject=False)]))
    assert quiet.rejected.num_rows == 0 and rep.rejected == 0 and rep.trained


def test_single_class_sample_trains_nothing_and_rejects_nothing(demo_embedded):
    overrides, root = demo_embedded
    table = read_dataset(root / "embedded" / "kept")
    out, [report] = classify_rows(table, load_config([*overrides, *heads("width < 0", 0.5, reason="low_quality")]))
    assert not report.trained and "single-class" in report.note and out.rejected.num_rows == 0


def test_classify_is_deterministic(demo_embedded):
    overrides, root = demo_embedded
    table = read_dataset(root / "embedded" / "kept")
    cfg = load_config([*overrides, *heads("laplacian_var > 300", 0.5)])
    a, ra = classify_rows(table, cfg)
    b, rb = classify_rows(table, cfg)
    assert a.kept.equals(b.kept) and a.rejected.equals(b.rejected) and ra == rb


# ------------------------------------------------------------------------------------ VLM labeller
# A tiny random LLaVA (CLIP vision tower + Llama), saved to a folder and loaded through the product's
# own from_pretrained path. Its answers mean nothing; these tests check the plumbing: one probability
# per row from the "yes" vs "no" next-token logits, repeatable, independent of the batch size.
AI_PROMPT = "Is this image AI-generated? Answer yes or no."


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """Six drawn scenes (signs and shapes) through the embed stage: EMBEDDED rows the classify stage reads."""
    d = tmp_path_factory.mktemp("scenes")
    paths = [
        scene_image(d, f"sign{i}", sign(w, c))
        for i, (w, c) in enumerate([("SALE", "red"), ("OPEN", "yellow"), ("STOP", "white")])
    ]
    paths += [
        scene_image(d, f"shape{i}", shape(n, c))
        for i, (n, c) in enumerate([("circle", "yellow"), ("square", "red"), ("triangle", "green")])
    ]
    out = embed_rows(deduped_rows(paths), ClassicalEmbedder(), max_pixels=64_000_000)
    return check_schema(out.kept, EMBEDDED, "embed")


def vlm_head(path, threshold=0.5, holdout=0.5, **vlm):
    """The override a user writes for one VLM-labelled head (conf/data/*.yaml takes the same keys)."""
    block = {"vlm_path": str(path), "prompt": AI_PROMPT, **vlm}
    fields = ", ".join(f"{k}: {v!r}" if isinstance(v, str) else f"{k}: {v}" for k, v in block.items())
    return [
        f"data.classify.heads=[{{name: ai, reason: ai_generated, labeller: vlm, vlm: {{{fields}}}, threshold: {threshold}}}]",
        f"data.classify.holdout={holdout}",
    ]


def vlm_labeller(path, **vlm) -> VLMLabeller:
    cfg = load_config(vlm_head(path, **vlm))
    return make_labeller(cfg.data.classify.heads[0], cfg.data.filters.max_pixels)


def test_vlm_labeller_loads_the_model_by_path_and_gives_one_probability_per_row(vlm, embedded):
    labeller = vlm_labeller(vlm, batch_size=4)
    assert (
        isinstance(labeller, VLMLabeller)
        and isinstance(labeller, Labeller)
        and labeller.name == f"vlm:llava:{vlm.name}"
    )
    p = labeller.probabilities(embedded)
    assert p.shape == (embedded.num_rows,) and ((p > 0) & (p < 1)).all()
    labels = labeller.label(embedded)
    assert labels.dtype == bool and labels.tolist() == (p >= 0.5).tolist()
    # how the labels were made travels with them: model, prompt, the scored answer tokens, greedy one-step decoding
    d = labeller.decoding
    assert d["model"] == str(vlm) and d["prompt"] == AI_PROMPT and d["batch_size"] == 4 and d["device"] == "cpu"
    assert (d["positive_tokens"], d["negative_tokens"]) == (["yes"], ["no"])
    assert (d["max_new_tokens"], d["num_beams"], d["do_sample"]) == (1, 1, False)


def test_vlm_labels_repeat_and_do_not_depend_on_the_batch_size(vlm, embedded):
    one, three = vlm_labeller(vlm, batch_size=1), vlm_labeller(vlm, batch_size=3)
    p = one.probabilities(embedded)
    np.testing.assert_array_equal(p, one.probabilities(embedded))  # greedy, no sampling: the same every call
    np.testing.assert_allclose(three.probabilities(embedded), p, atol=1e-6)
    assert one.label(embedded).tolist() == three.label(embedded).tolist()


def test_the_probability_compares_the_positive_and_negative_answer_words(vlm, embedded):
    yes = vlm_labeller(vlm).probabilities(embedded)
    no = vlm_labeller(vlm, positive="no", negative="yes").probabilities(embedded)
    np.testing.assert_allclose(yes + no, 1.0, atol=1e-6)  # swapping the words asks the complementary question


def test_an_answer_word_the_tokenizer_does_not_know_fails_clearly(vlm):
    with pytest.raises(ValueError, match="'maybe' has no token"):
        vlm_labeller(vlm, positive="maybe")


def test_the_labeller_config_is_strict(vlm):
    with pytest.raises(ConfigError, match=r"data\.classify\.heads\.0\.vlm\.vlm_pth: unknown key"):
        load_config(vlm_head(vlm, vlm_pth="/models/typo"))
    with pytest.raises(ConfigError, match="labeller=vlm needs a `vlm` block"):
        load_config(["data.classify.heads=[{name: ai, reason: ai_generated, labeller: vlm, rule: 'width > 1'}]"])
    with pytest.raises(ConfigError, match="labeller=rules needs `rule`"):
        load_config(["data.classify.heads=[{name: q, reason: low_quality}]"])
    with pytest.raises(ConfigError, match="answer words are the same"):
        load_config(vlm_head(vlm, positive="yes", negative="Yes"))


def biased_vlm(vlm, out, rows, says_yes: list[bool]):
    """A copy of the tiny VLM whose answer to AI_PROMPT is decided: "yes" for the rows marked True, "no" for the others.

    The answer is read from the last prompt position's final hidden state h (after the last norm): the
    logits of "yes" and "no" are their lm_head rows times h. Solving h_i . u = +1 / -1 over the rows (h has
    more dimensions than there are rows) and writing +10u and -10u into those two rows puts the yes-no logit
    gap at +-20 for exactly these images, so p(yes) is ~1 or ~0 by construction, not by the random seed."""
    import shutil

    import torch

    from components.vlm import vlm_inputs
    from components.yes_no import answer_token_ids

    shutil.copytree(vlm, out)
    model, processor = load_vlm_fresh(out)
    inputs = vlm_inputs(processor, rows.column("uri").to_pylist(), [AI_PROMPT] * rows.num_rows)
    with torch.no_grad():
        res = model(**inputs, output_hidden_states=True)
    h = res.hidden_states[-1][:, -1].double()
    lm_head = model.get_output_embeddings()
    torch.testing.assert_close(lm_head(h.float()), res.logits[:, -1])  # h is what the logits are read from
    u = torch.linalg.lstsq(
        h, torch.tensor([1.0 if y else -1.0 for y in says_yes], dtype=torch.float64)[:, None]
    ).solution[:, 0]
    with torch.no_grad():
        for word, sign_ in (("yes", 1), ("no", -1)):
            for t in answer_token_ids(processor.tokenizer, word):
                lm_head.weight[t] = (sign_ * 10 * u).float()
    model.save_pretrained(out)
    return out


def load_vlm_fresh(path):
    """The model and processor as the product loads them, bypassing its per-process cache (the copy is new)."""
    from components.vlm import _load_vlm

    return _load_vlm.__wrapped__(str(path), "cpu")


def is_sign(rows) -> list[bool]:
    return ["sign" in u.rsplit("/", 1)[-1] for u in rows.column("uri").to_pylist()]


def test_a_vlm_that_calls_signs_ai_generated_trains_a_head_that_rejects_the_signs(vlm, embedded, tmp_path):
    signs = is_sign(embedded)
    biased = biased_vlm(vlm, tmp_path / "says-yes-to-signs", embedded, signs)
    assert vlm_labeller(biased).label(embedded).tolist() == signs
    # one held-out row: the five training rows hold both classes whichever row the sample order holds out
    cfg = load_config(vlm_head(biased, batch_size=2, holdout=0.2))
    out, [report] = classify_rows(embedded, cfg)
    check_accounting("classify", embedded, out)
    assert report.trained and report.note == ""
    assert (report.n_train, report.n_holdout) == (5, 1) and report.positives_train + report.positives_holdout == sum(
        signs
    )
    assert report.labeller == f"vlm:llava:{biased.name}" and report.labeller_decoding["model"] == str(biased)
    assert set(out.rejected.column("reason").to_pylist()) == {Reason.AI_GENERATED}
    sign_ids = {i for i, y in zip(embedded.column("id").to_pylist(), signs) if y}
    assert (
        set(out.rejected.column("id").to_pylist()) == sign_ids
    )  # the head learnt the VLM's labels from the embeddings
    assert report.rejected == len(sign_ids)


def test_a_vlm_that_answers_yes_to_everything_trains_no_head_and_rejects_nothing(vlm, embedded, tmp_path):
    biased = biased_vlm(vlm, tmp_path / "says-yes-always", embedded, [True] * embedded.num_rows)
    assert vlm_labeller(biased).label(embedded).all()
    out, [report] = classify_rows(embedded, load_config(vlm_head(biased, batch_size=2)))
    check_accounting("classify", embedded, out)
    assert not report.trained and "single-class" in report.note
    assert report.positives_train == report.n_train and report.positives_holdout == report.n_holdout
    assert out.rejected.num_rows == 0 and out.kept.num_rows == embedded.num_rows and report.rejected == 0
