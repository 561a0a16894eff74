"""The caption stage: every kept image gets a caption and the honest name of what wrote it.

Captioners share one small interface (`Captioner`), so the stage does not care whether captions come
from ground truth, OCR + a VLM, or an LLM rewrite; `make_captioner` picks one from the config. A row
its captioner cannot describe is rejected with `no_caption`, never passed on with an empty string.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, runtime_checkable

import pyarrow as pa
import pyarrow.parquet as pq

from kiln.config import CaptionConfig, KilnConfig
from kiln.reasons import Reason
from kiln.schemas import CAPTIONED, DEDUPED
from kiln.stage import Rejects, Stage, StageOutput


@runtime_checkable
class Captioner(Protocol):
    name: str  # written to `caption_source`: which captioner, from what

    def caption(self, rows: pa.Table) -> list[str | None]:
        """One caption per row, None where this captioner has nothing to say."""
        ...


def decoding_of(captioner: Captioner) -> str:
    """How a captioner produced its text (model, prompt, generate settings), as the JSON stored next to it."""
    return json.dumps(getattr(captioner, "decoding", {"method": "lookup"}), sort_keys=True)


class SceneMetadataCaptioner:
    """Captions looked up by md5 in a ground-truth sidecar (the demo corpus's truth.parquet).

    Keyed by content, not by uri, so it works whatever prefix, folder or tar shard the files were
    ingested from, and an exact duplicate gets the same caption as its original.
    """

    def __init__(self, truth: Path | str):
        truth = Path(truth)
        if not truth.is_file():
            raise FileNotFoundError(f"caption truth sidecar {truth} does not exist (cfg.data.caption.truth)")
        table = pq.read_table(truth, columns=["md5", "caption"])
        meta = table.schema.metadata or {}
        source = meta.get(b"kiln.source", truth.stem.encode()).decode()
        self.name = f"scene_metadata:{source}"
        self.by_md5: dict[str, str] = {}
        for md5, caption in zip(table.column("md5").to_pylist(), table.column("caption").to_pylist()):
            if caption:
                self.by_md5.setdefault(md5, caption)

    def caption(self, rows: pa.Table) -> list[str | None]:
        return [self.by_md5.get(md5) for md5 in rows.column("md5").to_pylist()]


class SourceCaptioner:
    """The caption the source carried: alt text of a Parquet list, a WebDataset sample's .txt, a .json caption."""

    name = "source_caption"

    def caption(self, rows: pa.Table) -> list[str | None]:
        return rows.column("source_caption").to_pylist()


def make_captioner(cfg: CaptionConfig) -> Captioner:
    if cfg.captioner == "source":
        return SourceCaptioner()
    if cfg.captioner == "scene_metadata":
        return SceneMetadataCaptioner(cfg.truth)
    if cfg.captioner == "vlm":
        from components.vlm import VLMCaptioner

        return VLMCaptioner.from_config(cfg)
    raise ValueError(f"unknown captioner {cfg.captioner!r}")


def caption_rows(
    table: pa.Table, captioner: Captioner, stage: str = "caption", record_decoding: bool = False
) -> StageOutput:
    """Pure core of the stage: add caption + caption_source to rows that got one, reject the others."""
    captions = captioner.caption(table)
    if len(captions) != table.num_rows:
        raise ValueError(f"captioner {captioner.name} returned {len(captions)} captions for {table.num_rows} rows")
    rejects = Rejects(stage)
    keep = []
    for i, (id_, uri, cap) in enumerate(zip(table.column("id").to_pylist(), table.column("uri").to_pylist(), captions)):
        if cap is None or not cap.strip():
            rejects.add(id_, uri, Reason.NO_CAPTION, None, f"{captioner.name} has no caption for this image")
        else:
            keep.append(i)
    kept = table.take(pa.array(keep, pa.int64()))
    columns = [("caption", [captions[i] for i in keep]), ("caption_source", [captioner.name] * len(keep))]
    if record_decoding:  # the caption_ocr stage (assets.captioners) keeps the settings next to each caption
        columns.append(("caption_decoding", [decoding_of(captioner)] * len(keep)))
    for name, values in columns:
        kept = kept.append_column(pa.field(name, pa.string(), nullable=False), pa.array(values, pa.string()))
    return StageOutput(kept, rejects.table())


def caption_stage(table: pa.Table, cfg: KilnConfig) -> StageOutput:
    return caption_rows(table, make_captioner(cfg.data.caption))


STAGE = Stage("caption", caption_stage, input_schema=DEDUPED, output_schema=CAPTIONED, scope="shard")
