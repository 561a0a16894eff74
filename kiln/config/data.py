"""data: the curation stages' settings, from the source to the packed train sets, and the offline stand-ins
a profile may name in place of models."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from kiln.config.base import (
    MAX_BATCH,
    MAX_ROWS,
    MAX_SIDE,
    MAX_STEPS,
    MAX_THREADS,
    MAX_TOKENS,
    PairError,
    Seed,
    Strict,
    check_order,
)


class DemoConfig(Strict):
    n: int = Field(
        6000,
        ge=40,
        le=10**7,
        description="number of raw files to write; 6000 (~3,800 training rows) lifts the demo model over 480's ~360 (docs/training.md)",
    )
    seed: Seed = 0
    size: int = Field(96, ge=32, le=4096, description="side of the procedurally drawn scenes, px")


class IngestConfig(Strict):
    shard_size: int = Field(2000, ge=1, le=10**8, description="files per manifest shard")
    max_bytes: int = Field(
        256 * 2**20,
        ge=1,
        le=2**40,
        description="bytes read at most per file (ingest and filter); a larger file is rejected too_large before it is read",
    )
    symlinks: Literal["follow", "refuse"] = Field(
        "follow",
        description="a symlink met walking a folder: follow it (loops are rejected `symlink`), or reject what it leads to `symlink`",
    )
    roots: list[str] = Field(
        default_factory=list,
        description="folders or prefixes (`https://`, `s3://bucket/`) that uris in a .txt / Parquet list may name besides the "
        "list's own folder (a local list) or bucket / host (a remote list); any other uri is rejected outside_roots",
    )


class FilterConfig(Strict):
    min_side: int = Field(
        128,
        ge=1,
        le=MAX_SIDE,
        description="reject if min(width, height) is below this (thumbnails; docs/real-data-defaults.md)",
    )
    max_aspect: float = Field(3.0, ge=1.0, le=MAX_SIDE, description="reject if max(w,h)/min(w,h) is above this")
    max_pixels: int = Field(
        64_000_000, ge=1, le=MAX_SIDE**2, description="decompression-bomb guard: reject above this many pixels"
    )
    decode_size: int = Field(
        256, ge=32, le=MAX_SIDE, description="JPEGs are decoded reduced (DCT scaling) to about this side"
    )
    stats_size: int = Field(
        128, ge=16, le=4096, description="every statistic and hash is computed on a resize to this square"
    )
    formats: list[str] = Field(
        default_factory=lambda: ["JPEG", "MPO", "PNG", "GIF", "WEBP", "TIFF", "BMP", "PPM", "TGA", "JPEG2000", "AVIF"],
        description="PIL format names the filter decodes; any other identified format is UNSUPPORTED_FORMAT",
    )
    min_laplacian_var: float = Field(
        2.0,
        ge=0,
        le=1e8,
        description="below: flat (on the stats_size square); low on purpose: the report keeps blur (bokeh, soft focus)",
    )
    max_laplacian_var: float = Field(
        28000.0,
        ge=0,
        le=1e8,
        description="above: extreme texture or noise (on the stats_size square); dense text and texture photos stay below",
    )
    min_entropy: float = Field(
        0.3,
        ge=0,
        le=8,
        description="mean RGB channel-histogram entropy (bits) below which an image is flat; text on a flat background measures from ~0.5",
    )
    max_white_ratio: float = Field(
        0.98,
        ge=0,
        le=1,
        description="share of near-white pixels above which an image is blank (documents and posters reach 0.95)",
    )
    max_black_ratio: float = Field(
        0.98, ge=0, le=1, description="share of near-black pixels above which an image is blank"
    )
    max_border_share: float = Field(
        0.9,
        ge=0,
        le=1,
        description="share of the image taken by flat bands at its edges; quote cards and signs reach 0.83",
    )

    @model_validator(mode="after")
    def _thresholds_in_order(self) -> FilterConfig:
        check_order(
            "min_laplacian_var", self.min_laplacian_var, "max_laplacian_var", self.max_laplacian_var, strict=True
        )
        if self.min_side**2 > self.max_pixels:
            raise PairError(
                f"min_side ({self.min_side}) squared is above max_pixels ({self.max_pixels}): every image would be rejected",
                "min_side",
                "max_pixels",
            )
        return self


class DedupConfig(Strict):
    phash_radius: int = Field(12, ge=0, le=144, description="max Hamming distance between 12x12 pHashes")
    color_radius: int = Field(
        6, ge=0, le=64, description="max Hamming distance between colour hashes (L1 of cube-root shares)"
    )
    bands: int = Field(
        7,
        ge=1,
        le=144,
        description="pHash bands; each band is probed within phash_radius // bands flips, which the pigeonhole "
        "principle makes exact (recall 1.0); 7 bands of ~21 bits suit radius 12 (see docs/curation.md)",
    )
    mirror: bool = Field(
        True,
        description="also match left-right mirrored copies (the mirrored pHash is a bit mask away; the trainer never flips)",
    )


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
    min_line_chars: int = Field(
        2, ge=1, le=10000, description="lines with fewer letters / digits are dropped (a lone 'O' is usually a circle)"
    )
    tesseract_upscale: int = Field(
        3, ge=1, le=16, description="tesseract reads small glyphs badly: upscale by this first"
    )
    gate_side: int = Field(
        256,
        ge=0,
        le=4096,
        description="OCR only images a cheap text detector fires on (RapidOCR's detector at this longer side, ~20 ms); 0 = OCR every image",
    )
    # the text filter of a low-resolution training stage
    filter_resolution: int = Field(
        256, ge=8, le=MAX_SIDE, description="square side (pixel area) of the stage the text filter judges for"
    )
    min_text_height: float = Field(
        6.0, ge=0, le=MAX_SIDE, description="px: text lines shorter than this at filter_resolution are illegible"
    )


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
        default_factory=lambda: {
            "short": (3, 120),
            "medium": (3, 300),
            "long": (3, 2000),
            "tags": (1, 400),
            "json": (2, 4000),
        },
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
        default_factory=lambda: [
            MixPart(name="text", where="contains_text", share=0.4),
            MixPart(name="no_text", where="NOT contains_text", share=0.6),
        ]
    )
    sft_size: int = Field(20, ge=1, le=MAX_ROWS)
    sft_where: str = Field("true", description="DuckDB predicate of SFT candidates")
    sft_order: str = Field("laplacian_var DESC", description="DuckDB ORDER BY of SFT candidates (best first)")
    domains: list[DomainMix] = Field(
        default_factory=list, description="one mix `domain_<name>` per domain SFT rung (ladder.domains)"
    )
    seed: Seed = 0

    @model_validator(mode="after")
    def _shares_sum_to_one(self) -> MixConfig:
        total = sum(p.share for p in self.midtrain)
        if self.midtrain and abs(total - 1.0) > 1e-6:  # assets.mixes.quotas divides midtrain_size by them
            raise PairError(
                f"midtrain shares sum to {total}, not 1: {[(p.name, p.share) for p in self.midtrain]}", "midtrain"
            )
        names = [d.name for d in self.domains]
        if len(set(names)) != len(names):
            raise PairError(f"domain mix names repeat: {names}", "domains")
        return self


class ConceptConfig(Strict):
    path: str = Field(
        "conf/data/concepts_demo.csv", description="concept list: CSV or Parquet with columns concept, rank"
    )
    columns: list[str] = Field(
        default_factory=lambda: ["caption", "ocr_text"], description="text searched for concepts"
    )
    alpha: float = Field(0.5, ge=0, le=10, description="row weight = (median count / rarest concept's count) ** alpha")
    max_weight: float = Field(10.0, ge=1, le=1e6)


class PackConfig(Strict):
    resolution: int = Field(
        256,
        ge=8,
        le=8192,
        description="side of the square bucket (the first ladder rung); other buckets keep its pixel area",
    )
    aspect_buckets: list[Annotated[float, Field(ge=1 / 16, le=16)]] = Field(
        default_factory=lambda: [0.5, 0.75, 1.0, 1.333, 2.0],
        min_length=1,
        description="width / height of each bucket, each in [1/16, 16]",
    )
    batch_size: int = Field(32, ge=1, le=65536, description="rows per packed batch; every batch shares one bucket")
    seed: int = Field(0, ge=0, le=2**63 - 1)
    mix_file: str | None = Field(
        None,
        description="a mix (assets.mixes output Parquet with an `id` column): rows not in it are rejected not_in_mix",
    )
    weights_file: str | None = Field(
        None,
        description="concept coverage weights (assets.concepts OUT/weights.parquet: id, sampling_weight); None = every row weight 1, a row it does not name weight 1",
    )
    image_format: Literal["png", "webp", "jpeg"] = Field(
        "png", description="how the shards store images: png and webp lossless, jpeg at jpeg_quality"
    )
    jpeg_quality: int = Field(95, ge=1, le=100, description="with image_format=jpeg")
    shard_mb: float = Field(
        256, ge=0.001, le=65536, description="train-set shard size in MB (shards are cut between packed batches)"
    )
    latents_from: str | None = Field(
        None,
        description="a diffusers AutoencoderKL folder, the model's model.autoencoder_path: store its latent beside each image (docs/streaming.md); None = images only",
    )
    latent_dtype: Literal["float16", "float32"] = "float16"
    min_psnr: float = Field(
        25.0,
        ge=0,
        le=100,
        description="latents: the stage refuses an autoencoder whose decode(encode(x)) mean PSNR in dB on the held-out rows is lower",
    )
    psnr_rows: int = Field(
        64, ge=1, le=100_000, description="latents: held-out rows (smallest sha1(id)) the PSNR check uses"
    )
    encode_batch: int = Field(16, ge=1, le=4096, description="latents: images per autoencoder forward")


class EmbedConfig(Strict):
    """Which embedder turns each kept image into a vector (assets.embed)."""

    embedder: Literal["hf", "classical"] = Field(
        "hf", description="classical: offline colour/texture/shape descriptor; hf: a vision model by path"
    )
    path: str | None = Field(None, description="HF model folder (SigLIP / CLIP / DINOv2 classes) when embedder=hf")
    batch_size: int = Field(32, ge=1, le=MAX_BATCH)
    device: str = Field("cpu", description="cpu or cuda[:n]")
    size: int = Field(
        64, ge=16, le=4096, description="classical descriptor: side of the square the image is resized to"
    )


class VLMLabellerConfig(Strict):
    """A VLM asked a yes / no task prompt per image (assets.classify.VLMLabeller)."""

    vlm_path: str = Field(
        description="image-text-to-text model + processor folder, loaded through AutoModelForImageTextToText"
    )
    prompt: str = Field(
        description='the task asked of each image, e.g. "Is this image AI-generated? Answer yes or no."'
    )
    positive: str = Field(
        "yes", min_length=1, description="answer word meaning the row has the property (its first token is scored)"
    )
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
    labeller: Literal["rules", "vlm"] = Field(
        "rules", description="rules: `rule` over the row's columns; vlm: the `vlm` block"
    )
    rule: str | None = Field(
        None, description='labeller=rules: rule over row columns, e.g. "laplacian_var < 40 or entropy < 4"'
    )
    vlm: VLMLabellerConfig | None = Field(None, description="labeller=vlm: the model, task prompt and answer words")
    threshold: float = Field(0.9, ge=0, le=1, description="reject when the calibrated probability is at least this")
    reject: bool = Field(True, description="False: train and report only")

    @model_validator(mode="after")
    def _labeller_is_configured(self) -> HeadConfig:
        if self.labeller == "rules" and (self.rule is None or self.vlm is not None):
            raise ValueError(f"head {self.name!r}: labeller=rules needs `rule` and no `vlm` block")
        if self.labeller == "vlm" and (self.vlm is None or self.rule is not None):
            raise ValueError(
                f"head {self.name!r}: labeller=vlm needs a `vlm` block (vlm_path, prompt, ...) and no `rule`"
            )
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
    reject_tags: list[str] = Field(
        default_factory=list, description="reject rows on which a feature with one of these tags fires"
    )
    reject_features: list[Annotated[int, Field(ge=0, lt=2**20)]] = Field(
        default_factory=list, description="reject rows on which one of these features fires"
    )

    @model_validator(mode="after")
    def _features_exist(self) -> SAEConfig:
        check_order("k", self.k, "features", self.features)
        if bad := [f for f in self.reject_features if f >= self.features]:
            raise PairError(
                f"reject_features {bad} are not below features ({self.features})", "reject_features", "features"
            )
        return self


class ClusteringConfig(Strict):
    """Hierarchical k-means over the embeddings, cluster names, the human review table (assets.cluster)."""

    levels: list[Annotated[int, Field(ge=1, le=2**24)]] = Field(
        default_factory=lambda: [8, 32, 128],
        min_length=1,
        description="clusters per level, coarse to fine; the last is the leaf level",
    )
    niter: int = Field(25, ge=1, le=10000)
    kmeans_tol: float = Field(
        1e-4,
        ge=0,
        le=0.1,
        description="k-means stops once the objective changes by less than this share between two iterations (FAISS early_stop_threshold; "
        "0: only at a fixed point). 1e-4 halves the time at 20k x 768, k=128 for a 2e-6 change in mean cosine (docs/curation-models.md)",
    )
    seed: Seed = 0
    threads: int = Field(1, ge=1, le=MAX_THREADS, description="FAISS threads (1 keeps float sums in one order)")
    review_level: int = Field(0, ge=0, le=64, description="index into levels of the clusters people review")
    flag: Literal["all", "outliers"] = Field(
        "outliers", description="which review-level clusters enter the review table"
    )
    flag_min_size: int = Field(5, ge=0, le=MAX_ROWS, description="outliers: clusters smaller than this are flagged")
    flag_max_cohesion: float = Field(
        0.5,
        ge=-1,
        le=1,
        description="outliers: clusters whose mean cosine to their centroid is below this are flagged (-1: none)",
    )
    name_n: int = Field(5, ge=1, le=1000, description="samples nearest the centroid the namer reads")
    namer: Literal["captions", "vlm"] = Field(
        "captions", description="captions: the configured captioner's captions; vlm: namer_vlm_path asked namer_prompt"
    )
    namer_vlm_path: str | None = Field(None, description="namer=vlm: image-text-to-text model + processor folder")
    namer_prompt: str = Field(
        "Name what this image shows in a few words.",
        description="namer=vlm: asked of each of the name_n nearest images",
    )
    review_db: str = Field("data/review.duckdb", description="DuckDB file holding the review table")
    semdedup_threshold: float = Field(
        0.97, gt=0, le=1, description="cosine at or above which two rows of one leaf cluster are duplicates"
    )

    @model_validator(mode="after")
    def _review_level_exists(self) -> ClusteringConfig:
        if self.review_level >= len(self.levels):
            raise PairError(
                f"review_level ({self.review_level}) is not an index into levels {self.levels}",
                "review_level",
                "levels",
            )
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

    writer: Literal["llm", "rules"] | None = Field(
        None, description="an LLM by path, or templates (a stand-in); None: as data.rewrite.rewriter"
    )
    llm_path: str | None = Field(
        None, description="causal LM + tokenizer folder (writer=llm); None: data.rewrite.llm_path"
    )
    styles: dict[UserPromptStyle, Annotated[float, Field(ge=0, le=1)]] = Field(
        default_factory=lambda: {"terse": 0.4, "conversational": 0.3, "instruction": 0.3},
        description="each row's style is drawn with these weights",
    )
    thinking: bool = Field(
        False, description="also write a thinking trace (what the request fixes and what it leaves open)"
    )
    batch_size: int = Field(8, ge=1, le=MAX_BATCH)
    max_new_tokens: int = Field(48, ge=1, le=MAX_TOKENS)
    do_sample: bool = Field(
        True, description="sample (temperature, top_p) rather than greedy: user prompts should vary"
    )
    temperature: float = Field(0.8, gt=0, le=10)
    top_p: float = Field(0.95, gt=0, le=1)
    richness_weight: float = Field(
        1.0, ge=0, le=100, description="sampling weight x (1 + this x richness): oversample visually rich captions"
    )
    richness_cap: int = Field(12, ge=1, le=10000, description="content words of a target at which richness reaches 1")
    photo_bias: float = Field(0.2, ge=0, le=100, description="sampling weight x (1 + this) for photographic targets")
    per_pair: int = Field(
        1,
        ge=1,
        le=8,
        description="user prompts written per pair, each its own drop of the caption's details and its own style; the SFT trains on every one",
    )
    variant_drop: float = Field(
        0.5,
        ge=0,
        le=1,
        description="per_pair > 1: chance of dropping each detail of the caption in the extra prompts (as data.rewrite.pair_drop)",
    )
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
    stand_ins: list[Literal["scene_metadata_captioner", "classical_embedder", "rules_labeller", "rules_rewriter"]] = (
        Field(
            default_factory=list,
            description="offline stand-ins this profile uses in place of models, named on purpose (kiln.config.STAND_INS)",
        )
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
