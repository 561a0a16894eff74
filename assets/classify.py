"""The classify stage: EMBEDDED -> EMBEDDED; small heads trained on pseudo-labels filter the rows.

For each configured head (`data.classify.heads`):
1. a `Labeller` labels a sample of rows (the smallest sha1(seed:id), so the sample is the same on
   every machine): a rule over the row's measured columns for the demo (`RuleLabeller`); in
   production a VLM asked a yes / no task prompt per image (`VLMLabeller`, same interface), whose
   label is p(positive answer) >= 0.5 from its next-token logits;
2. a head (logistic regression, or a small MLP) is trained on the embeddings of part of the sample,
   calibrated (Platt scaling, cross-validated), and evaluated on the held-out part: precision and
   recall at the head's threshold, reported in `HeadReport`;
3. the head scores every row; with `reject: true`, a row whose calibrated probability is at least
   the threshold is rejected with the head's reason (`low_quality`, `artifact`, `ai_generated`),
   the probability as value. Thresholds sit high on purpose: the Krea 2 report uses the quality
   filter only to remove the very poor.

A head whose sample holds a single class cannot be trained; it rejects nothing and says so.
"""

from __future__ import annotations

import hashlib
import operator
import re
from dataclasses import asdict, dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import pyarrow as pa

from assets.embed import matrix
from components.vlm import GenerationSettings, load_vlm, vlm_inputs
from components.yes_no import YesNo
from kiln.config import ClassifyConfig, HeadConfig, KilnConfig
from kiln.reasons import Reason
from kiln.schemas import EMBEDDED
from kiln.stage import Rejects, Stage, StageOutput


# --------------------------------------------------------------------------------------- labellers
@runtime_checkable
class Labeller(Protocol):
    name: str
    decoding: dict  # how the labels were produced (rule, or model path + prompt + decoding settings)

    def label(self, rows: pa.Table) -> np.ndarray:
        """One bool per row: does the row have the property the head learns?"""
        ...


OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne}
CLAUSE = re.compile(r"^\s*(\w+)\s*(<=|>=|==|!=|<|>)\s*(-?[\d.eE+-]+)\s*$")


class RuleLabeller:
    """`col op number [or col op number ...]` over the row's columns, e.g. "laplacian_var < 60 or entropy < 4"."""

    def __init__(self, rule: str):
        self.clauses = []
        for part in rule.split(" or "):
            m = CLAUSE.match(part)
            if not m:
                raise ValueError(f"cannot parse rule clause {part!r} (expected 'column op number')")
            self.clauses.append((m.group(1), OPS[m.group(2)], float(m.group(3))))
        self.name = f"rules:{rule}"
        self.decoding = {"method": "rule", "rule": rule}

    def label(self, rows: pa.Table) -> np.ndarray:
        out = np.zeros(rows.num_rows, bool)
        for col, op, value in self.clauses:
            if col not in rows.column_names:
                raise KeyError(f"rule column {col!r} is not in the table ({', '.join(rows.column_names)})")
            out |= op(np.asarray(rows.column(col), np.float64), value)
        return out


class VLMLabeller:
    """A VLM asked the task prompt about each image; the label is whether it would answer `positive`.

    Per image: the prompt in the model's chat template after the image, one greedy step, and from that
    step's logits p = softmax([logsumexp(positive tokens), logsumexp(negative tokens)])[0], i.e. how
    much more the model leans to "yes" than to "no". No free text is parsed, so a model that would go
    on to ramble, or a random test model, still gives a probability. `label` is p >= 0.5. Batched
    through generate (left-padded, attention-masked, so each prompt's answer starts at its own last
    position): the same rows give the same probabilities, up to float rounding, whatever the batch size."""

    def __init__(
        self,
        path: str,
        prompt: str,
        positive: str = "yes",
        negative: str = "no",
        batch_size: int = 8,
        device: str = "cpu",
        max_pixels: int = 64_000_000,
    ):
        self.path, self.prompt, self.batch_size, self.device, self.max_pixels = (
            path,
            prompt,
            batch_size,
            device,
            max_pixels,
        )
        self.model, self.processor = load_vlm(path, device)
        tok = self.processor.tokenizer
        self.answers = YesNo.of(tok, positive, negative, path)
        self.positive_ids, self.negative_ids = self.answers.positive_ids, self.answers.negative_ids
        self.settings = GenerationSettings(
            max_new_tokens=1, min_new_tokens=0
        )  # greedy, one step: only its logits are read
        self.name = f"vlm:{self.model.config.model_type}:{path.rstrip('/').split('/')[-1]}"
        self.decoding = {
            "model": path,
            "prompt": prompt,
            "positive": positive,
            "negative": negative,
            "positive_tokens": tok.convert_ids_to_tokens(self.positive_ids),
            "negative_tokens": tok.convert_ids_to_tokens(self.negative_ids),
            "method": "next-token logits: p = softmax(logsumexp(positive), logsumexp(negative)); label = p >= 0.5",
            "batch_size": batch_size,
            "device": device,
            **asdict(self.settings),
        }

    def probabilities(self, rows: pa.Table) -> np.ndarray:
        """p(positive answer) per row, float64."""
        import torch

        uris = rows.column("uri").to_pylist()
        out = []
        for start in range(0, len(uris), self.batch_size):
            batch = uris[start : start + self.batch_size]
            inputs = vlm_inputs(self.processor, batch, [self.prompt] * len(batch), self.device, self.max_pixels)
            with torch.no_grad():
                gen = self.model.generate(
                    **inputs, **self.settings.kwargs(), output_logits=True, return_dict_in_generate=True
                )
            out.append(
                self.answers.p_yes(gen.logits[0]).double().cpu().numpy()
            )  # the first generated position's raw logits
        return np.concatenate(out) if out else np.zeros(0, np.float64)

    def label(self, rows: pa.Table) -> np.ndarray:
        return self.probabilities(rows) >= 0.5


def make_labeller(head: HeadConfig, max_pixels: int) -> Labeller:
    """The head's labeller; `max_pixels` is the filter stage's limit, applied again when a VLM opens the images."""
    if head.labeller == "rules":
        assert head.rule is not None  # the config guarantees it
        return RuleLabeller(head.rule)
    if head.labeller == "vlm":
        v = head.vlm
        assert v is not None
        return VLMLabeller(v.vlm_path, v.prompt, v.positive, v.negative, v.batch_size, v.device, max_pixels)
    raise ValueError(f"unknown labeller {head.labeller!r}")


# -------------------------------------------------------------------------------------------- heads
@dataclass(frozen=True)
class HeadReport:
    head: str
    labeller: str
    trained: bool
    n_train: int
    n_holdout: int
    positives_train: int
    positives_holdout: int
    threshold: float
    precision: float | None  # held-out, at the threshold; None when nothing was predicted positive
    recall: float | None  # held-out, at the threshold; None without held-out positives
    precision_at_half: float | None
    recall_at_half: float | None
    rejected: int = 0
    note: str = ""
    labeller_decoding: dict = field(
        default_factory=dict
    )  # the labeller's `decoding`: rule, or model path, prompt, settings


def sample_order(ids: list[str], seed: int) -> np.ndarray:
    """Row indices ordered by sha1(seed:id): a sample that does not depend on shard layout."""
    keys = [hashlib.sha1(f"{seed}:{i}".encode()).hexdigest() for i in ids]
    return np.array(sorted(range(len(ids)), key=keys.__getitem__), np.int64)


def fit_head(x: np.ndarray, y: np.ndarray, model: str, seed: int):
    """A calibrated classifier: Platt scaling over 3 folds when each class has 3 rows, else uncalibrated."""
    from sklearn.calibration import CalibratedClassifierCV
    from sklearn.linear_model import LogisticRegression
    from sklearn.neural_network import MLPClassifier

    if model == "logistic":
        base = LogisticRegression(C=10.0, class_weight="balanced", max_iter=2000)
    else:
        base = MLPClassifier(hidden_layer_sizes=(64,), alpha=1e-3, max_iter=500, random_state=seed)
    if min(int(y.sum()), int((~y).sum())) >= 3:
        return CalibratedClassifierCV(base, method="sigmoid", cv=3).fit(x, y)
    return base.fit(x, y)


def _pr(y: np.ndarray, pred: np.ndarray) -> tuple[float | None, float | None]:
    tp = int((y & pred).sum())
    precision = tp / int(pred.sum()) if pred.any() else None
    recall = tp / int(y.sum()) if y.any() else None
    return precision, recall


def train_head(
    table: pa.Table, x: np.ndarray, cfg: ClassifyConfig, head: HeadConfig, max_pixels: int
) -> tuple[np.ndarray | None, HeadReport]:
    """Pseudo-label a sample, train + calibrate + evaluate a head; return every row's probability."""
    labeller = make_labeller(head, max_pixels)
    order = sample_order(table.column("id").to_pylist(), cfg.seed)[: cfg.sample]
    y = labeller.label(table.take(pa.array(order)))
    n_hold = max(1, int(round(len(order) * cfg.holdout)))
    tr, ho = np.arange(len(order) - n_hold), np.arange(len(order) - n_hold, len(order))
    base = dict(
        head=head.name,
        labeller=labeller.name,
        labeller_decoding=labeller.decoding,
        n_train=len(tr),
        n_holdout=len(ho),
        positives_train=int(y[tr].sum()),
        positives_holdout=int(y[ho].sum()),
        threshold=head.threshold,
    )
    if len(np.unique(y[tr])) < 2:
        return None, HeadReport(
            **base,
            trained=False,
            precision=None,
            recall=None,
            precision_at_half=None,
            recall_at_half=None,
            note="single-class training sample: head not trained, nothing rejected",
        )
    clf = fit_head(x[order[tr]], y[tr], cfg.model, cfg.seed)
    p_hold = clf.predict_proba(x[order[ho]])[:, 1]
    precision, recall = _pr(y[ho], p_hold >= head.threshold)
    p_half, r_half = _pr(y[ho], p_hold >= 0.5)
    return clf.predict_proba(x)[:, 1], HeadReport(
        **base, trained=True, precision=precision, recall=recall, precision_at_half=p_half, recall_at_half=r_half
    )


# ------------------------------------------------------------------------------------------- stage
def classify_rows(table: pa.Table, cfg: KilnConfig, stage: str = "classify") -> tuple[StageOutput, list[HeadReport]]:
    """Train every head, reject rows over a rejecting head's threshold (the first head that fires names the reason)."""
    c = cfg.data.classify
    rejects = Rejects(stage)
    if table.num_rows == 0 or not c.heads:
        return StageOutput(table, rejects.table()), []
    x = matrix(table)
    ids, uris = table.column("id").to_pylist(), table.column("uri").to_pylist()
    done = np.zeros(table.num_rows, bool)
    reports = []
    for head in c.heads:
        probs, report = train_head(table, x, c, head, cfg.data.filters.max_pixels)
        n_rej = 0
        if probs is not None and head.reject:
            for r in np.flatnonzero((probs >= head.threshold) & ~done):
                rejects.add(
                    ids[r], uris[r], Reason(head.reason), float(probs[r]), f"head {head.name} p>={head.threshold}"
                )
                done[r] = True
                n_rej += 1
        reports.append(HeadReport(**{**report.__dict__, "rejected": n_rej}))
    return StageOutput(table.take(pa.array(np.flatnonzero(~done))), rejects.table()), reports


def classify_stage(table: pa.Table, cfg: KilnConfig) -> StageOutput:
    return classify_rows(table, cfg)[0]


STAGE = Stage("classify", classify_stage, input_schema=EMBEDDED, output_schema=EMBEDDED, scope="global")
