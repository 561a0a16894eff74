"""Config values: every number in the schema has a lower and an upper bound, every min / max pair is in
order, and a nonsense value fails when the config loads, naming the key and where it came from.

A value that is only wrong against the data (a held-out count at least the train set's rows) fails when
training starts, naming the key, the row count and the train set folder.
"""

import types
import typing
from pathlib import Path
from typing import Annotated, Union

import annotated_types as at
import pytest
from pydantic import BaseModel, Field
from pydantic.fields import FieldInfo

from kiln.config import ConfigError, KilnConfig, load_config
from kiln.paths import CONF_DIR


# ------------------------------------------------------------------------------------- the schema walk
def _bounds(metadata) -> tuple[bool, bool]:
    """(has a lower bound, has an upper bound) from pydantic's constraint metadata."""
    low = high = False
    for m in metadata:
        if isinstance(m, FieldInfo):
            lo, hi = _bounds(m.metadata)
            low, high = low or lo, high or hi
        elif isinstance(m, at.Interval):
            low = low or m.ge is not None or m.gt is not None
            high = high or m.le is not None or m.lt is not None
        low = low or isinstance(m, (at.Ge, at.Gt))
        high = high or isinstance(m, (at.Le, at.Lt))
    return low, high


def unbounded_numbers(tp, metadata=(), path: str = "") -> list[str]:
    """Dotted paths of the int / float settings under `tp` that lack a lower or an upper bound, looking
    through optionals, nested models, lists and tuples (`key[]`) and dict values (`key{}`)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        return unbounded_numbers(args[0], [*metadata, *args[1:]], path)
    if origin in (Union, types.UnionType):
        return [p for a in args if a is not type(None) for p in unbounded_numbers(a, metadata, path)]
    if origin in (list, tuple, set, frozenset):
        return [p for a in args if a is not Ellipsis for p in unbounded_numbers(a, (), f"{path}[]")]
    if origin is dict:
        return unbounded_numbers(args[1], (), f"{path}{{}}")
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [
            p
            for name, f in tp.model_fields.items()
            for p in unbounded_numbers(f.annotation, f.metadata, f"{path}.{name}".lstrip("."))
        ]
    if tp in (int, float):  # bool is neither: typing keeps it apart
        low, high = _bounds(metadata)
        return [] if low and high else [f"{path} ({'no lower bound' if not low else 'no upper bound'})"]
    return []


def test_every_number_in_the_schema_has_a_lower_and_an_upper_bound():
    assert unbounded_numbers(KilnConfig) == []


def test_the_walk_looks_inside_optionals_lists_dicts_and_lists_of_models():
    class Part(BaseModel):
        share: float = Field(ge=0)  # no upper bound

    class Example(BaseModel):
        fine: int = Field(1, ge=0, le=9)
        optional: float | None = Field(None, gt=0)
        levels: list[int] = []
        probs: dict[str, Annotated[float, Field(ge=0)]] = {}
        pairs: dict[str, tuple[Annotated[int, Field(ge=0, le=9)], int]] = {}
        parts: list[Part] = []
        flag: bool = False

    assert unbounded_numbers(Example) == [
        "optional (no upper bound)",
        "levels[] (no lower bound)",
        "probs{} (no upper bound)",
        "pairs{}[] (no lower bound)",
        "parts[].share (no upper bound)",
    ]


# ------------------------------------------------------------------------------------ nonsense values
@pytest.mark.parametrize(
    "override",
    [
        # the examples
        "data.filters.max_pixels=-1",
        "train.grad_clip=-1",
        "train.lr=-1",
        "train.warmup_steps=-10",
        # more of the same kind
        "train.lr=0",
        "train.steps=0",
        "train.seed=-1",
        "train.threads=0",
        "train.caption_dropout=1.5",
        "data.filters.min_side=100000",
        "data.filters.max_pixels=100000000000",
        "cluster.workers=100000",
        "train.holdout=-1",
    ],
)
def test_a_nonsense_value_fails_at_load_naming_the_key_and_the_override(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"  {key}: Input should be .* \(from override '{override}'\)"):
        load_config([override])


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("data.pack.aspect_buckets=[1.0,0]", "data.pack.aspect_buckets.1"),
        ("data.rewrite.form_probs.long=-0.5", "data.rewrite.form_probs.long"),
        ("data.rewrite.lengths.short=[-1,10]", "data.rewrite.lengths.short.0"),
        ("train.eval.loss_timesteps=[0.5,1.0]", "train.eval.loss_timesteps.1"),
        ("data.clustering.levels=[8,0]", "data.clustering.levels.1"),
        ("model.text_encoder.layers=[-1,5000]", "model.text_encoder.layers.1"),
        ("data.mixes.midtrain=[{name: a, where: 'true', share: 2}]", "data.mixes.midtrain.0.share"),
    ],
)
def test_a_nonsense_number_inside_a_list_or_dict_is_named_by_its_position(override, key):
    with pytest.raises(ConfigError, match=rf"  {key}: Input should be "):
        load_config([override])


# ------------------------------------------------------------------------------------- min / max pairs
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["data.filters.min_laplacian_var=30000"],
            r"data\.filters: min_laplacian_var \(30000\.0\) must be below max_laplacian_var \(12000\.0\)",
        ),
        (
            ["data.filters.min_laplacian_var=50", "data.filters.max_laplacian_var=50"],
            r"data\.filters: min_laplacian_var \(50\.0\) must be below max_laplacian_var \(50\.0\)",
        ),
        (["data.filters.min_side=9000"], r"data\.filters: min_side \(9000\) squared is above max_pixels \(64000000\)"),
        (
            ["data.caption.min_new_tokens=100"],
            r"data\.caption: min_new_tokens \(100\) must be at most max_new_tokens \(64\)",
        ),
        (
            ["data.rewrite.max_new_tokens=4", "data.rewrite.min_new_tokens=5"],
            r"data\.rewrite: min_new_tokens \(5\) must be at most max_new_tokens \(4\)",
        ),
        (
            ["data.rewrite.lengths.short=[50,10]"],
            r"data\.rewrite: lengths\.short \[min, max\] = \[50, 10\]: min above max",
        ),
        (
            ["data.rewrite.form_probs={long: 0, medium: 0, short: 0, tags: 0, json: 0}"],
            r"data\.rewrite: form_probs .* sum to 0",
        ),
        (
            ["data.mixes.midtrain=[{name: a, where: 'true', share: 0.5}]"],
            r"data\.mixes: midtrain shares sum to 0\.5, not 1",
        ),
        (["data.sae.k=100"], r"data\.sae: k \(100\) must be at most features \(32\)"),
        (["data.sae.reject_features=[40]"], r"data\.sae: reject_features \[40\] are not below features \(32\)"),
        (
            ["data.clustering.review_level=3"],
            r"data\.clustering: review_level \(3\) is not an index into levels \[8, 24, 48\]",
        ),
        (
            ["train.timestep_shift=1.0", "train.timestep_max_shift=0.5"],
            r"train: timestep_shift \(1\.0\) must be at most timestep_max_shift \(0\.5\)",
        ),
        (["train.pma_k=4"], r"train: pma_k \(4\) must be at most dcp\.keep \(3\)"),
        (
            ["cluster.timeout_min=1"],
            r"cluster: signal_delay_s \(90\) must be below the time limit, timeout_min \(1 min\)",
        ),
    ],
)
def test_a_min_above_its_max_fails_naming_both_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides)


def test_a_pair_error_says_where_each_of_its_two_values_came_from():
    with pytest.raises(ConfigError) as e:
        load_config(["data.filters.min_laplacian_var=30000"])  # max_laplacian_var is the demo profile's
    assert f"(from override 'data.filters.min_laplacian_var=30000', {CONF_DIR / 'data' / 'demo.yaml'})" in str(e.value)


# ------------------------------------------------------------------------------ every profile still loads
PROFILES = [
    f"{group}={p.stem}"
    for group in ("train", "cluster", "ladder", "metrics", "model")
    for p in sorted((CONF_DIR / group).glob("*.yaml"))
]


LAB_FOLDERS = {
    "ladder=krea": "krea",
    "model=krea2_12b": "krea",
    "model=prx_1b": "prx",
    "model=latent_tiny": "latent_tiny",
}  # conftest fixtures


@pytest.mark.parametrize("profile", PROFILES)
def test_every_profile_in_conf_loads(profile, request):
    """Every profile loads; one whose model folders are the lab's to name (`???` in conf/model) loads once given
    folders of the classes it promises."""
    folders = request.getfixturevalue(LAB_FOLDERS[profile])[1:] if profile in LAB_FOLDERS else []
    load_config([profile, *folders])


def test_every_rung_of_every_ladder_loads_with_its_overrides(krea):
    from kiln.ladder import rung_base, rungs

    for ladder in sorted((CONF_DIR / "ladder").glob("*.yaml")):
        base = [f"ladder={ladder.stem}", *(krea[1:] if ladder.stem == "krea" else [])]
        for rung in rungs(load_config(base)):
            load_config([*base, *rung_base(rung, [])])


def test_the_web_profile_loads_once_given_its_models(tmp_path):
    load_config(
        [
            "data=web",
            "data.source=s3://bucket/images/",
            f"data.caption.vlm_path={tmp_path}",
            f"data.embed.path={tmp_path}",
            f"data.rewrite.llm_path={tmp_path}",
        ]
    )


# ------------------------------------------------------------------------------ holdout against the data
@pytest.fixture
def six_rows(tmp_path) -> Path:
    from training.testing import scene_rows, write_pack_output

    return write_pack_output(tmp_path / "train_set", scene_rows(6, batch_size=4))


def test_holding_out_every_row_fails_naming_the_key_the_row_count_and_the_folder(six_rows):
    from training.core.data import TrainSet

    with pytest.raises(
        ConfigError, match=rf"train\.holdout=6: no row is left to train on, the train set {six_rows} has 6 rows"
    ):
        TrainSet.from_dir(six_rows, 4, holdout=6)
    with pytest.raises(ConfigError, match=r"train\.holdout=32: .* has 6 rows"):
        TrainSet.from_dir(six_rows, 4, holdout=32)
    assert len(TrainSet.from_dir(six_rows, 4, holdout=5).held_out) == 5  # one row left: it trains


def test_kiln_train_refuses_a_holdout_larger_than_the_data_with_a_plain_message(six_rows, tmp_path, capsys):
    from kiln.cli import main

    assert main(["train", "--data", str(six_rows), "--out", str(tmp_path / "run"), "train.holdout=10"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("kiln: train.holdout=10: no row is left to train on")
        and f"the train set {six_rows} has 6 rows" in err
    )
    assert "Traceback" not in err
