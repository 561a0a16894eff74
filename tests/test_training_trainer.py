"""The single-process trainer: it learns, it is deterministic, it resumes exactly, its checkpoints round-trip.

A micro DiT over a tiny random BERT (saved to tmp and loaded by path, as the product loads MiniLM),
trained for 30 steps on demo scenes packed into two buckets.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from model.generator import Generator
from model.testing import write_tiny_text_encoder
from training.checkpoint import TrainState, load_optimizer, read_train_state, save_checkpoint
from training.data import DataPosition, TrainSet
from training.evaluate import heldout_loss, heldout_rows
from training.telemetry import read_metrics
from training.testing import scene_rows, tiny_config, write_pack_output
from training.trainer import init_generator, make_optimizer, setup_runtime, step_generator, train, train_step

STEPS = 30


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    te = write_tiny_text_encoder(root / "text_encoder")
    data = write_pack_output(root / "pack", scene_rows(56, seed=1, buckets=((32, 32), (24, 40)), batch_size=8))
    return root, data, tiny_config(te, steps=STEPS)


@pytest.fixture(scope="module")
def run_a(setup):
    root, data, cfg = setup
    return train(data, root / "a", cfg)


def test_the_checkpoint_folder_holds_weights_state_and_telemetry(run_a):
    for name in ("config.json", "model.safetensors", "optimizer.safetensors", "train_state.json", "metrics.jsonl", "loss.png", "throughput.json"):
        assert (run_a / name).is_file(), name
    state = read_train_state(run_a)
    assert state.step == STEPS and state.holdout == 8 and state.rows == 48
    records = read_metrics(run_a / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["samples_per_s"] > 0 and r["tokens_per_s"] > 0 and r["grad_norm"] > 0 for r in records)
    assert records[-1]["loss"] == state.final_loss


def test_loss_decreases_over_thirty_steps(setup, run_a):
    root, data, cfg = setup
    losses = [r["loss"] for r in read_metrics(run_a / "metrics.jsonl")]
    assert sum(losses[-10:]) < 0.8 * sum(losses[:10])
    rows, _ = heldout_rows(data, 8)
    trained = heldout_loss(Generator.from_pretrained(run_a), rows, [0.3, 0.6, 0.9], seed=0)["mean"]
    untrained = heldout_loss(init_generator(cfg.model, cfg.train.seed), rows, [0.3, 0.6, 0.9], seed=0)["mean"]
    assert trained < 0.8 * untrained


def test_same_data_and_config_give_the_same_loss_trajectory_and_bytes(setup, run_a):
    root, data, cfg = setup
    run_b = train(data, root / "b", cfg)
    assert [r["loss"] for r in read_metrics(run_b / "metrics.jsonl")] == [r["loss"] for r in read_metrics(run_a / "metrics.jsonl")]
    for name in ("model.safetensors", "optimizer.safetensors", "train_state.json", "config.json"):
        assert (run_b / name).read_bytes() == (run_a / name).read_bytes(), name


def test_another_seed_gives_another_run(setup, run_a):
    root, data, cfg = setup
    other = cfg.model_copy(update={"train": cfg.train.model_copy(update={"seed": 1, "steps": 3})})
    run = train(data, root / "seed1", other)
    assert [r["loss"] for r in read_metrics(run / "metrics.jsonl")] != [r["loss"] for r in read_metrics(run_a / "metrics.jsonl")][:3]


def test_a_stopped_run_resumed_from_its_checkpoint_ends_with_the_uninterrupted_weights(setup, run_a):
    root, data, cfg = setup
    out = root / "resumed"
    train(data, out, cfg, stop_at=13)
    assert read_train_state(out).step == 13
    train(data, out, cfg, resume=True)
    state = read_train_state(out)
    assert state.step == STEPS and state.position == read_train_state(run_a).position
    a, b = load_file(str(run_a / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in read_metrics(out / "metrics.jsonl")] == [r["loss"] for r in read_metrics(run_a / "metrics.jsonl")]


def test_checkpoint_round_trip_gives_the_same_velocities_and_optimizer_state(setup, tmp_path):
    root, data, cfg = setup
    runtime = setup_runtime(cfg.train)
    gen = init_generator(cfg.model, cfg.train.seed)
    opt = make_optimizer(gen, cfg.train)
    batch = next(TrainSet.from_dir(data, cfg.train.batch_size).stream(0))
    x0 = gen.autoencoder.encode(batch.pixels)
    text = gen.encode_text(list(batch.captions))
    for step in range(3):  # the step function alone, no loop: what the parallel trainer reuses
        train_step(gen, opt, x0, text, gen.null_text(batch.size), step_generator(0, step), cfg.train, 1e-3, 1.0, runtime)
    state = TrainState(3, DataPosition(0, 3), None, None, batch.bucket, 0, 0, gen.num_params())
    save_checkpoint(gen, opt, tmp_path, state)

    loaded = Generator.from_pretrained(tmp_path)
    t = torch.linspace(0.1, 0.9, batch.size)
    noisy = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(gen.eval()(noisy, t, text), loaded.eval()(noisy, t, text))
    opt2 = make_optimizer(loaded, cfg.train)
    load_optimizer(loaded, opt2, tmp_path)
    names = dict(gen.named_parameters())
    for n, p in loaded.named_parameters():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt2.state[p][key], opt.state[names[n]][key]), (n, key)
    assert json.loads((tmp_path / "train_state.json").read_text())["position"] == {"epoch": 0, "batch": 3}
