"""The trainer in one process (the demo's path, and the loop every rank of a Slurm job runs): it learns,
it is deterministic, it resumes exactly, its checkpoints round-trip, and it records what a person watches.

A micro DiT over a tiny random BERT (saved to tmp and loaded by path, as the product loads MiniLM),
trained for 30 steps on demo scenes packed into two buckets, with sampling weights (so epochs are drawn,
not read in pack order) and the configured caption form probabilities.
"""

import itertools
import json

import pytest
import torch
from safetensors.torch import load_file

from kiln.outputs import output_hash
from model.generator import Generator
from model.testing import write_tiny_text_encoder
from training.core.checkpoint import read_train_state
from training.core.data import TrainSet, dataset_version
from training.core.muon import make_optimizer
from training.core.telemetry import SpikeDetector, read_metrics
from training.core.trainer import Learner, StepBatch, init_generator, setup_runtime, step_generator, train, train_step
from training.evaluation.evaluate import heldout_loss, heldout_rows
from training.testing import scene_rows, tiny_config, write_pack_output

STEPS = 30
WEIGHTS = [1.0, 2.0, 0.5, 0.0, 1.5] * 12  # mean 1, as the concept coverage makes them


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    te = write_tiny_text_encoder(root / "text_encoder")
    data = write_pack_output(
        root / "pack", scene_rows(56, seed=1, buckets=((32, 32), (24, 40)), batch_size=8, weights=WEIGHTS)
    )
    return root, data, tiny_config(te, steps=STEPS)


@pytest.fixture(scope="module")
def run_a(setup):
    root, data, cfg = setup
    return train(data, root / "a", cfg)


def test_the_checkpoint_folder_holds_weights_state_and_telemetry(run_a):
    for name in (
        "config.json",
        "model.safetensors",
        "train_state.json",
        "train_data.json",
        "metrics.jsonl",
        "loss.png",
        "loss.csv",
        "spikes.json",
        "throughput.json",
    ):
        assert (run_a / name).is_file(), name
    assert (run_a / "dcp" / f"step-{STEPS:06d}" / ".metadata").is_file()  # the resumable state
    state = read_train_state(run_a)
    assert state.step == STEPS and state.holdout == 8 and state.rows == 48
    records = read_metrics(run_a / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(
        r["samples_per_s"] > 0 and r["tokens_per_s"] > 0 and r["grad_norm"] > 0 and r["tflops_per_device"] > 0
        for r in records
    )
    assert records[-1]["loss"] == state.final_loss
    summary = json.loads((run_a / "throughput.json").read_text())
    assert (
        summary["mfu"] is None and summary["peak_tflops_per_device"] is None
    )  # no known peak on a CPU: no made-up MFU
    assert summary["tflops_per_device"] > 0 and summary["devices"] == 1


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
    assert [r["loss"] for r in read_metrics(run_b / "metrics.jsonl")] == [
        r["loss"] for r in read_metrics(run_a / "metrics.jsonl")
    ]
    for name in ("model.safetensors", "train_state.json", "train_data.json", "config.json", "loss.csv", "spikes.json"):
        assert (run_b / name).read_bytes() == (run_a / name).read_bytes(), name
    # every byte but the wall-clock records, the resumable DCP state included: what lets dvc.lock pin a training stage
    assert (run_b / "dcp" / f"step-{STEPS:06d}" / ".metadata").read_bytes() == (
        run_a / "dcp" / f"step-{STEPS:06d}" / ".metadata"
    ).read_bytes()
    assert output_hash(run_b) == output_hash(run_a)


def test_another_seed_gives_another_run(setup, run_a):
    root, data, cfg = setup
    other = cfg.model_copy(update={"train": cfg.train.model_copy(update={"seed": 1, "steps": 3})})
    run = train(data, root / "seed1", other)
    assert [r["loss"] for r in read_metrics(run / "metrics.jsonl")] != [
        r["loss"] for r in read_metrics(run_a / "metrics.jsonl")
    ][:3]


@pytest.mark.slow
def test_a_stopped_run_resumed_from_its_checkpoint_ends_with_the_uninterrupted_weights(setup, run_a):
    root, data, cfg = setup
    out = root / "resumed"
    train(data, out, cfg, stop_at=13)
    stream = TrainSet.from_dir(data, cfg.train.batch_size, cfg.train.holdout, cfg.data.rewrite.form_probs).stream(
        cfg.train.seed
    )
    assert read_train_state(out).step == 13
    assert (
        read_train_state(out).position == next(itertools.islice(stream, 13, None)).position
    )  # where the 14th batch is read, weighted epochs' ends included
    (out / "model.safetensors").unlink()  # only the DCP state is needed to resume
    train(data, out, cfg, resume=True)
    state = read_train_state(out)
    assert state.step == STEPS and state.position == read_train_state(run_a).position
    a, b = load_file(str(run_a / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in read_metrics(out / "metrics.jsonl")] == [
        r["loss"] for r in read_metrics(run_a / "metrics.jsonl")
    ]
    assert (out / "train_data.json").read_bytes() == (
        run_a / "train_data.json"
    ).read_bytes()  # forms counted over all 30 steps, not since the resume


def test_the_checkpoint_records_the_data_it_was_trained_on(setup, run_a):
    root, data, cfg = setup
    record = json.loads((run_a / "train_data.json").read_text())
    train_set = TrainSet.from_dir(data, cfg.train.batch_size, cfg.train.holdout, cfg.data.rewrite.form_probs)
    samples = sum(b.size for b in itertools.islice(train_set.stream(cfg.train.seed), STEPS))
    assert record["train_set_version"] == dataset_version(data)  # the version the evaluation's reference set names
    assert record["mix"] is None and record["caption_form_probs"] == cfg.data.rewrite.form_probs
    assert (
        sum(record["caption_forms_drawn"].values()) == samples
        and record["caption_forms_drawn"]["long"] > record["caption_forms_drawn"]["json"]
    )
    weights = [w for i, w in enumerate(WEIGHTS[:56]) if f"row{i:05d}" not in train_set.held_out]  # those trained on
    assert (
        record["sampling_weight"] == {"min": 0.0, "mean": sum(weights) / len(weights), "max": 2.0}
        and record["weighted"]
    )


def test_the_exported_checkpoint_gives_the_trained_velocities(setup, tmp_path):
    root, data, cfg = setup
    runtime = setup_runtime(cfg.train)
    gen = init_generator(cfg.model, cfg.train.seed)
    opt = make_optimizer(gen, cfg.train)
    batch = next(TrainSet.from_dir(data, cfg.train.batch_size).stream(0))
    x0 = gen.autoencoder.encode(batch.pixels)
    text = gen.encode_text(list(batch.captions))
    for step in range(3):  # the step function alone, no loop: what every rank of a sharded job calls
        result = train_step(
            Learner(gen, opt, cfg.train, runtime),
            StepBatch(x0, text, gen.null_text(batch.size)),
            step_generator(0, step),
            1e-3,
            1.0,
        )
        assert result.loss > 0 and result.grad_norm > 0 and result.repa_loss is None
    gen.save_pretrained(tmp_path)

    loaded = Generator.from_pretrained(tmp_path)
    t = torch.linspace(0.1, 0.9, batch.size)
    noisy = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(gen.eval()(noisy, t, text), loaded.eval()(noisy, t, text))


def test_an_overwriting_run_into_an_old_folder_does_not_resume_its_state(setup, run_a):
    root, data, cfg = setup
    out = root / "reused"
    train(data, out, cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 4})}), stop_at=2)
    with pytest.raises(FileExistsError, match="--resume .* or --overwrite"):  # nothing is deleted unasked
        train(data, out, cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 3})}))
    train(data, out, cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 3})}), overwrite=True)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    assert [d.name for d in (out / "dcp").iterdir()] == ["step-000003"]


def test_spikes_are_values_far_above_the_trailing_window():
    detector = SpikeDetector(window=10, z=6.0)
    calm = [1.0 + 0.01 * (i % 3) for i in range(20)]
    assert not any(detector.update(v) for v in calm)
    assert detector.update(1.5)  # 50x the window's spread
    assert not detector.update(1.01)
    assert detector.update(float("nan"))  # a NaN is always flagged, and kept out of the baseline
    early = SpikeDetector(window=10, z=6.0)
    assert not any(early.update(v) for v in (5.0, 1.0, 0.5, 0.3))  # no baseline yet: a falling start is no spike


def test_the_metrics_log_flags_spikes_and_the_summary_counts_them(run_a):
    records = read_metrics(run_a / "metrics.jsonl")
    assert all(isinstance(r["loss_spike"], bool) and isinstance(r["grad_spike"], bool) for r in records)
    spikes = json.loads((run_a / "spikes.json").read_text())
    assert spikes["loss"] == [r["step"] for r in records if r["loss_spike"]]
    assert json.loads((run_a / "throughput.json").read_text())["loss_spikes"] == len(spikes["loss"])
