"""The lineage: which artifact each data stage makes from which, in one table every door reads.

A `Step` is one data asset: the stage (kiln.stage) that makes it, the asset it reads, the config sections
that are its parameters, and the great-expectations suite that checks it. Dagster builds an asset per
step (dagster_project.assets), `kiln dvc write` a DVC stage per step (kiln.dvcgen), and the checks and the
code version of each come from the same row. No Dagster import here.

The main chain is the design's: raw images -> manifest -> filtered -> deduped -> embedded -> classified ->
saed -> clustered (review honoured) -> semdeduped -> ocr -> text_filtered -> captioned (OCR-grounded) ->
rewritten -> coverage -> mixes -> train_set -> checkpoint -> samples, evaluation. Each step reads its
upstream's kept rows; nothing beside the chain feeds training.
"""

from __future__ import annotations

import ast
import hashlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

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
    overrides: tuple[str, ...] = ()  # config overrides naming those inputs; `{data}` is the artifact root

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
PACK = Step(
    "train_set", "pack", "rewritten", "training", "train_set", ("data.pack",),
    extra_deps=("coverage", "mixes"), overrides=("data.pack.weights_file={data}/coverage/weights.parquet",),
)  # fmt: skip
BRANCHES = [
    Step("prompt_pairs", "prompt_pairs", "rewritten", "captions", "prompt_pairs", ("data.rewrite",)),
]
DATA_STEPS = [*MAIN_CHAIN, PACK, *BRANCHES]


def step_overrides(s: Step, data_root: str, train_mix: str | None = None) -> list[str]:
    """The overrides that point a step at its extra inputs; a train set restricted to a mix (train.mix) reads it."""
    out = [o.format(data=data_root) for o in s.overrides]
    if "mixes" in s.extra_deps and train_mix:
        out.append(f"data.pack.mix_file={data_root}/mixes/{train_mix}/part-00000.parquet")
    return out


def step(key: str) -> Step:
    for s in DATA_STEPS:
        if s.key == key:
            return s
    raise KeyError(f"no data step {key!r}; steps: {', '.join(s.key for s in DATA_STEPS)}")


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
    """The config `conf/` composes without overrides (the default profile), composed once per process."""
    from kiln.config import load_config

    return load_config()


def step_code_version(s: Step, cfg=None) -> str:
    """A step's Dagster code version: its stage's code files and the values of its config sections under the
    default profile (`conf/`), so editing either marks the asset, and everything after it, stale."""
    from kiln.config import ConfigError

    try:
        cfg = cfg or default_config()
        params = {p: config_section(cfg, p) for p in s.params}
    except (ConfigError, AttributeError):  # no composable default here: the code alone versions the step
        params = {}
    return code_version(stage_code_files(s.stage), params)


def output_hash(folder: Path | str) -> str:
    """The content hash of a step's output folder, computed as DVC computes a directory's (dvc.lock's `md5`):
    md5 over the JSON list of {md5, relpath} of its files, sorted by path, plus `.dir`."""
    import json
    import os

    folder = Path(folder)
    entries = []
    for root, _, files in os.walk(folder):
        for f in files:
            p = Path(root) / f
            entries.append({"md5": hashlib.md5(p.read_bytes()).hexdigest(), "relpath": p.relative_to(folder).as_posix()})
    entries.sort(key=lambda e: e["relpath"])
    return hashlib.md5(json.dumps(entries, sort_keys=True).encode("utf-8")).hexdigest() + ".dir"
