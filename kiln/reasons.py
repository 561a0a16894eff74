"""Reject reason codes, one vocabulary for every stage, so summaries and ground truth line up."""

from __future__ import annotations

import re
from enum import StrEnum


class Reason(StrEnum):
    # ingest: the file itself
    EMPTY_FILE = "empty_file"
    NOT_AN_IMAGE = "not_an_image"
    UNREADABLE = "unreadable"  # OS error, missing file, bad tar member or shard, a folder that cannot be listed
    NOT_A_FILE = "not_a_file"  # a FIFO, socket, device or folder where a file was listed: never opened, so never a hang
    TOO_LARGE = "too_large"  # value = bytes, over data.ingest.max_bytes
    BAD_URI = "bad_uri"  # a list entry that is no uri (null, not a string, a NUL byte), a file name that is not UTF-8
    OUTSIDE_ROOTS = "outside_roots"  # a uri outside the folder / prefix it was listed from and data.ingest.roots
    SYMLINK = "symlink"  # reached through a symlink under data.ingest.symlinks=refuse, or a symlink loop
    # filter: decode and measurements
    DECODE_ERROR = "decode_error"  # truncated / corrupt payload
    UNSUPPORTED_FORMAT = "unsupported_format"
    TOO_MANY_PIXELS = "too_many_pixels"  # decompression-bomb guard, on the header the file really has
    CHANGED_SINCE_INGEST = "changed_since_ingest"  # the bytes or header no longer match the manifest row
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
    # post-training rubric sets (training.evaluation.rubric.write_rubric_set)
    NO_REQUIREMENTS = "no_requirements"  # the LLM wrote no yes/no question for the prompt: nothing a judge could check
    # warehouse queue (kiln.warehouse): a row that failed every one of its attempts, detail = the last error
    STAGE_ERROR = "stage_error"  # the stage raised on this row alone
    WORKER_CRASH = "worker_crash"  # the worker process died (SIGKILL, segfault, OOM) while it held the row
    TIMEOUT = "timeout"  # the row's batch ran past its lease (cluster.queue_lease_s); value = the lease in seconds
    # warehouse probe stages (kiln.warehouse.probes): synthetic, for queue tests and benchmarks
    PROBE_REJECT = "probe_reject"


_ADDRESS = re.compile(r" (?:object )?at 0x[0-9a-fA-F]+")


def detail_of(e: BaseException) -> str:
    """A reject detail from an exception: its type and message, without memory addresses (`<_io.BytesIO object
    at 0x7f...>`), so the same input gives the same bytes on every run."""
    return _ADDRESS.sub("", f"{type(e).__name__}: {e}")
