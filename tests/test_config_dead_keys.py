"""Every key of the schema is read by some code: a setting nothing reads is a promise the pipeline does not keep
(KilnConfig.seed was one). Walked statically: a field counts as read where the product code (kiln/config/'s
own validators and checks included) names it as an attribute (`.name`), a string key (`"name"`) or a keyword
(`name=`). Coarse for common names (seed, steps), exact for the specific ones a dead key usually has."""

import re
from pathlib import Path
from typing import get_args

from pydantic import BaseModel

from kiln.config import KilnConfig
from kiln.paths import PACKAGES, REPO_ROOT


def schema_fields(model: type[BaseModel], seen: set | None = None) -> list[tuple[str, str]]:
    """(model name, field name) of `model` and every model nested in it, each model once."""
    seen = set() if seen is None else seen
    if model in seen:
        return []
    seen.add(model)
    out = [(model.__name__, name) for name in model.model_fields]
    for field in model.model_fields.values():
        for inner in _types(field.annotation):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                out += schema_fields(inner, seen)
    return out


def _types(annotation) -> list:
    return [annotation, *(t for a in get_args(annotation) for t in _types(a))]


def product_code(root: Path = REPO_ROOT) -> str:
    """The product's source, with the schema's field declarations (kiln/config/) left out: a declaration is not a read."""
    parts = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text()
            if path.parent == root / "kiln" / "config":
                text = "\n".join(
                    line for line in text.splitlines() if not re.match(r"\s+\w+: .+ = |\s+\w+: [\w\[\], |]+$", line)
                )
            parts.append(text)
    return "\n".join(parts)


def read_names(code: str) -> set[str]:
    """Every name the code uses as an attribute, a quoted key or a keyword argument."""
    return {name for groups in re.findall(r"\.(\w+)\b|[\"'](\w+)[\"']|\b(\w+)=", code) for name in groups if name}


def unread_keys(model: type[BaseModel], code: str) -> list[str]:
    names = read_names(code)
    return [f"{owner}.{name}" for owner, name in schema_fields(model) if name not in names]


def test_every_schema_key_is_read_by_some_code():
    assert unread_keys(KilnConfig, product_code()) == []


def test_a_key_nothing_reads_is_named_with_its_model():
    class Knobs(BaseModel):
        used_knob: int = 1
        forgotten_knob: int = 2

    class Root(BaseModel):
        knobs: Knobs = Knobs()

    assert unread_keys(Root, "cfg.knobs.used_knob + 1") == ["Knobs.forgotten_knob"]


def test_a_train_file_key_that_every_rung_of_its_ladder_overrides_says_so():
    """A key of conf/train/<file>.yaml that every rung built on the file overrides never reaches that ladder:
    its line must say so (a comment naming the ladder or its rungs), or the key goes."""
    import yaml

    for ladder_file in sorted((REPO_ROOT / "conf" / "ladder").glob("*.yaml")):
        rungs = [*yaml.safe_load(ladder_file.read_text()).get("rungs", [])]
        for train in {r["train"] for r in rungs}:
            users = [r for r in rungs if r["train"] == train]
            overridden = set.intersection(
                *({o.split("=", 1)[0].removeprefix("train.") for o in r.get("overrides", [])} for r in users)
            )
            path = REPO_ROOT / "conf" / "train" / f"{train}.yaml"
            lines = {line.split(":", 1)[0]: line for line in path.read_text().splitlines() if re.match(r"^\w+:", line)}
            silent = [k for k in sorted(overridden & set(lines)) if not re.search(r"#.*\b(ladder|rungs?)\b", lines[k])]
            assert not silent, (
                f"{path.name}: {silent} are overridden by every rung of {ladder_file.name} and do not say so"
            )
