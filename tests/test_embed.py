"""Embeddings: an honest offline descriptor by default, any HF vision model by local path, float16 shards."""

import numpy as np
import pyarrow as pa
import pytest
import torch

from assets.embed import embed_rows, matrix, to_column
from components.demo_scenes import Background, Scene, Shape, render
from kiln.config import EmbedConfig, load_config
from kiln.imageio import open_rgb
from kiln.reasons import Reason
from kiln.schemas import EMBEDDED
from kiln.stage import check_accounting, read_dataset, run_stage
from kiln.uri import read_bytes
from model.image_encoders import ClassicalEmbedder, HFEmbedder, make_embedder

torch.set_num_threads(1)


def scene(family, shapes, bg="blue", pattern="plain", seed=1, **kw):
    return render(
        Scene(family, Background(bg, pattern, "white" if pattern != "plain" else None), shapes, layout_seed=seed, **kw),
        96,
        96,
    )


def test_classical_embedder_is_named_honestly_and_normalised():
    e = ClassicalEmbedder()
    assert e.name.startswith("classical:") and "not a learned model" in e.name
    v = e.embed([scene("single_shape", (Shape("red", "circle", "large", "center"),))])
    assert v.shape[0] == 1 and np.isclose(np.linalg.norm(v), 1.0, atol=1e-5)


def test_classical_descriptor_sees_structure_more_than_colour():
    one = scene("single_shape", (Shape("red", "circle", "large", "center"),))
    one_recoloured = scene("single_shape", (Shape("yellow", "circle", "large", "center"),), bg="purple", seed=2)
    three = scene("counted_shapes", (Shape("red", "circle", "small", "center", 3),))
    striped = scene("pattern_background", (Shape("red", "circle", "large", "center"),), pattern="stripes")
    v = ClassicalEmbedder().embed([one, one_recoloured, three, striped])
    sim = v @ v.T
    assert sim[0, 1] > sim[0, 2] and sim[0, 1] > sim[0, 3]


def test_embed_stage_rejects_unreadable_rows_and_round_trips_float16(demo_embedded):
    overrides, root = demo_embedded
    deduped = read_dataset(root / "deduped" / "kept").slice(0, 6)
    broken = deduped.set_column(1, "uri", pa.array(["/nonexistent.png"] + deduped.column("uri").to_pylist()[1:]))
    out = embed_rows(broken, ClassicalEmbedder(), 64_000_000)
    check_accounting("embed", broken, out)
    assert out.rejected.column("reason").to_pylist() == [Reason.EMBED_ERROR]
    assert out.kept.num_rows == 5
    x = matrix(out.kept)
    ref = ClassicalEmbedder().embed([open_rgb(read_bytes(u)) for u in out.kept.column("uri").to_pylist()])
    assert np.abs(x - ref).max() < 2e-3  # float16 storage
    assert len(out.kept.column("embedding")[0].as_py()) == 2 * x.shape[1]


def test_embed_stage_output_has_the_embedded_schema_and_is_deterministic(demo_embedded, tmp_path):
    overrides, root = demo_embedded
    run_stage("embed", root / "deduped", tmp_path / "again", load_config(overrides))
    a, b = read_dataset(root / "embedded" / "kept"), read_dataset(tmp_path / "again" / "kept")
    assert a.schema.equals(EMBEDDED) and a.equals(b)
    assert (root / "embedded/kept/part-00000.parquet").read_bytes() == (
        tmp_path / "again/kept/part-00000.parquet"
    ).read_bytes()


def tiny_models():
    from transformers import (
        BitImageProcessor,
        CLIPImageProcessor,
        CLIPVisionConfig,
        CLIPVisionModel,
        Dinov2Config,
        Dinov2Model,
        Siglip2ImageProcessorPil,
        Siglip2VisionConfig,
        Siglip2VisionModel,
        SiglipImageProcessor,
        SiglipVisionConfig,
        SiglipVisionModel,
    )

    small = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8
    )
    crop = dict(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return {
        "dinov2": (lambda: Dinov2Model(Dinov2Config(**small)), lambda: BitImageProcessor(**crop)),
        "clip": (lambda: CLIPVisionModel(CLIPVisionConfig(**small)), lambda: CLIPImageProcessor(**crop)),
        "siglip": (
            lambda: SiglipVisionModel(SiglipVisionConfig(**small)),
            lambda: SiglipImageProcessor(size={"height": 32, "width": 32}),
        ),
        "siglip2": (  # NaFlex: the aspect kept, at most 16 patches, with the mask and shapes the tower needs
            lambda: Siglip2VisionModel(Siglip2VisionConfig(**{**small, "num_patches": 16}, vision_use_head=True)),
            lambda: Siglip2ImageProcessorPil(patch_size=8, max_num_patches=16),
        ),
    }


@pytest.mark.parametrize("kind", ["dinov2", "clip", "siglip", "siglip2"])
def test_hf_vision_model_loads_by_path_and_embeds_in_batches(kind, tmp_path):
    torch.manual_seed(0)
    model, processor = (f() for f in tiny_models()[kind])
    model.save_pretrained(tmp_path / kind)
    processor.save_pretrained(tmp_path / kind)
    images = [scene("single_shape", (Shape(c, "square", "large", "left"),)) for c in ("red", "green", "blue")]
    embedder = make_embedder(EmbedConfig(embedder="hf", path=str(tmp_path / kind), batch_size=2))
    assert isinstance(embedder, HFEmbedder) and embedder.name.startswith("hf:")
    v = embedder.embed(images)  # batches [red, green] and [blue]
    assert v.shape == (3, 32) and np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-5)
    # batch invariance: each row of the two-image batch is what the model gives that image alone
    alone = np.concatenate([embedder.embed([im]) for im in images])
    assert np.allclose(v, alone, atol=1e-5)
    assert not np.allclose(v[0], v[1], atol=1e-3)  # and the images differ, so the rows could not match by accident


def test_hf_embedder_needs_a_path():
    with pytest.raises(ValueError, match="data.embed.path"):
        make_embedder(EmbedConfig(embedder="hf"))


def test_float16_column_round_trip():
    x = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
    t = pa.table({"embedding": to_column(x)})
    back = matrix(t)
    assert np.allclose(back, x / np.linalg.norm(x, axis=1, keepdims=True), atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_hf_embedder_on_cuda_matches_cpu(tmp_path):
    torch.manual_seed(0)
    model, processor = (f() for f in tiny_models()["siglip"])
    model.save_pretrained(tmp_path / "m")
    processor.save_pretrained(tmp_path / "m")
    images = [scene("single_shape", (Shape(c, "circle", "large", "right"),)) for c in ("red", "blue")]
    cpu = make_embedder(EmbedConfig(embedder="hf", path=str(tmp_path / "m"))).embed(images)
    gpu = make_embedder(EmbedConfig(embedder="hf", path=str(tmp_path / "m"), device="cuda")).embed(images)
    assert np.allclose(cpu, gpu, atol=1e-3)
