"""Pseudo-label heads: a rule labels a sample, a calibrated head learns it from embeddings, filters every row."""

import pyarrow as pa
import pytest

from assets.classify import RuleLabeller, classify_rows, sample_order
from kiln.config import load_config
from kiln.reasons import Reason
from kiln.stage import check_accounting, read_dataset


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
    return [f"data.classify.heads=[{{name: h, reason: {reason}, rule: '{rule}', threshold: {threshold}, reject: {str(reject).lower()}}}]",
            "data.classify.holdout=0.5"]


def test_head_learns_a_visual_pseudo_label_and_reports_held_out_precision_recall(demo_embedded):
    overrides, root = demo_embedded
    table = read_dataset(root / "embedded" / "kept")
    # busy texture (signs, stripes) is visible in the embedding: the head must learn it well
    out, [report] = classify_rows(table, load_config([*overrides, *heads("laplacian_var > 300", 0.5)]))
    check_accounting("classify", table, out)
    print(report)
    assert report.trained and report.positives_holdout > 0
    assert report.precision >= 0.6 and report.recall >= 0.5  # base rate: about 0.15
    assert set(out.rejected.column("reason").to_pylist()) == {Reason.ARTIFACT}
    assert min(out.rejected.column("value").to_pylist()) >= 0.5
    assert out.kept.schema.equals(table.schema)


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
