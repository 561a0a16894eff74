"""What `dvc exp run -S key=value` changed, as Hydra overrides a kiln stage applies last.

With Hydra enabled in .dvc/config, `dvc exp run -S train.steps=50` composes conf/ with the override into
params.yaml and then runs the stages; a stage's command (`kiln train ... train.steps=560`) composes conf/
itself and would never see it. So inside a stage of a DVC experiment (DVC sets DVC_STAGE and DVC_EXP_NAME),
load_config reads the params.yaml in the stage's folder, which DVC has just composed, takes where it differs
from conf/'s own composition, and applies those differences as overrides after the command's: `-S` wins over
what dvc.yaml wrote. A plain `dvc repro` composes nothing, so there kiln reads conf/ as everywhere else (a
params.yaml older than an edit of conf/ cannot undo the edit).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

PARAMS_FILE = "params.yaml"  # where DVC's Hydra composition writes (dvc's ParamsDependency.DEFAULT_PARAMS_FILE)


def experiment_params() -> dict[str, Any] | None:
    """params.yaml as DVC composed it, in a stage of a DVC experiment; None elsewhere (kiln.config.stage_overrides
    turns it into the overrides it carries beyond conf/)."""
    if not (os.environ.get("DVC_STAGE") and os.environ.get("DVC_EXP_NAME")):
        return None
    path = Path(PARAMS_FILE)
    if not path.is_file():
        return None
    import yaml

    params = yaml.safe_load(path.read_text())
    return params if isinstance(params, dict) else None


def diff_overrides(base: dict[str, Any], target: dict[str, Any], prefix: str = "") -> list[str]:
    """Hydra overrides that turn `base` into `target`: `key=value` for a changed leaf, `++key=value` for a
    key `base` lacks, `~key` for one `target` dropped. Equal subtrees give nothing."""
    out: list[str] = []
    for key, value in target.items():
        dotted = f"{prefix}{key}"
        if key not in base:
            out.append(f"++{dotted}={format_value(value)}")
        elif isinstance(value, dict) and isinstance(base[key], dict):
            out += diff_overrides(base[key], value, dotted + ".")
        elif value != base[key] or type(value) is not type(base[key]):
            out.append(f"{dotted}={format_value(value)}")
    out += [f"~{prefix}{key}" for key in base if key not in target]
    return out


def format_value(value: Any) -> str:
    """A value in Hydra's override grammar (strings quoted, so `3` stays a string and `a,b` no sweep)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else "nan" if math.isnan(value) else repr(value)
    if isinstance(value, str):
        return (
            "'" + re.sub(r"(\\+)(?='|$)", r"\1\1", value).replace("'", "\\'") + "'"
        )  # Hydra doubles only backslashes before a quote
    if isinstance(value, list | tuple):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {format_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as a Hydra override")
