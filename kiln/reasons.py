"""Reject reason codes, one vocabulary for every stage, so summaries and ground truth line up."""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    # ingest: the file itself
    EMPTY_FILE = "empty_file"
    NOT_AN_IMAGE = "not_an_image"
    UNREADABLE = "unreadable"  # OS error, missing file, bad tar member
    # filter: decode and measurements
    DECODE_ERROR = "decode_error"  # truncated / corrupt payload
    UNSUPPORTED_FORMAT = "unsupported_format"
    TOO_MANY_PIXELS = "too_many_pixels"  # decompression-bomb guard
    TOO_SMALL = "too_small"
    BAD_ASPECT = "bad_aspect"
    LOW_LAPLACIAN = "low_laplacian"  # flat or blurred
    HIGH_LAPLACIAN = "high_laplacian"  # extreme texture / noise
    LOW_ENTROPY = "low_entropy"
    TOO_WHITE = "too_white"
    TOO_BLACK = "too_black"
    BORDER = "border"  # flat bands at the edges
    # dedup
    EXACT_DUPLICATE = "exact_duplicate"  # detail = keeper id
    NEAR_DUPLICATE = "near_duplicate"  # detail = keeper id, value = pHash distance
    # curation stage 2 (assets.embed / classify / sae / cluster / semdedup)
    EMBED_ERROR = "embed_error"  # the embedder could not read or decode the image
    AI_GENERATED = "ai_generated"  # value = calibrated head probability
    ARTIFACT = "artifact"
    LOW_QUALITY = "low_quality"
    SAE_TAG = "sae_tag"  # value = feature activation, detail = feature:tag
    CLUSTER_REJECTED = "cluster_rejected"  # value = cluster id, detail = level:cluster name (review table)
    SEMANTIC_DUPLICATE = "semantic_duplicate"  # value = cosine to the keeper, detail = keeper id
    # caption / pack
    NO_CAPTION = "no_caption"
    # captions and concepts (assets.ocr / captioners / rewrite / prompt_pairs)
    OCR_ERROR = "ocr_error"  # the OCR engine could not read the image
    TEXT_ILLEGIBLE = "text_illegible"  # value = shortest text line, px at the stage resolution
    CAPTION_LENGTH = "caption_length"  # value = characters, detail = form and allowed range
    NO_PROMPT = "no_prompt"  # nothing left of the caption to make a user prompt from
    PACK_ERROR = "pack_error"
    NOT_IN_MIX = "not_in_mix"  # detail = the mix file: the stage's training set is a mix (midtrain, SFT) and this row is not in it
    # warehouse probe stages (kiln.warehouse.probes): synthetic, for queue tests and benchmarks
    PROBE_REJECT = "probe_reject"
