"""Stages by reference, so a worker in another process (or on another node) can find the same one.

A reference is either a registered stage name (`filter`, see kiln.stage.STAGE_MODULES) or
`package.module:ATTRIBUTE` for a module-level `Stage`.
"""

from __future__ import annotations

import importlib
import sys

from kiln.stage import STAGE_MODULES, Stage, get_stage


def stage_ref(stage: Stage | str) -> str:
    """The reference that `resolve_stage` turns back into this stage."""
    if isinstance(stage, str):
        return stage
    module = sys.modules.get(stage.fn.__module__)
    for attr, value in vars(module or object()).items():
        if value is stage:
            return f"{stage.fn.__module__}:{attr}"
    if stage.name in STAGE_MODULES:
        return stage.name
    raise ValueError(
        f"stage {stage.name!r} is not a module-level attribute of {stage.fn.__module__}; "
        "workers in other processes import stages by reference, so define it at module level"
    )


def resolve_stage(ref: str) -> Stage:
    if ":" not in ref:
        return get_stage(ref)
    module, attr = ref.split(":", 1)
    stage = getattr(importlib.import_module(module), attr)
    if not isinstance(stage, Stage):
        raise TypeError(f"{ref} is a {type(stage).__name__}, not a kiln.stage.Stage")
    return stage
