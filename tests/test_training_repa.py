"""REPA / iREPA: the term is -mean cos(teacher patch feature, projected block token), the teacher is a
frozen HF vision model loaded by path (or `classical`, the hand-made descriptor), and the gradient reaches
the projector (and the DiT), not the teacher."""

import pytest
import torch

from kiln.config import RepaConfig
from training.core.repa import ClassicalTeacher, Projector, Repa, repa_active, repa_loss, teacher_targets


def test_the_loss_is_minus_the_mean_token_cosine():
    g = torch.Generator().manual_seed(0)
    h, y = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    manual = -sum(float(h[b, n] @ y[b, n] / (h[b, n].norm() * y[b, n].norm())) for b in range(2) for n in range(5)) / 10
    assert float(repa_loss(h, y)) == pytest.approx(manual, abs=1e-6)
    assert float(repa_loss(y * 3, y)) == pytest.approx(-1.0, abs=1e-6)  # aligned: the minimum, scale-free


def test_irepa_normalises_teacher_features_over_positions():
    feats = torch.randn(2, 4, 6, 6) + 5.0
    y = teacher_targets(feats, (3, 3), spatial_norm=True)
    assert y.shape == (2, 9, 4)
    torch.testing.assert_close(y.mean(dim=1), torch.zeros(2, 4), atol=1e-5, rtol=0)
    assert teacher_targets(feats, (3, 3), spatial_norm=False).mean() > 4


@pytest.mark.parametrize("kind, teacher", [("mlp", "vit"), ("conv", "vit"), ("mlp", "classical")])
def test_gradients_reach_the_projector_and_the_dit_but_not_the_teacher(
    text_encoder_dir, vit_teacher_dir, kind, teacher
):
    from model.generator import Generator
    from model.testing import micro_model_config
    from model.text_encoder import TextBatch

    torch.manual_seed(0)
    gen = Generator.build(micro_model_config(text_encoder_dir))
    path = str(vit_teacher_dir) if teacher == "vit" else "classical"
    repa = Repa(gen, RepaConfig(teacher_path=path, block=0, projector=kind, hidden=16))
    x = torch.rand(2, 3, 16, 16) * 2 - 1
    text = TextBatch(torch.randn(2, 3, 16, 32), torch.ones(2, 16, dtype=torch.bool))
    gen(x, torch.full((2,), 0.5), text)
    loss = repa.loss(x, (16, 16))
    assert -1.0 <= float(loss.detach()) <= 1.0
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in repa.projector.parameters())
    assert gen.dit.patch_embed.weight.grad.abs().sum() > 0
    assert all(p.grad is None and not p.requires_grad for p in repa.teacher.parameters())
    assert not any(n.startswith("teacher") for n, _ in repa.named_parameters())


def test_repa_is_on_for_the_configured_steps_only():
    cfg = RepaConfig(teacher_path="/some/model", steps=10)
    assert repa_active(cfg, 0) and repa_active(cfg, 9) and not repa_active(cfg, 10)
    assert not repa_active(RepaConfig(), 0)
    assert repa_active(RepaConfig(teacher_path="/m", steps=0), 10**6)


def test_conv_projector_sees_spatial_neighbours():
    p = Projector(4, 3, 8, "conv")
    tokens = torch.zeros(1, 9, 4)
    tokens[0, 4] = 1.0  # the centre of a 3x3 grid
    out = p(tokens, (3, 3)) - p(torch.zeros(1, 9, 4), (3, 3))
    assert (out.abs().sum(-1) > 0).all()  # every position's projection depends on the centre token


def _renders(*shapes: str) -> torch.Tensor:
    import numpy as np

    from components.demo_scenes import Background, Scene, Shape, render
    from model.autoencoder import from_uint8_nhwc

    scenes = [Scene("single_shape", Background("blue"), (Shape("red", s, "large", "center"),)) for s in shapes]
    return from_uint8_nhwc(np.stack([np.asarray(render(sc, 32, 32)) for sc in scenes]))


def test_the_classical_teacher_gives_every_token_its_images_descriptor_standardised_over_the_batch():
    teacher = ClassicalTeacher()
    images = _renders("circle", "square", "triangle", "diamond")
    y = teacher_targets(teacher(images), (8, 8), spatial_norm=False)
    assert y.shape == (4, 64, teacher.dim)
    torch.testing.assert_close(y, y[:, :1].expand_as(y))  # one vector per image, on every token
    torch.testing.assert_close(
        y.mean(0), torch.zeros(64, teacher.dim), atol=1e-5, rtol=0
    )  # what differs between images
    cos = torch.nn.functional.cosine_similarity(y[:, 0, None], y[None, :, 0], dim=-1)
    assert (cos - torch.eye(4)).abs().max() < 0.9  # four shapes, four directions
    assert teacher(images[:1]).abs().max() == 0  # a batch of one has nothing to compare


def test_the_classical_teacher_refuses_irepas_normalisation_over_positions(text_encoder_dir):
    from model.generator import Generator
    from model.testing import micro_model_config

    gen = Generator.build(micro_model_config(text_encoder_dir))
    with pytest.raises(ValueError, match="projector=mlp"):
        Repa(gen, RepaConfig(teacher_path="classical", projector="conv"))


def test_a_repa_teacher_folder_that_is_not_there_stops_the_config_before_any_work(tmp_path):
    from kiln.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="train.repa.teacher_path: the REPA teacher's model folder .* does not exist"):
        load_config([f"train.repa.teacher_path={tmp_path / 'dinov2'}"])
    assert load_config(["train.repa.teacher_path=classical"]).train.repa.teacher_path == "classical"
