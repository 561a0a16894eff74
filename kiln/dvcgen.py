"""dvc.yaml and params.yaml, generated from the lineage (kiln.lineage) and the default config.

Each DVC stage calls the same CLI the other doors do. Its deps are what it reads under data/, the files the
config makes it read (the demo's ground truth, the concept list), and the repo files its code runs
(kiln.lineage.code_files: the stage's module and, transitively, what it imports, config code included).
Its params are its config sections in params.yaml, the composed default config; `make repro` rewrites both
files first (`kiln dvc write`), so an edit under conf/ reruns exactly the stages whose sections changed.
A test keeps the committed files equal to what this renders.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from kiln.lineage import DATA_STEPS, PACK, code_files, default_config, stage_code_files, step_overrides
from kiln.paths import REPO_ROOT

DATA = "data"


def _stage(cmd: str, deps: list[str], params: list[str], outs: list, **extra) -> dict:
    st: dict = {"cmd": cmd, "deps": list(dict.fromkeys(deps))}
    if params:
        st["params"] = params
    st["outs"] = outs
    st.update(extra)
    return st


def _config_files(key: str, cfg) -> list[str]:
    """Files outside data/ that a step's config makes it read."""
    files = []
    if key in ("captioned", "clustered") and cfg.data.caption.captioner == "scene_metadata":
        files.append(cfg.data.caption.truth)
    return files


def _source_stages(cfg) -> dict:
    uses_demo = "demo" in ([cfg.data.source] if isinstance(cfg.data.source, str) else list(cfg.data.source or []))
    stages: dict = {}
    if uses_demo:
        stages["demo_corpus"] = _stage(f"kiln demo-data --out {DATA}/raw", list(code_files("assets.demo_corpus")), ["data.demo"], [f"{DATA}/raw"])
    deps = ([f"{DATA}/raw"] if uses_demo else []) + list(code_files("assets.source"))
    stages["raw_images"] = _stage(f"kiln source --out {DATA}/source", deps, ["data.source"], [f"{DATA}/source"], always_changed=True)
    return stages


def _data_stages(cfg) -> dict:
    stages: dict = {}
    for s in DATA_STEPS:
        cmd = " ".join([f"kiln stage {s.stage} --input {DATA}/{s.reads} --output {DATA}/{s.key}", *step_overrides(s, DATA, cfg.train.mix)])
        inputs = [f"{DATA}/{s.upstream if s.upstream_path is None else s.upstream_path.split('/')[0]}"]
        inputs += [f"{DATA}/{d}" for d in s.extra_deps if d != "mixes" or (s is PACK and cfg.train.mix)]
        stages[s.key] = _stage(cmd, inputs + _config_files(s.key, cfg) + list(stage_code_files(s.stage)), list(s.params), [f"{DATA}/{s.key}"])
    return stages


def _pool_stages(cfg) -> dict:
    return {
        "coverage": _stage(
            f"kiln coverage --input {DATA}/rewritten --out {DATA}/coverage",
            [f"{DATA}/rewritten", cfg.data.concepts.path, *code_files("assets.concepts")],
            ["data.concepts"],
            [f"{DATA}/coverage"],
        ),
        "mixes": _stage(
            f"kiln mixes --input {DATA}/rewritten --out {DATA}/mixes --weights {DATA}/coverage/weights.parquet",
            [f"{DATA}/rewritten", f"{DATA}/coverage", *code_files("assets.mixes")],
            ["data.mixes"],
            [f"{DATA}/mixes"],
        ),
    }


def _training_stages(cfg) -> dict:
    history = cfg.metrics.history
    eval_outs: list = [f"{DATA}/eval"]
    if history:
        eval_outs.append({str(Path(history).parent): {"persist": True, "cache": False}})  # one row per evaluated checkpoint
    return {
        "checkpoint": _stage(
            f"kiln train --data {DATA}/train_set --out {DATA}/checkpoint",
            [f"{DATA}/train_set", *code_files("training.trainer")],
            ["seed", "model", "train", "data.rewrite.form_probs"],
            [f"{DATA}/checkpoint"],
        ),
        "samples": _stage(
            f"kiln sample --checkpoint {DATA}/checkpoint --out {DATA}/samples",
            [f"{DATA}/checkpoint", *code_files("training.sampling")],
            ["train.sample"],
            [f"{DATA}/samples"],
        ),
        "evaluation": _stage(
            f"kiln eval --checkpoint {DATA}/checkpoint --data {DATA}/train_set --out {DATA}/eval",
            [f"{DATA}/checkpoint", f"{DATA}/train_set", *code_files("training.evaluate")],
            ["train.eval", "train.sample", "metrics"],
            eval_outs,
        ),
    }


def render(overrides: list[str] | None = None) -> tuple[str, str]:
    """(dvc.yaml, params.yaml) for the default profile, or for `overrides` (`data=web data.source=s3://...`),
    which every stage's command then carries, so DVC runs what params.yaml says."""
    from kiln.config import load_config

    overrides = list(overrides or [])
    cfg = load_config(overrides) if overrides else default_config()
    stages = {**_source_stages(cfg), **_data_stages(cfg), **_pool_stages(cfg), **_training_stages(cfg)}
    if overrides:
        suffix = " " + " ".join(_quoted(o) for o in overrides)
        stages = {name: {**st, "cmd": st["cmd"] + suffix} for name, st in stages.items()}
    doc = {
        "stages": stages,
        "metrics": [f"{DATA}/{k}/summary.json" for k in ("manifest", *(s.key for s in DATA_STEPS))] + [f"{DATA}/eval/metrics.json"],
        "plots": [
            {"loss": {"template": "linear", "x": "step", "y": {f"{DATA}/checkpoint/loss.csv": ["loss"]}}},
            {"eval_history": {"x": "step", "y": {f"{DATA}/eval/history.csv": ["heldout_loss"]}}},
        ],
    }
    header = "# Generated by `kiln dvc write` from kiln/lineage.py and the default config: edit those, not this file.\n"
    dvc_yaml = header + yaml.safe_dump(doc, sort_keys=False, width=200)
    params = header + yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, width=200)
    return dvc_yaml, params


def _quoted(override: str) -> str:
    import shlex

    return shlex.quote(override)


def write_dvc_files(root: Path = REPO_ROOT, check: bool = False, overrides: list[str] | None = None) -> list[str]:
    """Write dvc.yaml and params.yaml under root; with `check`, write nothing and return the names that differ."""
    stale = []
    for name, text in zip(("dvc.yaml", "params.yaml"), render(overrides), strict=True):
        path = root / name
        if path.exists() and path.read_text() == text:
            continue
        stale.append(name)
        if not check:
            path.write_text(text)
    return stale
