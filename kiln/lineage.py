"""What versions each node of the registry (kiln.registry): the repo files its code runs, the files outside the
data root it reads, its config sections and its call (arguments, options, overrides). Dagster hashes these
into a node's code version; DVC lists the same files as deps, the same sections as params and the call as the
stage's command; so an edit marks the same nodes stale through either door.

A node's data version is the content hash of its output folder, the md5 DVC records (kiln.outputs.output_hash).
The graph is built for the profile in KILN_OVERRIDES (`kiln run` sets it from its own arguments; set it for
`dagster dev` to see a profile's ladder and code versions). No Dagster import here.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shlex
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from kiln.paths import PACKAGES, REPO_ROOT
from kiln.registry import DATA, Node


def graph_overrides() -> list[str]:
    """The overrides of the profile the graph is built for (KILN_OVERRIDES, shell-quoted), default none."""
    return shlex.split(os.environ.get("KILN_OVERRIDES", ""))


@lru_cache(maxsize=1)
def default_config():
    """The config of the graph's profile (`conf/` with KILN_OVERRIDES), composed once per process."""
    from kiln.config import load_config

    return load_config(graph_overrides())


# ----------------------------------------------------------------------------------------------- code
def _module_file(module: str) -> Path | None:
    base = REPO_ROOT / Path(*module.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _local_imports(path: Path) -> set[str]:
    """Modules of this repo that a file imports, at the top or inside functions (lazy imports count)."""
    return set(_imports_in(str(path), path.stat().st_mtime_ns))


@lru_cache(maxsize=None)
def _imports_in(path: str, mtime_ns: int) -> frozenset[str]:
    """One parse per file and version of it, however many modules reach it."""
    tree = ast.parse(Path(path).read_text(), path)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return frozenset(m for m in found if m.split(".")[0] in PACKAGES and _module_file(m))


@lru_cache(maxsize=None)
def code_files(module: str) -> tuple[str, ...]:
    """The repo files a module's code runs: itself and what it imports, transitively (repo-relative, sorted)."""
    seen: set[Path] = set()
    todo = [module]
    while todo:
        f = _module_file(todo.pop())
        if f is None or f in seen:
            continue
        seen.add(f)
        todo.extend(_local_imports(f))
    return tuple(sorted(p.relative_to(REPO_ROOT).as_posix() for p in seen))


def config_section(cfg, dotted: str):
    """The value of a dotted config key (`data.filters`) of a KilnConfig, as plain data."""
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj.model_dump(mode="json") if hasattr(obj, "model_dump") else obj


# ---------------------------------------------------------------------------------------------- nodes
@dataclass(frozen=True)
class VersionInputs:
    """Everything besides its input data that decides a node's output, as both doors see it."""

    files: tuple[str, ...]  # code files, then the files outside the data root it reads (conf/train/*.yaml)
    params: tuple[str, ...]  # config sections: their values, composed under the profile, version it
    call: tuple[
        str, ...
    ]  # its own arguments: positional, the paths it reads, options, its rung's overrides (DATA_ROOT: the root)


def node_code_files(node: Node) -> tuple[str, ...]:
    return tuple(sorted({f for m in node.modules for f in code_files(m)}))


def call_args(node: Node, user: list[str], data_root: str) -> list[str]:
    """The node's command line after `kiln COMMAND`: what DVC runs, and what Dagster's code version hashes."""
    cmd, args = node.cmd, [*node.positional]
    for arg in cmd.inputs:
        args += [x for p in node.paths(arg.name) for x in (f"--{arg.name}", f"{data_root}/{p}")]
    args += [f"--{cmd.out}", f"{data_root}/{node.folder}"]
    for name, value in node.options:
        args += [f"--{name}"] if value is True else [f"--{name}", str(value)]
    return args + node.overrides(user, data_root)


def version_inputs(node: Node) -> VersionInputs:
    """The profile's own overrides are not among them: they reach a node through its sections' values (DVC:
    params.yaml; Dagster: the config composed under the profile), so an override of one section marks only
    the nodes that read it stale."""
    return VersionInputs(node_code_files(node) + node.files, node.params, tuple(call_args(node, [], DATA)))


def node_code_version(node: Node, user: list[str] | None = None) -> str:
    """A node's Dagster code version: its version inputs, the bytes of its files and the values of its
    sections in the config it composes (its rung's, for a ladder node) under the graph's profile."""
    from kiln.config import ConfigError

    vi = version_inputs(node)
    try:
        values = node_params(node, user)
    except ConfigError:  # a profile that does not compose here (a model path of another machine): code and call alone
        values = {}
    return code_version(vi.files, {"params": values, "call": list(vi.call)})


def node_params(node: Node, user: list[str] | None = None) -> dict:
    """The values of a node's config sections in the config it composes under the profile (`user`, default the
    graph's): what DVC reads from params.yaml."""
    from kiln.config import load_config

    cfg = load_config(node.overrides(graph_overrides() if user is None else user, DATA))
    return {p: config_section(cfg, p) for p in node.params}


def code_version(files: tuple[str, ...], params: dict | None = None) -> str:
    """A hash of the bytes of `files` (repo-relative) and of `params`."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.encode() + b"\0" + (REPO_ROOT / f).read_bytes() + b"\0")
    if params:
        h.update(json.dumps(params, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]
