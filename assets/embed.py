"""The embed stage: DEDUPED -> EMBEDDED, one L2-normalised float16 vector per kept image, by the image
encoder `data.embed` names (model.image_encoders: the demo's hand-made descriptor, or an HF model by path).

Rows whose bytes cannot be read or decoded are rejected with `embed_error`, never dropped.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from kiln.config import KilnConfig
from kiln.imageio import open_rgb
from kiln.reasons import Reason
from kiln.schemas import DEDUPED, EMBEDDED
from kiln.stage import Rejects, Stage, StageOutput, StageResources
from kiln.uri import read_bytes
from model.image_encoders import Embedder, l2_normalise, make_embedder


# ---------------------------------------------------------------------------------------- columns
def to_column(vectors: np.ndarray) -> pa.Array:
    """(n, d) float -> binary column of little-endian float16 rows."""
    v = np.ascontiguousarray(vectors, dtype="<f2")
    return pa.array([row.tobytes() for row in v], pa.binary())


def matrix(table: pa.Table, column: str = "embedding") -> np.ndarray:
    """The embedding column back as (n, d) float32, re-normalised after the float16 round trip."""
    values = table.column(column).to_pylist()
    if not values:
        return np.zeros((0, 0), np.float32)
    return l2_normalise(np.frombuffer(b"".join(values), "<f2").reshape(len(values), -1))


# ------------------------------------------------------------------------------------------ stage
def embed_rows(table: pa.Table, embedder: Embedder, max_pixels: int, stage: str = "embed") -> StageOutput:
    """Pure core of the stage: decode each row once, embed the decodable ones, reject the others."""
    rejects = Rejects(stage)
    keep, images = [], []
    for i, (id_, uri) in enumerate(zip(table.column("id").to_pylist(), table.column("uri").to_pylist())):
        try:
            images.append(open_rgb(read_bytes(uri), max_pixels))
            keep.append(i)
        except Exception as e:  # noqa: BLE001 - any failure to read is a reason, not a crash
            rejects.add(id_, uri, Reason.EMBED_ERROR, None, f"{type(e).__name__}: {e}"[:200])
    vectors = embedder.embed(images)
    kept = table.take(pa.array(keep, pa.int64()))
    kept = kept.append_column(
        pa.field("embedding", pa.binary(), nullable=False), to_column(vectors) if keep else pa.array([], pa.binary())
    )
    kept = kept.append_column(
        pa.field("embedder", pa.string(), nullable=False), pa.array([embedder.name] * len(keep), pa.string())
    )
    return StageOutput(kept, rejects.table())


def embed_stage(table: pa.Table, cfg: KilnConfig) -> StageOutput:
    return embed_rows(table, make_embedder(cfg.data.embed), cfg.data.filters.max_pixels)


STAGE = Stage(
    "embed", embed_stage, input_schema=DEDUPED, output_schema=EMBEDDED, scope="shard",
    resources=StageResources(cpus=2), setup=lambda cfg: make_embedder(cfg.data.embed),
)  # fmt: skip
