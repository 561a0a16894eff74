"""The pack stage: rewritten images -> a pre-shuffled training set whose every batch shares one bucket.

Each image is decoded once, assigned the aspect-ratio bucket nearest its own (aspect = width / height),
resized so that it covers the bucket and centre-cropped to it, and encoded again (`data.pack.image_format`,
lossless PNG by default) into the train set's WebDataset shards (kiln.trainshards), which the trainer
streams. Bucket sides are multiples of `side_step`: 8, and whole DiT tokens (the autoencoder's downsample x
model.patch_size: 16 for FLUX.2's VAE), at about `resolution**2` pixels.

The order is fixed here, not in the data loader: rows are shuffled with `cfg.data.pack.seed`, cut
into batches per bucket (a bucket's last batch may be smaller: nothing is dropped), and the batches
shuffled again so buckets interleave. Reading the rows in `order` replays exactly that stream.

With `data.pack.latents_from`, each row also carries the model autoencoder's latent of its fitted image
(assets.pack_latents: the autoencoder is checked on the held-out rows first).

Each row carries what training samples from: every caption form (`caption_forms`, the loader draws one
per sample and epoch) and its concept-coverage `sampling_weight` (`data.pack.weights_file`). The
weights have mean 1 over the pool, so a row the file does not name gets 1, the neutral weight, as in
assets.mixes; a file that names none of the rows is the wrong file and fails the stage.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pac
from PIL import Image

from assets.pack_latents import autoencoder_of, check_autoencoder, encode, latent_info
from kiln.config import KilnConfig
from kiln.imageio import open_rgb
from kiln.progress import log, progress
from kiln.reasons import Reason
from kiln.sampling import FORMS, dump_forms
from kiln.schemas import PACKED, REWRITTEN
from kiln.stage import Rejects, Stage, StageOutput
from kiln.threads import ordered_map
from kiln.trainshards import MANIFEST, Sample, encode_image, encode_latent, holdout_ids, write_train_set
from kiln.uri import read_bytes
from model.autoencoder import token_side

SIDE_STEP = 8


@dataclass(frozen=True, order=True)
class Bucket:
    height: int
    width: int

    @property
    def name(self) -> str:
        return f"{self.height}x{self.width}"

    @property
    def aspect(self) -> float:
        return self.width / self.height


def side_step(cfg: KilnConfig) -> int:
    """What every bucket side is a multiple of: 8, and the DiT's token side in pixels, so a bucket is whole
    tokens in the model's latent space (model.autoencoder.token_side, read from the VAE's config.json)."""
    m = cfg.model
    return math.lcm(SIDE_STEP, token_side(m.autoencoder, m.autoencoder_path, m.patch_size))


def _round_side(x: float, step: int) -> int:
    return max(step, int(math.floor(x / step + 0.5)) * step)


def bucket_for(aspect: float, resolution: int, step: int = SIDE_STEP) -> Bucket:
    """Sides that are multiples of `step` with about resolution**2 pixels; matching the aspect counts double.

    At resolution 32: 1.0 -> 32x32, 2.0 -> 24x48, 0.5 -> 48x24, 1.333 -> 24x32.
    """
    best: tuple[float, int, Bucket] | None = None
    for h in range(step, 4 * resolution + 1, step):
        b = Bucket(h, _round_side(h * aspect, step))
        cost = 2 * abs(math.log(b.aspect / aspect)) + abs(math.log(b.height * b.width / resolution**2))
        if best is None or (cost, h) < best[:2]:
            best = (cost, h, b)
    assert best is not None
    return best[2]


def buckets_for(aspects: list[float], resolution: int, step: int = SIDE_STEP) -> list[Bucket]:
    """The distinct buckets of the configured aspect ratios, narrowest first."""
    return sorted({bucket_for(a, resolution, step) for a in aspects}, key=lambda b: (b.aspect, b.height))


def nearest_bucket(width: int, height: int, buckets: list[Bucket]) -> Bucket:
    """The bucket whose aspect is nearest in log space (so 2:1 and 1:2 are equally far from 1:1)."""
    target = math.log(width / height)
    return min(buckets, key=lambda b: (abs(math.log(b.aspect) - target), b.aspect))


def fit_to_bucket(im: Image.Image, bucket: Bucket) -> Image.Image:
    """Resize so the image just covers the bucket (shorter side fits), then crop the centre."""
    return fit_with_crop(im, bucket)[0]


def fit_with_crop(im: Image.Image, bucket: Bucket) -> tuple[Image.Image, tuple[int, int]]:
    """`fit_to_bucket`, and where the crop's top-left corner lies in the resized image."""
    scale = max(bucket.width / im.width, bucket.height / im.height)
    w, h = (
        max(bucket.width, math.ceil(im.width * scale - 1e-6)),
        max(bucket.height, math.ceil(im.height * scale - 1e-6)),
    )
    im = im.resize((w, h), Image.Resampling.LANCZOS)
    left, top = (w - bucket.width) // 2, (h - bucket.height) // 2
    return im.crop((left, top, left + bucket.width, top + bucket.height)), (left, top)


def batch_plan(bucket_of_row: list[str], batch_size: int, seed: int) -> list[tuple[int, int]]:
    """(row index, batch) in stream order: shuffled rows, batched per bucket, batches shuffled."""
    rng = np.random.default_rng(seed)
    per_bucket: dict[str, list[int]] = {}
    for i in rng.permutation(len(bucket_of_row)).tolist():
        per_bucket.setdefault(bucket_of_row[i], []).append(i)
    batches = [
        rows[k : k + batch_size] for _, rows in sorted(per_bucket.items()) for k in range(0, len(rows), batch_size)
    ]
    return [(i, b) for b, k in enumerate(rng.permutation(len(batches)).tolist()) for i in batches[k]]


def mix_ids(mix_file: str | None) -> set[str] | None:
    """The ids of a dataset mix (assets.mixes writes one Parquet per mix), or None: no mix, every row."""
    if mix_file is None:
        return None
    import pyarrow.parquet as pq

    return set(pq.read_table(mix_file, columns=["id"]).column("id").to_pylist())


def read_weights(weights_file: str | None) -> dict[str, float]:
    """id -> sampling_weight from a concept coverage weights file; empty without one. Refuses weights
    that are negative or not finite: a sampler cannot honour them."""
    if weights_file is None:
        return {}
    import pyarrow.parquet as pq

    t = pq.read_table(weights_file, columns=["id", "sampling_weight"])
    weights = dict(zip(t.column("id").to_pylist(), t.column("sampling_weight").to_pylist()))
    bad = {i: w for i, w in weights.items() if w is None or not (math.isfinite(w) and w >= 0)}
    if bad:
        raise ValueError(f"{weights_file}: sampling weights must be finite and >= 0, got {dict(list(bad.items())[:5])}")
    return weights


def row_weights(ids: list[str], weights: dict[str, float], weights_file: str | None) -> list[float]:
    """Each row's weight; 1.0 for a row the file does not name (logged), and every row 1.0 without a file."""
    if weights_file is None:
        return [1.0] * len(ids)
    named = sum(i in weights for i in ids)
    if ids and not named:
        raise ValueError(
            f"weights file {weights_file} names none of the {len(ids)} rows packed: weights of another pool?"
        )
    if named < len(ids):
        log.warning(
            "pack: %d of %d rows are not in %s and get sampling weight 1", len(ids) - named, len(ids), weights_file
        )
    return [float(weights.get(i, 1.0)) for i in ids]


def caption_forms(table: pa.Table) -> list[str]:
    """Every row's caption forms (the REWRITTEN caption_<form> columns) as one JSON object per row."""
    columns = {f: table.column(f"caption_{f}").to_pylist() for f in FORMS}
    return [dump_forms({f: columns[f][i] for f in FORMS}) for i in range(table.num_rows)]


def fitted_pixels(uri: str, cfg: KilnConfig, buckets: list[Bucket]) -> tuple[Bucket, np.ndarray, tuple[int, int]]:
    """The image at `uri` fitted to its nearest bucket: (bucket, uint8 HxWx3, crop's top-left)."""
    im = open_rgb(read_bytes(uri), max_pixels=cfg.data.filters.max_pixels)
    bucket = nearest_bucket(im.width, im.height, buckets)
    fitted, crop = fit_with_crop(im, bucket)
    return bucket, np.asarray(fitted, dtype=np.uint8), crop


def check_latents_first(table: pa.Table, cfg: KilnConfig, buckets: list[Bucket], in_mix: set[str] | None) -> None:
    """data.pack.latents_from: the autoencoder's PSNR on the held-out rows, before any row is encoded."""
    ids, uris = table.column("id").to_pylist(), table.column("uri").to_pylist()
    held = holdout_ids((i for i in ids if in_mix is None or i in in_mix), cfg.data.pack.psnr_rows)
    images = []
    for id_, uri in zip(ids, uris):
        if id_ in held:
            try:
                images.append(fitted_pixels(uri, cfg, buckets)[1])
            except Exception:  # the main pass records it as this row's reject reason
                continue
    if images:
        check_autoencoder(cfg, images)


def pack_rows(table: pa.Table, cfg: KilnConfig, stage: str = "pack") -> StageOutput:
    """The plan: every row decoded and fitted once (a row that fails is rejected here, with its reason), its
    bucket and crop kept, and the stream order drawn; no pixels are kept (write_pack encodes them), so memory
    is the rows' metadata, not their images."""
    pc = cfg.data.pack
    buckets = buckets_for(pc.aspect_buckets, pc.resolution, side_step(cfg))
    table = table.take(pac.sort_indices(table, [("id", "ascending")]))  # input order must not matter
    rejects = Rejects(stage)
    in_mix = mix_ids(pc.mix_file)
    if pc.latents_from:
        check_latents_first(table, cfg, buckets, in_mix)
    ids, uris = table.column("id").to_pylist(), table.column("uri").to_pylist()
    chosen = []
    for i, id_ in enumerate(ids):
        if in_mix is None or id_ in in_mix:
            chosen.append(i)
        else:
            rejects.add(id_, uris[i], Reason.NOT_IN_MIX, None, str(pc.mix_file))

    def fit(i: int) -> tuple[Bucket, tuple[int, int]] | Exception:
        try:
            bucket, _, crop = fitted_pixels(uris[i], cfg, buckets)
            return bucket, crop
        except Exception as e:  # any failure to turn the file into pixels is this row's reject reason
            return e

    packed: list[tuple[int, Bucket, tuple[int, int]]] = []  # (row index, bucket, crop)
    fits = ordered_map(fit, chosen, cfg.cluster.workers)
    for i, got in zip(chosen, progress(fits, desc="pack: plan", total=len(chosen), unit="img")):
        if isinstance(got, Exception):
            rejects.add(ids[i], uris[i], Reason.PACK_ERROR, None, f"{type(got).__name__}: {got}")
        else:
            packed.append((i, *got))

    plan = batch_plan([b.name for _, b, _ in packed], pc.batch_size, pc.seed)
    captions, forms = table.column("caption").to_pylist(), caption_forms(table)
    weights = row_weights([ids[i] for i, _, _ in packed], read_weights(pc.weights_file), pc.weights_file)
    rows = []
    for order, (k, batch) in enumerate(plan):
        i, bucket, crop = packed[k]
        rows.append(
            {
                "id": ids[i],
                "uri": uris[i],
                "caption": captions[i],
                "caption_forms": forms[i],
                "sampling_weight": weights[k],
                "bucket": bucket.name,
                "height": bucket.height,
                "width": bucket.width,
                "crop_left": crop[0],
                "crop_top": crop[1],
                "batch": batch,
                "order": order,
            }
        )
    return StageOutput(pa.Table.from_pylist(rows, schema=PACKED), rejects.table())


def pack_stage(table: pa.Table, cfg: KilnConfig) -> StageOutput:
    return pack_rows(table, cfg)


def packed_samples(kept: pa.Table, cfg: KilnConfig, held: dict[str, tuple[bytes, bytes]]) -> Iterator[Sample]:
    """The planned rows as Samples in stream order: each image read, fitted and encoded again (the plan kept
    no pixels), a packed batch at a time in `cluster.workers` threads, and, with latents, one autoencoder
    forward per packed batch (one bucket). The held-out rows' (image, latent) land in `held`."""
    pc = cfg.data.pack
    buckets = buckets_for(pc.aspect_buckets, pc.resolution, side_step(cfg))
    by_name = {b.name: b for b in buckets}

    def batch_of(rows: list[dict]) -> list[Sample]:
        arrays = [fitted_pixels(r["uri"], cfg, [by_name[r["bucket"]]])[1] for r in rows]  # the planned bucket
        latents = [None] * len(rows)
        if pc.latents_from:
            latents = [encode_latent(z, pc.latent_dtype) for z in encode(autoencoder_of(cfg), arrays, pc.encode_batch)]
        return [
            Sample(
                r["id"], r["caption"], r["caption_forms"], r["sampling_weight"], r["bucket"], r["height"], r["width"],
                encode_image(a, pc.image_format, pc.jpeg_quality), r["batch"], (r["crop_left"], r["crop_top"]), z,
            )
            for r, a, z in zip(rows, arrays, latents, strict=True)
        ]  # fmt: skip

    batches = packed_batches(kept.sort_by([("order", "ascending")]))
    done = ordered_map(batch_of, batches, cfg.cluster.workers)
    for samples in progress(done, desc="pack: write", unit="batch"):
        for s in samples:
            if s.id in held:
                held[s.id] = (s.image, s.latent or b"")
            yield s


def packed_batches(kept: pa.Table) -> Iterator[list[dict]]:
    """The plan's rows, a packed batch at a time (they are contiguous in stream order)."""
    run: list[dict] = []
    for chunk in kept.to_batches(max_chunksize=1024):
        for r in chunk.to_pylist():
            if run and r["batch"] != run[-1]["batch"]:
                yield run
                run = []
            run.append(r)
    if run:
        yield run


def write_pack(kept: pa.Table, out: Path, cfg: KilnConfig) -> None:
    """The plan's rows, in stream order, as the train set's shards and manifest (kiln.trainshards); streams:
    memory is a window of packed batches, whatever the number of rows."""
    pc = cfg.data.pack
    held = dict.fromkeys(holdout_ids(kept.column("id").to_pylist(), pc.psnr_rows) if pc.latents_from else ())
    manifest = write_train_set(packed_samples(kept, cfg, held), out, pc.image_format, int(pc.shard_mb * 1e6))
    if pc.latents_from:  # the PSNR of what the shards hold, measured as they were written
        info = latent_info(cfg, [v for v in held.values() if v is not None])
        (out / MANIFEST).write_text(dataclasses.replace(manifest, latents=info).to_json())


STAGE = Stage("pack", pack_stage, input_schema=REWRITTEN, output_schema=PACKED, scope="global", write_kept=write_pack)
