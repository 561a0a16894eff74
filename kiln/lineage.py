"""The lineage: which artifact each data stage makes from which, in one table every door reads.

A `Step` is one data asset: the stage (kiln.stage) that makes it, the asset it reads, the config sections
that are its parameters, and the great-expectations suite that checks it. Dagster builds an asset per
step (dagster_project.assets), `kiln dvc write` a DVC stage per step (kiln.dvcgen), and the checks and the
code version of each come from the same row. No Dagster import here.

The main chain is the design's: raw images -> manifest -> filtered -> deduped -> embedded -> classified ->
saed -> clustered (review honoured) -> semdeduped -> ocr -> text_filtered -> captioned (OCR-grounded) ->
rewritten -> coverage -> mixes -> a train set and a checkpoint per ladder rung (kiln.ladder) -> checkpoint
(the PMA of the last rung) -> samples, evaluation. Each step reads its upstream's kept rows; nothing beside
the chain feeds training.

The rungs come from the config's `ladder`, so the graph is the one of the profile it is built for:
`conf/` composed with the overrides in KILN_OVERRIDES (`kiln run` sets it from its own arguments; set it
for `dagster dev` to see a profile's ladder and code versions).
"""

from __future__ import annotations

import ast
import hashlib
import os
import shlex
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from kiln.ladder import Rung, all_rungs, train_set_overrides
from kiln.paths import REPO_ROOT


@dataclass(frozen=True)
class Step:
    key: str  # the asset key, the DVC stage name and the folder under data/
    stage: str  # the kiln stage that makes it (kiln.stage.STAGE_MODULES)
    upstream: str  # the asset it reads
    group: str  # Dagster group
    suite: str  # great-expectations suite of its kept rows (assets.expectations)
    params: tuple[str, ...] = ()  # config sections that change its output (dotted, e.g. data.filters)
    upstream_path: str | None = None  # what it reads, under data/; default: the upstream's folder
    extra_deps: tuple[str, ...] = ()  # other assets it reads (coverage weights, mixes)
    rung: Rung | None = None  # a ladder rung's train set: its config comes from kiln.ladder

    @property
    def reads(self) -> str:
        return self.upstream_path or self.upstream


MAIN_CHAIN = [
    Step("manifest", "ingest", "raw_images", "curation", "manifest", ("data.ingest",), upstream_path="source/listing.parquet"),
    Step("filtered", "filter", "manifest", "curation", "filtered", ("data.filters",)),
    Step("deduped", "dedup", "filtered", "curation", "deduped", ("data.dedup",)),
    Step("embedded", "embed", "deduped", "curation_models", "embedded", ("data.embed",)),
    Step("classified", "classify", "embedded", "curation_models", "embedded", ("data.classify",)),
    Step("saed", "sae", "classified", "curation_models", "embedded", ("data.sae",)),
    Step("clustered", "cluster", "saed", "curation_models", "clustered", ("data.clustering", "data.caption")),
    Step("semdeduped", "semdedup", "clustered", "curation_models", "deduped", ("data.clustering.semdedup_threshold",)),
    Step("ocr", "ocr", "semdeduped", "captions", "ocred", ("data.ocr",)),
    Step("text_filtered", "text_filter", "ocr", "captions", "ocred", ("data.ocr",)),
    Step("captioned", "caption_ocr", "text_filtered", "captions", "ocr_captioned", ("data.caption", "data.ocr.engine")),
    Step("rewritten", "rewrite", "captioned", "captions", "rewritten", ("data.rewrite",)),
]
BRANCHES = [
    Step("prompt_pairs", "prompt_pairs", "rewritten", "captions", "prompt_pairs", ("data.rewrite",)),
    Step("user_prompts", "user_prompts", "prompt_pairs", "captions", "prompt_pairs", ("data.user_prompts",)),
]


def graph_overrides() -> list[str]:
    """The overrides of the profile the graph is built for (KILN_OVERRIDES, shell-quoted), default none."""
    return shlex.split(os.environ.get("KILN_OVERRIDES", ""))


def ladder_steps(cfg) -> list[Step]:
    """A train set per ladder rung and per domain SFT rung (Dagster group post_training): the pack stage over
    rewritten at the rung's resolution and mix."""
    return [
        Step(r.train_set, "pack", "rewritten", "post_training" if r.domain else "training", "train_set", ("data.pack", "ladder"), extra_deps=("coverage", "mixes"), rung=r)
        for r in all_rungs(cfg)
    ]


def data_steps(cfg=None) -> list[Step]:
    """Every data step of the graph: the main chain, the ladder's train sets, the branches."""
    return [*MAIN_CHAIN, *ladder_steps(cfg or default_config()), *BRANCHES]


def step_config_overrides(s: Step, data_root: str, user: list[str]) -> list[str]:
    """All the overrides a step composes its config from: the user's, and a rung's own (kiln.ladder)."""
    return train_set_overrides(s.rung, user, data_root) if s.rung else list(user)


def step(key: str, cfg=None) -> Step:
    steps = data_steps(cfg)
    for s in steps:
        if s.key == key:
            return s
    raise KeyError(f"no data step {key!r}; steps: {', '.join(s.key for s in steps)}")


# ----------------------------------------------------------------------------------- code and versions
def _module_file(module: str) -> Path | None:
    base = REPO_ROOT / Path(*module.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _local_imports(path: Path) -> set[str]:
    """Modules of this repo that a file imports, at the top or inside functions (lazy imports count)."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if m.split(".")[0] in ("kiln", "assets", "model", "training") and _module_file(m)}


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


def stage_code_files(stage: str) -> tuple[str, ...]:
    from kiln.stage import STAGE_MODULES

    return code_files(STAGE_MODULES[stage])


def config_section(cfg, dotted: str):
    """The value of a dotted config key (`data.filters`) of a KilnConfig, as plain data."""
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj.model_dump(mode="json") if hasattr(obj, "model_dump") else obj


def code_version(files: tuple[str, ...], params: dict | None = None) -> str:
    """What decides a step's output besides its input: the bytes of its code files and its parameters."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.encode() + b"\0" + (REPO_ROOT / f).read_bytes() + b"\0")
    if params:
        import json

        h.update(json.dumps(params, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


@lru_cache(maxsize=1)
def default_config():
    """The config of the graph's profile (`conf/` with KILN_OVERRIDES), composed once per process."""
    from kiln.config import load_config

    return load_config(graph_overrides())


def step_code_version(s: Step, cfg=None) -> str:
    """A step's Dagster code version: its stage's code files and the values of its config sections under the
    default profile (`conf/`), so editing either marks the asset, and everything after it, stale."""
    from kiln.config import ConfigError, load_config

    try:
        cfg = cfg or default_config()
        if s.rung:  # a rung's train set: its own composed config, and the overrides that make it
            overrides = step_config_overrides(s, "{data}", graph_overrides())
            cfg = load_config(overrides)
        params = {p: config_section(cfg, p) for p in s.params} | ({"overrides": overrides} if s.rung else {})
    except (ConfigError, AttributeError):  # no composable default here: the code alone versions the step
        params = {}
    return code_version(stage_code_files(s.stage), params)


def asset_code_version(modules: tuple[str, ...], sections: tuple[str, ...] = ()) -> str:
    """The code version of an asset that is not a stage step (coverage, mixes, samples, evaluation): the code
    files of its modules and the values of its config sections under the graph's profile."""
    from kiln.config import ConfigError

    files = tuple(sorted({f for m in modules for f in code_files(m)}))
    try:
        cfg = default_config()
        params = {p: config_section(cfg, p) for p in sections}
    except (ConfigError, AttributeError):  # no composable default here: the code alone versions it
        params = {}
    return code_version(files, params)


VOLATILE_FILES = ("metrics.jsonl", "throughput.json")  # wall-clock records: on disk, outside every content hash (.dvcignore)


def output_hash(folder: Path | str) -> str:
    """The content hash of a step's output folder, computed as DVC computes a directory's (dvc.lock's `md5`):
    md5 over the JSON list of {md5, relpath} of its files, sorted by path, plus `.dir`. The wall-clock
    records (VOLATILE_FILES) are left out, as .dvcignore leaves them out of DVC's, so a rerun of the same
    data and config has the same hash."""
    import json
    import os

    folder = Path(folder)
    entries = []
    for root, _, files in os.walk(folder):
        for f in files:
            if f in VOLATILE_FILES:
                continue
            p = Path(root) / f
            entries.append({"md5": hashlib.md5(p.read_bytes()).hexdigest(), "relpath": p.relative_to(folder).as_posix()})
    entries.sort(key=lambda e: e["relpath"])
    return hashlib.md5(json.dumps(entries, sort_keys=True).encode("utf-8")).hexdigest() + ".dir"
