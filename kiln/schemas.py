"""The Arrow schemas of every dataset, in one place.

Each row type is a pydantic model (documentation, and validation of single rows at the edges);
`arrow_schema` maps it to the Arrow schema that Parquet shards are checked against at every stage
boundary. Columns a stage adds are declared here too, so a later stage can rely on them.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, get_args, get_origin

import pyarrow as pa
from pydantic import BaseModel


@dataclass(frozen=True)
class Arrow:
    """Pins the Arrow type of a field where the Python type alone is ambiguous."""

    type: pa.DataType


_DEFAULT = {int: pa.int64(), float: pa.float64(), str: pa.string(), bytes: pa.binary(), bool: pa.bool_()}


def _arrow_type(annotation: Any) -> tuple[pa.DataType, bool]:
    nullable = False
    if get_origin(annotation) is Annotated:
        base, *extra = get_args(annotation)
        pinned = next((e.type for e in extra if isinstance(e, Arrow)), None)
        t, nullable = _arrow_type(base)
        return (pinned or t), nullable
    if get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        t, _ = _arrow_type(args[0])
        return t, True
    if annotation in _DEFAULT:
        return _DEFAULT[annotation], nullable
    raise TypeError(f"no Arrow type for {annotation!r}")


def arrow_schema(*models: type[BaseModel]) -> pa.Schema:
    """The Arrow schema of one or more row models, fields in declaration order."""
    fields: list[pa.Field] = []
    for model in models:
        for name, info in model.model_fields.items():
            ann = info.annotation if not info.metadata else Annotated[(info.annotation, *info.metadata)]
            t, nullable = _arrow_type(ann)
            fields.append(pa.field(name, t, nullable=nullable))
    return pa.schema(fields)


I32 = Annotated[int, Arrow(pa.int32())]
F32 = Annotated[float, Arrow(pa.float32())]


class ManifestRow(BaseModel):
    """One raw file, as ingest finds it (no full decode yet)."""

    id: str  # sha1 of the uri, 16 hex chars: stable across runs and machines
    uri: str  # as given to ingest, relative paths kept relative so manifests reproduce on any clone
    bytes: int
    md5: str
    format: str | None  # PIL's format name from the header (JPEG, PNG, ...), None when unidentified
    width: I32
    height: I32
    mode: str
    exif_orientation: Annotated[int, Arrow(pa.int8())]  # 1 = upright; 0 = no EXIF tag
    n_frames: I32
    # what the source said about the file (assets.source): an existing caption (alt text, a WebDataset
    # .txt, a Parquet list's caption column), a licence, a source name, and any other column as JSON
    source_caption: str | None = None
    license: str | None = None
    source_name: str | None = None
    source_meta: str | None = None


class StatsRow(BaseModel):
    """What the single decode of the filter stage measures."""

    aspect: F32  # max(w, h) / min(w, h) after EXIF rotation
    laplacian_var: F32
    entropy: F32
    white_ratio: F32
    black_ratio: F32
    border_share: F32
    flat_share: F32
    phash: Annotated[bytes, Arrow(pa.binary(18))]  # 12x12 DCT perceptual hash, 144 bits
    colorhash: Annotated[bytes, Arrow(pa.binary(8))]  # 64-bit hue / saturation histogram hash


class DedupRow(BaseModel):
    dup_group: str  # id of the group's keeper; a singleton's own id


class EmbeddingRow(BaseModel):
    """One image's embedding: little-endian float16 bytes (dim = len / 2), L2-normalised."""

    embedding: bytes
    embedder: str  # which embedder wrote it, honestly named (e.g. "classical:..." is not a learned model)


class ClusterRow(BaseModel):
    """Where hierarchical k-means put a row: one label per level, coarse to fine."""

    cluster_path: str  # "c0.c1.leaf", the label of each level joined by dots
    leaf: I32  # leaf cluster label (the finest level)
    leaf_cosine: F32  # cosine to the leaf centroid


class CaptionRow(BaseModel):
    caption: str
    caption_source: str  # which captioner wrote it, honestly named


class OCRRow(BaseModel):
    """What the OCR stage reads (assets.ocr); boxes in source pixels of the upright image."""

    ocr_text: str  # lines in reading order joined by newlines; "" when none
    ocr_boxes: str  # JSON [[x0, y0, x1, y1, text, confidence], ...]
    ocr_engine: str
    contains_text: bool
    text_area_share: F32  # union of the boxes over the image area
    text_density: F32  # characters per 100x100 px of image
    text_complexity: F32  # log2(1 + characters) + (lines - 1); 0 without text
    min_text_height: F32  # px (source) of the shortest line; 0 without text


class CaptionDecodingRow(BaseModel):
    caption_decoding: str  # JSON: model, prompt template, generate() settings (or the lookup it came from)


class RewriteRow(BaseModel):
    """Every caption form, stored on every row (assets.rewrite); training samples among them."""

    caption_short: str
    caption_medium: str
    caption_long: str
    caption_tags: str  # comma-separated
    caption_json: str  # a JSON object
    rewrite_source: str
    rewrite_decoding: str  # JSON


class PromptPairRow(BaseModel):
    """A short synthetic user prompt and the long caption it should expand to (assets.prompt_pairs)."""

    id: str
    prompt: str
    target: str
    dropped: str  # JSON list of the details the prompt left out


class UserPromptRow(BaseModel):
    """A synthetic user prompt in a style, over a prompt pair, with its SFT sampling weight (assets.user_prompts)."""

    id: str
    prompt: str  # what a user would type: the pair's prompt rewritten in `style`
    style: str  # terse, conversational, instruction
    pair_prompt: str  # the rule-made prompt of the pair it was written from
    target: str  # the long caption the expander should produce
    dropped: str  # JSON list of the details the pair's prompt left out
    writer: str  # who wrote `prompt`: rules:templates (a stand-in) or llm:<model type>
    decoding: str  # JSON: model, instruction, generate() settings, seed of this row
    thinking: str | None  # an optional trace: what the request fixes and what the caption adds
    sampling_weight: float  # distribution shaping: richness and photographic bias (data.user_prompts)
    prompts: str  # JSON list of every user prompt written for this pair ({prompt, style, pair_prompt, dropped, decoding}; data.user_prompts.per_pair); the first is `prompt`


class ConceptCountRow(BaseModel):
    """Coverage of one concept (assets.concepts): rows whose captions mention it, before and after weighting."""

    concept: str
    rank: int
    rows: int
    share: float  # rows / pool rows
    weighted_share: float  # share of the sampling weight mass


class ConceptWeightRow(BaseModel):
    id: str
    concepts: str  # JSON list of the concepts the row's captions mention, by rank
    sampling_weight: float  # mean 1 over the pool; raised for rows of rare concepts


class MixRow(BaseModel):
    """One row of a dataset mix (assets.mixes): which pool row, in which part of the mix, in what order."""

    id: str
    mix: str  # pretrain | midtrain | sft
    part: str  # the group (pretrain) or configured part (midtrain) it counts towards
    sampling_weight: float  # from the concept coverage weights when given, else 1
    order: int  # position in the mix's deterministic order


class TrainRow(BaseModel):
    """One packed training example as kiln.trainshards.train_samples takes it from a table (tests and
    benchmarks build train sets this way): its image encoded at its bucket's size, in pre-shuffled batch
    order, with every caption form the loader may draw from and the weight it samples the row by."""

    id: str
    caption: str  # the long caption (evaluation and sampling read it)
    caption_forms: str  # JSON object form -> text, keys from short, medium, long, tags, json; sorted keys
    sampling_weight: float  # expected appearances per epoch (assets.concepts weights; 1 without them)
    bucket: str  # "HxW"
    height: I32
    width: I32
    image: bytes  # encoded (data.pack.image_format)
    latent: bytes | None  # the image's autoencoder latent as .npy (data.pack.latents_from), else null
    crop_left: I32  # where the bucket was cut from the resized image
    crop_top: I32
    batch: I32  # every row of a batch shares one bucket
    order: int  # global position in the pre-shuffled stream


class PackedRow(BaseModel):
    """The pack stage's plan for one row: where its image comes from, its bucket and crop, its place in the
    pre-shuffled stream, and what training samples from. No pixels: the stage's writer encodes them into the
    train set's shards (kiln.trainshards), a packed batch at a time."""

    id: str
    uri: str
    caption: str
    caption_forms: str
    sampling_weight: float
    bucket: str
    height: I32
    width: I32
    crop_left: I32
    crop_top: I32
    batch: I32
    order: int


class RejectRow(BaseModel):
    id: str
    uri: str
    stage: str
    reason: str
    value: float | None  # the measured value that failed its threshold, where there is one
    detail: str


MANIFEST = arrow_schema(ManifestRow)
FILTERED = arrow_schema(ManifestRow, StatsRow)
DEDUPED = arrow_schema(ManifestRow, StatsRow, DedupRow)
EMBEDDED = arrow_schema(ManifestRow, StatsRow, DedupRow, EmbeddingRow)
CLUSTERED = arrow_schema(ManifestRow, StatsRow, DedupRow, EmbeddingRow, ClusterRow)
CAPTIONED = arrow_schema(ManifestRow, StatsRow, DedupRow, CaptionRow)
OCRED = arrow_schema(ManifestRow, StatsRow, DedupRow, OCRRow)
OCR_CAPTIONED = arrow_schema(ManifestRow, StatsRow, DedupRow, OCRRow, CaptionRow, CaptionDecodingRow)
REWRITTEN = arrow_schema(ManifestRow, StatsRow, DedupRow, OCRRow, CaptionRow, CaptionDecodingRow, RewriteRow)
PROMPT_PAIRS = arrow_schema(PromptPairRow)
USER_PROMPTS = arrow_schema(UserPromptRow)
CONCEPT_COUNTS = arrow_schema(ConceptCountRow)
CONCEPT_WEIGHTS = arrow_schema(ConceptWeightRow)
MIX = arrow_schema(MixRow)
TRAIN = arrow_schema(TrainRow)
PACKED = arrow_schema(PackedRow)
TRAIN_META = pa.schema([f for f in PACKED if f.name != "uri"])  # a train set's rows as its shards' metadata holds them
REJECTED = arrow_schema(RejectRow)


class SchemaError(ValueError):
    pass


def check_schema(table: pa.Table, schema: pa.Schema, where: str) -> pa.Table:
    """Fail with the missing / mistyped columns named; return the table cast to the exact schema."""
    problems = []
    for f in schema:
        if f.name not in table.column_names:
            problems.append(f"missing column {f.name!r}")
        elif not table.schema.field(f.name).type.equals(f.type):
            problems.append(f"column {f.name!r} is {table.schema.field(f.name).type}, expected {f.type}")
    extra = [c for c in table.column_names if c not in schema.names]
    if extra:
        problems.append(f"unexpected columns {extra}")
    if problems:
        raise SchemaError(f"{where}: " + "; ".join(problems))
    for f in schema:
        if not f.nullable and table.column(f.name).null_count:
            raise SchemaError(f"{where}: column {f.name!r} has nulls")
    return table.select(schema.names).cast(schema)
