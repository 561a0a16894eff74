"""Turning stage outputs into Dagster metadata a person wants: counts, rejects by reason, image grids."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pyarrow.compute as pc

from kiln.stage import Summary, read_dataset
from kiln.trainshards import is_train_set, read_manifest
from kiln.uri import read_bytes
from kiln.viz import image_grid, markdown_image, placeholder_tile


def rejects_table(summary: Summary) -> dg.TableMetadataValue:
    return dg.MetadataValue.table(
        records=[
            dg.TableRecord({"reason": r, "rows": n})
            for r, n in sorted(summary.by_reason.items(), key=lambda kv: -kv[1])
        ],
        schema=dg.TableSchema(columns=[dg.TableColumn("reason", "string"), dg.TableColumn("rows", "int")]),
    )


def tile(uri: str, cell: int = 72):
    """The image behind a uri; a crossed-out placeholder when it cannot be read or decoded (a decode_error
    reject still gets its tile), a blank cell for "" (padding)."""
    from PIL import Image

    from kiln.imageio import open_rgb

    if not uri:
        return Image.new("RGB", (cell, cell), (255, 255, 255))
    try:
        return open_rgb(read_bytes(uri))
    except Exception:  # noqa: BLE001 - a thumbnail is best effort; the stage already recorded why
        return placeholder_tile(cell)


def thumbnails(uris: list[str], labels: list[str] | None = None, cols: int = 8, cell: int = 72) -> str | None:
    """A markdown grid of the images behind some uris, one tile each (placeholders for unreadable files)."""
    if not uris:
        return None
    ims = [tile(u, cell) for u in uris]
    return markdown_image(image_grid(ims, cols=min(cols, len(ims)), cell=cell, labels=labels), "sample")


def rejects_grid(rejected, per_reason: int = 6) -> str | None:
    """One row of tiles per reject reason (its first `per_reason` rows, each labelled with the reason), so every
    reason shows, undecodable files as placeholders; every reject gets a tile when there are few."""
    if not rejected.num_rows:
        return None
    uris, labels = [], []
    for reason in sorted(set(rejected.column("reason").to_pylist())):
        rows = (
            rejected.filter(pc.equal(rejected.column("reason"), reason)).slice(0, per_reason).column("uri").to_pylist()
        )
        uris += rows + [""] * (per_reason - len(rows))
        labels += [reason] * len(rows) + [""] * (per_reason - len(rows))
    return thumbnails(uris, labels, cols=per_reason)


def stage_metadata(summary: Summary, output: Path, n_samples: int = 16) -> dict:
    md: dict = {
        "input_rows": summary.input_rows,
        "kept": summary.kept,
        "rejected": summary.rejected,
        "rejects_by_reason": rejects_table(summary),
        "path": dg.MetadataValue.path(str(output)),
    }
    if is_train_set(output):  # the pack stage: shards, not kept Parquet
        md |= train_set_metadata(output)
    else:
        kept = read_dataset(output / "kept")
        if kept.num_rows and "uri" in kept.column_names:
            grid = thumbnails(kept.column("uri").to_pylist()[:n_samples])
            if grid:
                md["kept_sample"] = dg.MetadataValue.md(grid)
    if grid := rejects_grid(read_dataset(output / "rejected")):
        md["rejected_sample"] = dg.MetadataValue.md(grid)
    return md


def train_set_metadata(output: Path) -> dict:
    """A train set's shape: its shards (how many, how large), rows per bucket, the codec, its latents."""
    manifest = read_manifest(output)
    return {
        "shards": len(manifest.shards),
        "shard_mb": round(sum(s.bytes for s in manifest.shards) / 1e6, 1),
        "rows_by_bucket": dg.MetadataValue.json(manifest.buckets),
        "image_format": manifest.image_format,
        "weighted": manifest.weighted,
    } | (
        {  # a latent train set: whose latents, and how well that autoencoder reconstructs the held-out rows
            "latents": manifest.latents.autoencoder,
            "latent_psnr_db": manifest.latents.psnr_db,
            "latent_min_psnr_db": manifest.latents.min_psnr_db,
        }
        if manifest.latents
        else {}
    )


def dedup_groups_grid(output: Path, n_groups: int = 6, per_group: int = 4) -> str | None:
    """One row per near-duplicate group: the keeper first, then what was merged into it."""
    kept, rejected = read_dataset(output / "kept"), read_dataset(output / "rejected")
    near = rejected.filter(pc.equal(rejected.column("reason"), "near_duplicate"))
    if not near.num_rows or not kept.num_rows:
        return None
    uri_of = dict(zip(kept.column("id").to_pylist(), kept.column("uri").to_pylist()))
    groups: dict[str, list[str]] = {}
    for keeper, uri in zip(near.column("detail").to_pylist(), near.column("uri").to_pylist()):
        groups.setdefault(keeper, []).append(uri)
    uris, labels = [], []
    for keeper in sorted(groups)[:n_groups]:
        members = [uri_of.get(keeper, "")] + sorted(groups[keeper])[: per_group - 1]
        members += [""] * (per_group - len(members))
        uris += members
        labels += ["keeper"] + ["dup"] * (per_group - 1)
    return thumbnails(uris, labels, cols=per_group)


def cluster_grids(output: Path, max_clusters: int = 8) -> str | None:
    """One grid per top-level cluster (the rows nearest its centroid), each headed by its id and size."""
    import numpy as np

    from assets.cluster import cluster_grid, level_labels
    from kiln.viz import markdown_image

    kept = read_dataset(output / "kept")
    if not kept.num_rows:
        return None
    labels = level_labels(kept, 0)
    parts = []
    for c in sorted(np.unique(labels).tolist())[:max_clusters]:
        parts.append(
            f"**cluster {c}** ({int((labels == c).sum())} rows)\n\n"
            + markdown_image(cluster_grid(kept, 0, c, n=8, cell=48), f"cluster {c}")
        )
    return "\n\n".join(parts)
