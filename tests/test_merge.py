"""Model merging (training/post/merge.py): each method against its formula written out by hand on small
tensors, DARE's mask as a pure function of (seed, source, name, position), checkpoint merges that stream
tensor by tensor into a Generator checkpoint, and the merge search."""

import json
import math

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from kiln.config import MergeConfig
from training.core.safetensors_stream import SafetensorsWriter, join_parts
from training.post.merge import (
    block_index,
    dare,
    keep_mask,
    merge_dcp,
    merge_exports,
    merge_search,
    merge_state_dicts,
    search_candidates,
)


@pytest.fixture(autouse=True)
def _own_key(tmp_path_factory, monkeypatch):
    """Checkpoints are signed with a key of the test's own, not the user's."""
    from training.core.manifest import KEY_ENV

    monkeypatch.setenv(KEY_ENV, str(tmp_path_factory.getbasetemp() / "merge-checkpoint.key"))


def _sd(values) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor(values, dtype=torch.float32)}


# ------------------------------------------------------------------------------------------ the methods
def test_linear_is_the_weighted_average_of_the_sources():
    a, b = _sd([1.0, -2.0, 4.0]), _sd([3.0, 2.0, 0.0])
    merged = merge_state_dicts([a, b], None, MergeConfig(method="linear", weights=[3, 1]))
    torch.testing.assert_close(merged["w"], torch.tensor([(3 * 1 + 3) / 4, (3 * -2 + 2) / 4, (3 * 4 + 0) / 4]))
    equal = merge_state_dicts([a, b], None, MergeConfig(method="linear"))  # no weights: 1/N each
    torch.testing.assert_close(equal["w"], torch.tensor([2.0, 0.0, 2.0]))


def test_task_arithmetic_adds_the_scaled_weighted_task_vectors_to_the_base():
    base, a, b = _sd([1.0, 1.0, 1.0]), _sd([2.0, 0.0, 1.5]), _sd([1.0, 3.0, -1.0])
    merged = merge_state_dicts([a, b], base, MergeConfig(method="task_arithmetic", weights=[1.0, 0.5], scale=0.8))
    # tau_a = [1, -1, 0.5], tau_b = [0, 2, -2]; base + 0.8 * (1 * tau_a + 0.5 * tau_b)
    torch.testing.assert_close(merged["w"], torch.tensor([1 + 0.8 * 1.0, 1 + 0.8 * (-1 + 1), 1 + 0.8 * (0.5 - 1)]))


def test_ties_trims_elects_the_sign_and_averages_only_the_agreeing_entries():
    base = torch.full((6,), 0.5)
    tau_a = torch.tensor([0.4, -0.1, 0.3, -0.6, 0.05, 0.2])
    tau_b = torch.tensor([-0.2, -0.5, 0.35, 0.3, -0.7, 0.05])
    cfg = MergeConfig(method="ties", weights=[3, 1], density=0.5, scale=0.5)
    merged = merge_state_dicts([{"w": base + tau_a}, {"w": base + tau_b}], {"w": base}, cfg)
    # trim to the top 3 magnitudes: a -> [0.4, 0, 0.3, -0.6, 0, 0], b -> [0, -0.5, 0.35, 0, -0.7, 0]
    # elected sign of 3a + b: [+, -, +, -, -, none]; mean of the agreeing entries, weighted 3 : 1
    merged_tau = torch.tensor([0.4, -0.5, (3 * 0.3 + 1 * 0.35) / 4, -0.6, -0.7, 0.0])
    torch.testing.assert_close(merged["w"], base + 0.5 * merged_tau)


def test_ties_drops_the_minority_sign_instead_of_cancelling():
    base = torch.zeros(1)
    merged = merge_state_dicts(
        [{"w": torch.tensor([1.0])}, {"w": torch.tensor([0.8])}, {"w": torch.tensor([-0.5])}],
        {"w": base},
        MergeConfig(method="ties", density=1.0),
    )
    torch.testing.assert_close(merged["w"], torch.tensor([(1.0 + 0.8) / 2]))  # the -0.5 is out: not (1 + 0.8 - 0.5) / 3


# The masks DARE draws for tensor "w" with seed 7 and density 0.5 at positions 0..7, for source 0 and source 1.
# Pinned: a merge must be reproducible from its merge.json across kiln versions.
MASK_A = torch.tensor([1, 0, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
MASK_B = torch.tensor([0, 0, 1, 1, 1, 1, 0, 1], dtype=torch.bool)
BASE8 = torch.tensor([0.1, -0.2, 0.3, 0.0, 1.0, -1.0, 0.5, 0.25])
TAU_A = torch.tensor([0.4, -0.3, 0.2, -0.1, 0.6, 0.05, -0.2, 0.1])
TAU_B = torch.tensor([-0.3, 0.2, 0.1, 0.3, -0.2, 0.4, 0.5, -0.05])


def test_dare_masks_are_pinned_and_differ_between_sources():
    assert torch.equal(keep_mask(7, 0, "w", torch.arange(8), 0.5), MASK_A)
    assert torch.equal(keep_mask(7, 1, "w", torch.arange(8), 0.5), MASK_B)


def test_dare_drops_rescales_and_adds_the_weighted_task_vectors():
    cfg = MergeConfig(method="dare", weights=[1.0, 2.0], density=0.5, scale=0.8, seed=7)
    merged = merge_state_dicts([{"w": BASE8 + TAU_A}, {"w": BASE8 + TAU_B}], {"w": BASE8}, cfg)
    expected = BASE8 + 0.8 * (1.0 * MASK_A * TAU_A / 0.5 + 2.0 * MASK_B * TAU_B / 0.5)
    torch.testing.assert_close(merged["w"], expected)


def test_dare_ties_elects_signs_over_the_dropped_and_rescaled_task_vectors():
    cfg = MergeConfig(method="dare_ties", weights=[1.0, 2.0], density=0.5, scale=0.8, seed=7)
    merged = merge_state_dicts([{"w": BASE8 + TAU_A}, {"w": BASE8 + TAU_B}], {"w": BASE8}, cfg)
    da, db = MASK_A * TAU_A / 0.5, MASK_B * TAU_B / 0.5
    sign = torch.sign(1.0 * da + 2.0 * db)
    agree_a, agree_b = (torch.sign(da) == sign) & (sign != 0), (torch.sign(db) == sign) & (sign != 0)
    num = 1.0 * da * agree_a + 2.0 * db * agree_b
    den = 1.0 * agree_a + 2.0 * agree_b
    expected = BASE8 + 0.8 * torch.where(den > 0, num / den.clamp(min=1e-12), 0.0)
    # position 2: both kept and positive -> (0.4 + 2 * 0.2) / 3; position 4: a dropped, b alone -> -0.4
    torch.testing.assert_close(expected[2], BASE8[2] + 0.8 * (1.0 * 0.4 + 2.0 * 0.2) / 3)
    torch.testing.assert_close(merged["w"], expected)


def test_a_shard_draws_the_dare_mask_the_whole_tensor_draws():
    shape = (6, 10, 4)
    whole = keep_mask(3, 1, "dit.blocks.0.mlp.gate_up.weight", block_index(shape), 0.3)
    assert torch.equal(block_index(shape).reshape(-1), torch.arange(240))
    rows = keep_mask(
        3, 1, "dit.blocks.0.mlp.gate_up.weight", torch.arange(80, 160).view(2, 10, 4), 0.3
    )  # an FSDP row shard
    assert torch.equal(rows, whole[2:4])
    block = keep_mask(
        3, 1, "dit.blocks.0.mlp.gate_up.weight", block_index(shape, (1, 5, 2), (3, 5, 2)), 0.3
    )  # a TP column block
    assert torch.equal(block, whole[1:4, 5:10, 2:4])
    # and so the merge of a shard is the shard of the merge
    g = torch.Generator().manual_seed(0)
    base, a, b = (torch.randn(shape, generator=g) for _ in range(3))
    full = dare(base, [a, b], [0.5, 0.5], 0.3, 1.0, 3, "x", elect_sign=True)
    part = dare(
        base[1:4, 5:, 2:],
        [a[1:4, 5:, 2:], b[1:4, 5:, 2:]],
        [0.5, 0.5],
        0.3,
        1.0,
        3,
        "x",
        index=block_index(shape, (1, 5, 2), (3, 5, 2)),
        elect_sign=True,
    )
    assert torch.equal(part, full[1:4, 5:, 2:])


def test_dare_keeps_about_density_of_the_entries_independently_per_name_and_seed():
    n = 200_000
    index = torch.arange(n)
    masks = [keep_mask(0, 0, "a", index, 0.3), keep_mask(0, 0, "b", index, 0.3), keep_mask(1, 0, "a", index, 0.3)]
    sd = math.sqrt(0.3 * 0.7 / n)
    for m in masks:
        assert abs(m.float().mean().item() - 0.3) < 5 * sd
    for m, other in ((masks[0], masks[1]), (masks[0], masks[2])):
        assert abs((m & other).float().mean().item() - 0.09) < 5 * math.sqrt(0.09 * 0.91 / n)  # independent: P = 0.3^2
    far = torch.arange(2**40, 2**40 + n)  # positions past 2**32 are hashed on their high word too
    assert abs(keep_mask(0, 0, "a", far, 0.3).float().mean().item() - 0.3) < 5 * sd
    assert not torch.equal(keep_mask(0, 0, "a", far, 0.3), masks[0])
    assert keep_mask(0, 0, "a", index[:1000], 1.0).all()


# ----------------------------------------------------------------------------------------------- config
def test_weight_lists_of_different_lengths_are_refused_naming_both():
    with pytest.raises(ValidationError, match=r"search\[1\]\.weights has 3 entries and weights has 2"):
        MergeConfig(weights=[1, 1], search=[{"scale": 0.5}, {"weights": [1, 1, 1]}])
    with pytest.raises(ValidationError, match="sum to 0"):
        MergeConfig(weights=[0, 0])
    with pytest.raises(ValidationError):
        MergeConfig(density=0)
    with pytest.raises(ValueError, match="post.merge.weights has 3 entries for 2 sources"):
        merge_state_dicts([_sd([1.0]), _sd([2.0])], None, MergeConfig(weights=[1, 1, 1]))


def test_the_search_tries_the_listed_merges_then_the_weight_grid():
    cfg = MergeConfig(method="ties", density=0.4, search=[{"scale": 0.5}, {"weights": [2, 1], "density": 0.9}], grid=2)
    got = [(c.weights, c.scale, c.density) for c in search_candidates(cfg, 2)]
    assert got == [
        ([], 0.5, 0.4),
        ([2, 1], 1.0, 0.9),
        ([1.0, 0.0], 1.0, 0.4),
        ([0.5, 0.5], 1.0, 0.4),
        ([0.0, 1.0], 1.0, 0.4),
    ]
    assert [c.weights for c in search_candidates(MergeConfig(), 3)] == [[]]  # nothing to search: the merge itself
    with pytest.raises(ValueError, match="candidate 0: post.merge.weights has 2 entries for 3 sources"):
        search_candidates(MergeConfig(search=[{"weights": [1, 1]}]), 3)
    with pytest.raises(ValueError, match="at most 64"):
        search_candidates(MergeConfig(grid=10), 4)


# ------------------------------------------------------------------------------------------ checkpoints
def _export(gen, folder, seed):
    """A perturbed copy of `gen`'s weights saved as a signed export folder."""
    from training.core.checkpoint import write_export_manifest

    torch.manual_seed(seed)
    with torch.no_grad():
        for p in gen.parameters():
            p.add_(0.1 * torch.randn_like(p))
    gen.save_pretrained(folder)
    write_export_manifest(folder)
    return folder


@pytest.fixture
def exports(text_encoder_dir, tmp_path):
    from model.generator import Generator
    from model.testing import micro_model_config

    gen = Generator.build(micro_model_config(text_encoder_dir))
    base = _export(gen, tmp_path / "base", 0)
    return base, _export(gen, tmp_path / "a", 1), _export(Generator.from_pretrained(base), tmp_path / "b", 2)


@pytest.mark.parametrize("method", ["linear", "task_arithmetic", "ties", "dare", "dare_ties"])
def test_merging_exports_streams_into_a_generator_checkpoint(exports, tmp_path, method):
    from model.generator import Generator
    from training.core.checkpoint import verify_export

    base, a, b = exports
    cfg = MergeConfig(method=method, weights=[2, 1], density=0.6, scale=0.9, seed=5)
    out = merge_exports([a, b], base, tmp_path / "merged", cfg)
    in_memory = merge_state_dicts(
        [load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))],
        load_file(str(base / "model.safetensors")),
        cfg,
    )
    loaded = Generator.from_pretrained(out).state_dict()
    assert sorted(loaded) == sorted(in_memory)
    for name, t in in_memory.items():
        assert torch.equal(loaded[name], t), name
    assert verify_export(out)  # the folder has checksums of its own
    record = json.loads((out / "merge.json").read_text())
    assert record["method"] == method and record["sources"] == [str(a), str(b)] and record["weights"] == [2.0, 1.0]
    assert record["base"] == (None if method == "linear" else str(base))


def test_checkpoints_of_different_models_or_corrupt_ones_are_refused(exports, text_encoder_dir, tmp_path):
    from model.generator import Generator
    from model.testing import micro_model_config
    from training.core.manifest import CheckpointCorrupt

    base, a, b = exports
    other = _export(Generator.build(micro_model_config(text_encoder_dir, patch_size=4)), tmp_path / "other", 3)
    with pytest.raises(ValueError, match="another model"):
        merge_exports([a, other], base, tmp_path / "m1", MergeConfig(method="ties"))
    with pytest.raises(ValueError, match="needs the base checkpoint"):
        merge_exports([a, b], None, tmp_path / "m2", MergeConfig(method="ties"))
    data = bytearray((b / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (b / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="model.safetensors"):
        merge_exports([a, b], base, tmp_path / "m3", MergeConfig(method="ties"))
    assert not (tmp_path / "m3" / "model.safetensors").exists()


def test_a_dcp_step_merges_like_its_export(text_encoder_dir, tmp_path):
    """One process: the DCP step checkpoint of a model, read tensor by tensor, merges to the same bytes
    as its export (tests/test_merge_dcp.py does it for FSDP2 / TP shards saved by two ranks)."""
    from model.generator import Generator
    from model.testing import micro_model_config
    from training.core.data import DataPosition
    from training.core.dcp import Checkpointer, RunState

    gen = Generator.build(micro_model_config(text_encoder_dir))
    folders = {}
    for name, seed in (("base", 0), ("a", 1), ("b", 2)):
        run = _export(gen, tmp_path / name, seed)
        step = Checkpointer(run, keep=1, async_save=False, mesh_facts={"tp": 1}).save(
            gen, torch.optim.AdamW(gen.parameters()), RunState(1, DataPosition())
        )
        folders[name] = (run, step)
    cfg = MergeConfig(method="dare_ties", density=0.5, seed=1)
    from_dcp = merge_dcp([folders["a"][1], folders["b"][1]], folders["base"][1], tmp_path / "from_dcp", cfg)
    from_exports = merge_exports([folders["a"][0], folders["b"][0]], folders["base"][0], tmp_path / "from_exports", cfg)
    assert (from_dcp / "model.safetensors").read_bytes() == (from_exports / "model.safetensors").read_bytes()
    assert json.loads((from_dcp / "merge.json").read_text())["kinds"] == ["dcp", "dcp"]


def test_parts_joined_are_the_bytes_one_writer_writes(tmp_path):
    tensors = {
        "b": torch.arange(6, dtype=torch.float32).view(2, 3),
        "a": torch.ones(3, dtype=torch.bfloat16),
        "c": torch.tensor(7),
    }
    specs = {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}
    for name, keys in (("one", ["a", "b", "c"]), ("p0", ["b"]), ("p1", ["a", "c"])):
        w = SafetensorsWriter(tmp_path / f"{name}.safetensors", {k: specs[k] for k in keys}, {"format": "x"})
        for k in sorted(keys):
            w.write(k, tensors[k])
        w.close()
    join_parts(
        [tmp_path / "p0.safetensors", tmp_path / "p1.safetensors"], tmp_path / "joined.safetensors", {"format": "x"}
    )
    assert (tmp_path / "joined.safetensors").read_bytes() == (tmp_path / "one.safetensors").read_bytes()
    back = load_file(str(tmp_path / "joined.safetensors"))
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)
    save_file(
        tensors, str(tmp_path / "library.safetensors")
    )  # the library reads what it writes; so does the writer's reader
    from training.core.safetensors_stream import read_header

    assert read_header(tmp_path / "library.safetensors")[0] == specs


# ----------------------------------------------------------------------------------------------- search
def _closeness(a_dir, b_dir):
    """Per-domain scores of a merged folder: minus the squared distance of its weights to each source's.
    Their mean is highest at the midpoint of the two."""
    a, b = load_file(str(a_dir / "model.safetensors")), load_file(str(b_dir / "model.safetensors"))

    def score(folder):
        m = load_file(str(folder / "model.safetensors"))
        return {
            "a": -sum(float((m[k] - a[k]).pow(2).sum()) for k in m),
            "b": -sum(float((m[k] - b[k]).pow(2).sum()) for k in m),
        }

    return score


def test_the_search_keeps_the_best_mean_score_and_reports_every_candidate(exports, tmp_path):
    base, a, b = exports
    cfg = MergeConfig(method="linear", grid=4)
    report = merge_search([a, b], base, tmp_path / "merge", cfg, _closeness(a, b))
    assert [c["weights"] for c in report["candidates"]] == [
        [1.0, 0.0],
        [0.75, 0.25],
        [0.5, 0.5],
        [0.25, 0.75],
        [0.0, 1.0],
    ]
    assert report["kept"] == 2  # the midpoint
    means = [c["mean"] for c in report["candidates"]]
    assert means[2] == max(means) and all(set(c["scores"]) == {"a", "b"} for c in report["candidates"])
    assert json.loads((tmp_path / "merge" / "merge_search.json").read_text()) == report
    assert json.loads((tmp_path / "merge" / "merge.json").read_text())["weights"] == [
        0.5,
        0.5,
    ]  # the kept merge is in `out`
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "base", "merge"]  # no candidate left behind


def test_the_search_keeps_the_first_of_equal_scores(exports, tmp_path):
    base, a, b = exports
    report = merge_search(
        [a, b],
        base,
        tmp_path / "merge",
        MergeConfig(method="ties", search=[{"scale": 0.5}, {"scale": 1.0}]),
        lambda folder: {"x": 1.0, "y": 0.0},
    )
    assert report["kept"] == 0 and [c["mean"] for c in report["candidates"]] == [0.5, 0.5]
    assert json.loads((tmp_path / "merge" / "merge.json").read_text())["scale"] == 0.5


def test_kiln_merge_reads_the_method_from_post_merge(exports, tmp_path, capsys):
    from kiln.cli import main

    base, a, b = exports
    assert (
        main(
            [
                "merge",
                "--source",
                str(a),
                "--source",
                str(b),
                "--base",
                str(base),
                "--out",
                str(tmp_path / "cli"),
                "post.merge.method=ties",
                "post.merge.weights=[2,1]",
                "post.merge.density=0.3",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    record = json.loads((tmp_path / "cli" / "merge.json").read_text())
    assert (record["method"], record["weights"], record["density"]) == ("ties", [2.0, 1.0], 0.3)
    expected = merge_exports([a, b], base, tmp_path / "api", MergeConfig(method="ties", weights=[2, 1], density=0.3))
    assert (tmp_path / "cli" / "model.safetensors").read_bytes() == (expected / "model.safetensors").read_bytes()


def test_each_rank_merges_a_disjoint_share_of_whole_tensors():
    from training.post.merge import assign_tensors

    specs = {f"t{i}": (torch.float32, (n,)) for i, n in enumerate([100, 7, 60, 40, 3, 50, 1])}
    shares = assign_tensors(specs, 3)
    names = [n for share in shares for n in share]
    assert sorted(names) == sorted(specs)  # every tensor once
    loads = [sum(specs[n][1][0] for n in share) for share in shares]
    assert max(loads) - min(loads) <= 100  # balanced to within the largest tensor
    assert assign_tensors(specs, 1) == [sorted(specs)]
