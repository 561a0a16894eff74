"""conf/ holds only what differs: every key a conf file sets is a schema key (kiln/config/), and none restates
the value it would have anyway (the schema default, or what the file's Hydra base already sets). A profile then
reads as its differences from the real-data defaults, and a default changed in the schema reaches every profile."""

from pathlib import Path
from typing import Any, Union, get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel

from kiln import config as schema
from kiln.paths import CONF_DIR

MISSING = object()
GROUP_MODELS: dict[str, type[BaseModel]] = {name: type(getattr(schema.KilnConfig(), name)) for name in schema.GROUPS}


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (`X`, `X | None`), else None."""
    for a in (
        (annotation, *get_args(annotation)) if get_origin(annotation) in (Union, type(int | None)) else (annotation,)
    ):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def _items_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a `list[X]` field's items, else None."""
    return _model_in(get_args(annotation)[0]) if get_origin(annotation) is list else None


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _bases(path: Path) -> dict:
    """What the Hydra `defaults` of a group file (other files of its group, e.g. `_ladder_base`) set, merged in order."""
    merged: dict = {}
    for name in (yaml.safe_load(path.read_text()) or {}).get("defaults", []):
        if isinstance(name, str) and name != "_self_":
            base = path.with_name(f"{name}.yaml")
            merged = _merge(merged, _merge(_bases(base), yaml.safe_load(base.read_text()) or {}))
    return merged


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _walk(model: type[BaseModel], data: dict, defaults: Any, base: Any, where: str) -> list[str]:
    """Problems of one mapping against its model: unknown keys, and values equal to what they would be anyway."""
    problems = []
    for key, value in data.items():
        dotted = f"{where}{key}"
        field = model.model_fields.get(key)
        if field is None:
            problems.append(f"{dotted}: not a key of {model.__name__} (a dead key)")
            continue
        default = (
            defaults.get(key, MISSING)
            if isinstance(defaults, dict)
            else _plain(field.get_default(call_default_factory=True))
        )
        inherited = base.get(key, MISSING) if isinstance(base, dict) else MISSING
        sub, items = _model_in(field.annotation), _items_model(field.annotation)
        if sub is not None and isinstance(value, dict):
            problems += _walk(sub, value, default if isinstance(default, dict) else None, inherited, dotted + ".")
            continue
        if items is not None and isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    problems += _walk(items, item, None, MISSING, f"{dotted}.{i}.")
        would_be = inherited if inherited is not MISSING else default
        if would_be is not MISSING and _plain(value) == would_be:
            problems.append(
                f"{dotted}: {value!r} is already {'its base' if inherited is not MISSING else 'the schema default'}"
            )
    return problems


def lean_problems(conf: Path) -> list[str]:
    """Every problem of every Hydra group file under `conf`, as 'file: key: why'."""
    out = []
    for path in sorted(conf.glob("*/*.yaml")):
        model = GROUP_MODELS.get(path.parent.name)
        if model is None:  # conf/ablate: plans, not config groups (kiln/ablate.py validates them)
            continue
        data = {k: v for k, v in (yaml.safe_load(path.read_text()) or {}).items() if k != "defaults"}
        out += [f"{path.relative_to(conf)}: {p}" for p in _walk(model, data, _plain(model()), _bases(path), "")]
    root = {k: v for k, v in (yaml.safe_load((conf / "config.yaml").read_text()) or {}).items() if k != "defaults"}
    out += [f"config.yaml: {p}" for p in _walk(schema.KilnConfig, root, None, MISSING, "")]
    return out


def test_conf_sets_only_schema_keys_and_only_values_that_differ():
    assert lean_problems(CONF_DIR) == []


@pytest.mark.parametrize(
    ("file", "line", "problem"),
    [
        ("train/demo.yaml", "seed: 0", "train/demo.yaml: seed: 0 is already the schema default"),
        ("train/demo.yaml", "sample: {steps: 20}", "train/demo.yaml: sample.steps: 20 is already the schema default"),
        (
            "data/demo.yaml",
            "ingest: {shard_size: 2000}",
            "data/demo.yaml: ingest.shard_size: 2000 is already the schema default",
        ),
        ("train/sft.yaml", "device: cuda", "train/sft.yaml: device: 'cuda' is already its base"),
        ("model/tiny.yaml", "patch_sise: 4", "model/tiny.yaml: patch_sise: not a key of ModelConfig (a dead key)"),
        ("config.yaml", "seed: 0", "config.yaml: seed: not a key of KilnConfig (a dead key)"),
    ],
)
def test_a_restated_default_or_a_dead_key_is_named_with_its_file(tmp_path, file, line, problem):
    import shutil

    shutil.copytree(CONF_DIR, tmp_path / "conf")
    path = tmp_path / "conf" / file
    path.write_text(path.read_text() + line + "\n")
    assert lean_problems(tmp_path / "conf") == [problem]


def test_a_head_of_the_demo_that_restates_its_threshold_is_named(tmp_path):
    import shutil

    shutil.copytree(CONF_DIR, tmp_path / "conf")
    path = tmp_path / "conf" / "data" / "demo.yaml"
    path.write_text(path.read_text().replace('laplacian_var < 90"}', 'laplacian_var < 90", threshold: 0.9}', 1))
    assert lean_problems(tmp_path / "conf") == [
        "data/demo.yaml: classify.heads.0.threshold: 0.9 is already the schema default"
    ]
