"""PMA: the average of the last K checkpoints is a Generator checkpoint of its own."""

import json

import pytest
import torch
from safetensors.torch import load_file

from model.generator import Generator
from training.core.pma import average_checkpoints, last_k


def _checkpoint(gen, folder, step, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in gen.parameters():
            p.normal_()
    gen.save_pretrained(folder)
    (folder / "train_state.json").write_text(json.dumps({"step": step}))
    return folder


def test_the_average_of_the_last_k_checkpoints_loads_as_a_generator(text_encoder_dir, tmp_path):
    from model.testing import micro_model_config

    gen = Generator.build(micro_model_config(text_encoder_dir))
    ckpts = [_checkpoint(gen, tmp_path / f"c{s}", s, s) for s in (30, 10, 20)]
    sources = last_k(ckpts, 2)
    assert [s.name for s in sources] == ["c20", "c30"]
    out = average_checkpoints(sources, tmp_path / "pma")
    a, b = (load_file(str(s / "model.safetensors")) for s in sources)
    avg = Generator.from_pretrained(out).state_dict()
    for name in a:
        torch.testing.assert_close(avg[name], (a[name] + b[name]) / 2)
    assert json.loads((out / "pma.json").read_text())["steps"] == [20, 30]
    again = average_checkpoints(sources, tmp_path / "pma2")
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_checkpoints_of_different_models_are_refused(text_encoder_dir, tmp_path):
    from model.testing import micro_model_config

    one = _checkpoint(Generator.build(micro_model_config(text_encoder_dir)), tmp_path / "a", 1, 0)
    two = _checkpoint(Generator.build(micro_model_config(text_encoder_dir, patch_size=4)), tmp_path / "b", 2, 0)
    with pytest.raises(ValueError, match="another model"):
        average_checkpoints([one, two], tmp_path / "pma")
