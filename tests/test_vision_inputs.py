"""Vision towers get the inputs their own processors define (model.vision): DINOv2's shortest edge and centre
crop with ImageNet statistics, SigLIP's square at mean = std = 0.5, SigLIP-2's NaFlex patches with their mask
and shapes, CLIP's crop with OpenAI's statistics, each checked against transformers' processor on the same
pictures; DINOv3's registers are skipped; a folder without its processor, or not a vision tower, is refused."""

import json

import numpy as np
import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from model.vision import VisionInputs, load_vision_model

VIT = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}


def folder(tmp_path, kind):
    """A tiny random model of `kind` and its processor, saved as a lab's folder is."""
    torch.manual_seed(0)
    if kind == "dinov2":
        model = T.Dinov2Model(T.Dinov2Config(image_size=28, patch_size=7, **VIT))
        proc = T.BitImageProcessorPil(
            size={"shortest_edge": 32}, crop_size={"height": 28, "width": 28}, resample=3,
            image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225],
        )  # fmt: skip
    elif kind == "siglip":
        cfg = T.SiglipConfig(vision_config={"image_size": 32, "patch_size": 8, **VIT}, text_config=VIT)
        model, proc = T.SiglipModel(cfg), T.SiglipImageProcessorPil(size={"height": 32, "width": 32})
    elif kind == "siglip2":
        cfg = T.Siglip2Config(vision_config={"patch_size": 4, "num_patches": 16, **VIT}, text_config=VIT)
        model, proc = T.Siglip2Model(cfg), T.Siglip2ImageProcessorPil(patch_size=4, max_num_patches=16)
    elif kind == "clip":
        cfg = T.CLIPConfig(vision_config={"image_size": 24, "patch_size": 8, **VIT}, text_config=VIT)
        model = T.CLIPModel(cfg)
        proc = T.CLIPImageProcessorPil(size={"shortest_edge": 24}, crop_size={"height": 24, "width": 24})
    model.eval().save_pretrained(str(tmp_path))
    proc.save_pretrained(str(tmp_path))
    return tmp_path, proc


def pictures(h, w, n=2, seed=0):
    """Smooth pictures (a processor's 8-bit rounding and its resampling kernel then differ by little)."""
    rng = np.random.default_rng(seed)
    low = rng.integers(0, 256, (n, 4, 4, 3)).astype(np.float32)
    up = torch.nn.functional.interpolate(torch.as_tensor(low).permute(0, 3, 1, 2), size=(h, w), mode="bilinear")
    return up.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


@pytest.mark.parametrize(
    "kind, hw", [("dinov2", (40, 56)), ("siglip", (40, 56)), ("siglip2", (20, 36)), ("clip", (48, 32))]
)
def test_the_inputs_are_the_processors_own(tmp_path, kind, hw):
    path, proc = folder(tmp_path, kind)
    imgs = pictures(*hw)
    ours = VisionInputs.from_folder(path).prepare(torch.as_tensor(imgs).permute(0, 3, 1, 2) / 255)
    theirs = proc(images=list(imgs), return_tensors="pt")
    assert set(ours) == {k for k in theirs if k in ("pixel_values", "pixel_attention_mask", "spatial_shapes")}
    assert ours["pixel_values"].shape == theirs["pixel_values"].shape
    std = float(np.mean(proc.image_std))
    assert (ours["pixel_values"] - theirs["pixel_values"]).abs().mean() * std < 2 / 255  # under 2 levels of 8 bits
    for key in ("pixel_attention_mask", "spatial_shapes"):
        if key in theirs:
            assert torch.equal(ours[key].long(), theirs[key].long()), key
    _, tower, inputs = load_vision_model(path)
    hidden = tower(**ours).last_hidden_state  # the tower runs on them, and the grid is its patches
    gh, gw = inputs.grid(ours)
    assert inputs.patch_tokens(hidden, ours).shape == (2, 32, gh, gw)


def test_dinov3s_register_tokens_are_not_patch_features(tmp_path):
    torch.manual_seed(0)
    T.DINOv3ViTModel(T.DINOv3ViTConfig(image_size=16, patch_size=8, num_register_tokens=4, **VIT)).save_pretrained(
        tmp_path
    )
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "DINOv3ViTImageProcessorFast", "size": {"height": 16, "width": 16}, "resample": 2,
        "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225],
    }))  # fmt: skip  # the torchvision-only processor's config, as the hub ships it
    _, tower, inputs = load_vision_model(tmp_path)
    assert inputs.prefix_tokens == 5 and inputs.mode == "square"
    x = inputs.prepare(torch.rand(1, 3, 16, 16))
    hidden = tower(**x).last_hidden_state
    assert hidden.shape[1] == 1 + 4 + 4  # CLS, 4 registers, a 2x2 grid
    torch.testing.assert_close(inputs.patch_tokens(hidden, x).flatten(2).transpose(1, 2), hidden[:, 5:])


def test_a_folder_without_its_processor_or_its_weights_or_of_another_kind_is_refused(tmp_path):
    path, _ = folder(tmp_path / "dino", "dinov2")
    (path / "preprocessor_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no preprocessor_config.json"):
        load_vision_model(path)
    path, _ = folder(tmp_path / "dino2", "dinov2")
    weights = load_file(str(path / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if "layernorm" not in k}, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="weights of Dinov2Model are not in the folder"):
        load_vision_model(path)  # transformers alone would run it with a random final norm
    T.BertModel(T.BertConfig(**VIT)).save_pretrained(tmp_path / "bert")
    (tmp_path / "bert" / "preprocessor_config.json").write_text("{}")
    with pytest.raises(ValueError, match="model_type 'bert' is not a vision tower"):
        load_vision_model(tmp_path / "bert")
