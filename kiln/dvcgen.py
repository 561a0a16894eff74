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

from kiln.ladder import FINAL, MERGED, checkpoint_overrides, domain_rungs, post_base, rungs
from kiln.lineage import code_files, data_steps, stage_code_files, step_config_overrides
from kiln.paths import REPO_ROOT

DATA = "data"
# What `kiln train` and `kiln eval` read, as params: `dvc exp run -S train.steps=50` must rerun them (a stage
# whose params did not change is restored from DVC's run cache, whatever params.yaml now says).
TRAIN_PARAMS = ["model", "train", "ladder", "data.rewrite.form_probs"]
EVAL_PARAMS = ["train.eval", "train.sample", "train.timestep_shift", "train.timestep_max_shift", "metrics", "post.judge", "post.eval_prompts"]


def train_files(name: str) -> list[str]:
    """conf/train/<name>.yaml and the files of its group that its Hydra `defaults` list pulls in (a shared
    `_ladder_base`), bases first: an edit of a base reruns every rung built on it."""
    path = REPO_ROOT / "conf" / "train" / f"{name}.yaml"
    own = f"conf/train/{name}.yaml"
    data = yaml.safe_load(path.read_text()) if path.is_file() else None
    bases = [b for b in (data or {}).get("defaults", []) if isinstance(b, str) and b != "_self_"]
    return [f for base in bases for f in train_files(base)] + [own]


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


def _source_stages(cfg, user: list[str]) -> dict:
    uses_demo = "demo" in ([cfg.data.source] if isinstance(cfg.data.source, str) else list(cfg.data.source or []))
    stages: dict = {}
    if uses_demo:
        stages["demo_corpus"] = _stage(_cmd(f"kiln demo-data --out {DATA}/raw", user), list(code_files("assets.demo_corpus")), ["data.demo"], [f"{DATA}/raw"])
    deps = ([f"{DATA}/raw"] if uses_demo else []) + list(code_files("assets.source"))
    stages["raw_images"] = _stage(_cmd(f"kiln source --out {DATA}/source", user), deps, ["data.source"], [f"{DATA}/source"], always_changed=True)
    return stages


def _cmd(base: str, overrides: list[str]) -> str:
    return " ".join([base, *(_quoted(o) for o in overrides)])


def _data_stages(cfg, user: list[str]) -> dict:
    stages: dict = {}
    for s in data_steps(cfg):
        cmd = _cmd(f"kiln stage {s.stage} --input {DATA}/{s.reads} --output {DATA}/{s.key}", step_config_overrides(s, DATA, user))
        inputs = [f"{DATA}/{s.upstream if s.upstream_path is None else s.upstream_path.split('/')[0]}"]
        inputs += [f"{DATA}/{d}" for d in s.extra_deps]
        rung_files = train_files(s.rung.train) if s.rung else []
        params = list(s.params) + (["train"] if s.rung else [])  # a rung's train set reads its train config (batch size, mix)
        stages[s.key] = _stage(cmd, inputs + _config_files(s.key, cfg) + rung_files + list(stage_code_files(s.stage)), params, [f"{DATA}/{s.key}"])
    return stages


def _pool_stages(cfg, user: list[str]) -> dict:
    return {
        "coverage": _stage(
            _cmd(f"kiln coverage --input {DATA}/rewritten --out {DATA}/coverage", user),
            [f"{DATA}/rewritten", cfg.data.concepts.path, *code_files("assets.concepts")],
            ["data.concepts"],
            [f"{DATA}/coverage"],
        ),
        "mixes": _stage(
            _cmd(f"kiln mixes --input {DATA}/rewritten --out {DATA}/mixes --weights {DATA}/coverage/weights.parquet", user),
            [f"{DATA}/rewritten", f"{DATA}/coverage", *code_files("assets.mixes")],
            ["data.mixes"],
            [f"{DATA}/mixes"],
        ),
    }


def _rung_stages(ladder, user: list[str]) -> dict:
    """`kiln train` per rung (of the ladder, or the domain SFT rungs), from the checkpoint its rung starts from."""
    stages = {}
    for r in ladder:
        deps = [f"{DATA}/{r.train_set}", *([f"{DATA}/{r.start}"] if r.start else []), *train_files(r.train), *code_files("training.trainer")]
        cmd = _cmd(f"kiln train --data {DATA}/{r.train_set} --out {DATA}/{r.checkpoint}", checkpoint_overrides(r, user, DATA))
        stages[r.checkpoint] = _stage(cmd, deps, TRAIN_PARAMS, [f"{DATA}/{r.checkpoint}"])
    return stages


def evaluation_outs(history: str | None) -> list:
    """The evaluation's outputs: data/eval, and the history kept across checkpoints (`metrics.history`), which
    each run reads and rewrites: persisted (DVC does not delete it before the run) and cached (`dvc checkout`
    and an experiment's workspace restore it; an uncached output made DVC rerun the stage wherever the file
    was missing). Kept outside data/, it also outlives `rm -rf data`. A persisted output keeps DVC's run cache
    off for this stage: the history depends on the runs before."""
    return [f"{DATA}/eval", *([{history: {"persist": True}}] if history else [])]


def _training_stages(cfg, user: list[str]) -> dict:
    eval_outs = evaluation_outs(cfg.metrics.history)
    ladder = rungs(cfg)
    stages: dict = _rung_stages(ladder, user)
    eval_set = ladder[0].train_set  # its held-out rows are the ones no rung trained on
    stages[FINAL] = _stage(
        _cmd(f"kiln pma --run {DATA}/{ladder[-1].checkpoint} --out {DATA}/{FINAL}", user),
        [f"{DATA}/{ladder[-1].checkpoint}", *code_files("training.final_checkpoint")],
        ["ladder"],
        [f"{DATA}/{FINAL}"],
    )
    stages["samples"] = _stage(
        _cmd(f"kiln sample --checkpoint {DATA}/{FINAL} --out {DATA}/samples", user),
        [f"{DATA}/{FINAL}", *code_files("training.sampling")],
        ["train.sample"],
        [f"{DATA}/samples"],
    )
    stages["evaluation"] = _stage(
        _cmd(f"kiln eval --checkpoint {DATA}/{FINAL} --data {DATA}/{eval_set} --out {DATA}/eval", user),
        [f"{DATA}/{FINAL}", f"{DATA}/{eval_set}", *code_files("training.evaluate")],
        EVAL_PARAMS,
        eval_outs,
    )
    return stages


def _post_stages(cfg, user: list[str]) -> dict:
    """Post-training after `checkpoint` (dagster_project/domains.py, post_training.py): the domain SFT rungs and
    their merge, then pairs, reward model, DPO and GRPO from the merge (or from `checkpoint` without domains),
    then the TDM student from GRPO."""
    d, base = DATA, post_base(cfg)
    domains = domain_rungs(cfg)
    stages = _rung_stages(domains, user)
    if domains:
        stages[MERGED] = _stage(_cmd(f"kiln merge-domains --base {d}/{FINAL} --out {d}/{MERGED} " + " ".join(f"--source {d}/{r.checkpoint}" for r in domains), user),
                                [f"{d}/{FINAL}", *(f"{d}/{r.checkpoint}" for r in domains), *code_files("training.merge"), *code_files("training.domains")],
                                ["post.merge", "ladder", "train.eval", "train.sample"], [f"{d}/{MERGED}"])
    return stages | {
        "preference_pairs": _stage(_cmd(f"kiln pairs --checkpoint {d}/{base} --out {d}/preference_pairs", user),
                                   [f"{d}/{base}", *code_files("training.pairs")], ["post", "train.sample"], [f"{d}/preference_pairs"]),
        "reward_model": _stage(_cmd(f"kiln reward-model --pairs {d}/preference_pairs --out {d}/reward_model", user),
                               [f"{d}/preference_pairs", *code_files("training.reward_model")], ["data.embed"], [f"{d}/reward_model"]),
        "checkpoint_dpo": _stage(_cmd(f"kiln dpo --checkpoint {d}/{base} --pairs {d}/preference_pairs --out {d}/checkpoint_dpo", user),
                                 [f"{d}/{base}", f"{d}/preference_pairs", *code_files("training.dpo_train")], ["post"], [f"{d}/checkpoint_dpo"]),
        "checkpoint_grpo": _stage(_cmd(f"kiln grpo --checkpoint {d}/checkpoint_dpo --out {d}/checkpoint_grpo", user),
                                  [f"{d}/checkpoint_dpo", *code_files("training.grpo_train")], ["post"], [f"{d}/checkpoint_grpo"]),
        "checkpoint_student": _stage(_cmd(f"kiln distill --checkpoint {d}/checkpoint_grpo --out {d}/checkpoint_student", user),
                                     [f"{d}/checkpoint_grpo", *code_files("training.tdm_train")], ["post"], [f"{d}/checkpoint_student"]),
    }  # fmt: skip


# `dvc metrics show`: the evaluation's headline, one short row. A data step's counts and reject reasons are in
# its summary.json (`dvc metrics show data/filtered/summary.json`), the whole evaluation in data/eval/metrics.json.
METRICS = [f"{DATA}/eval/headline.json"]


def _plots(cfg) -> list:
    """`dvc plots show`: first the PNGs the stages draw (matplotlib, offline; the page then needs no network),
    then the same curves as vega plots for `dvc plots diff` across experiments (vega loads from a CDN). The
    evaluation history uses .dvc/plots/points.json, points without smoothing: the default template's loess
    has nothing to fit on one checkpoint's row and drew heldout_loss as 0."""
    history = f"{DATA}/eval/history.csv"
    return [
        *(f"{DATA}/{r.checkpoint}/loss.png" for r in rungs(cfg)),
        f"{DATA}/eval/history.png",
        f"{DATA}/eval/prompt_following.png",
        *({f"loss_{r.name}": {"template": "linear", "x": "step", "y": {f"{DATA}/{r.checkpoint}/loss.csv": ["loss"]}}} for r in rungs(cfg)),
        {"eval_heldout_loss": {"template": "points", "x": "step", "y": {history: ["heldout_loss"]}}},
        {"eval_prompt_following": {"template": "points", "x": "step", "y": {history: ["prompt_following", "baseline_prompt_following"]}}},
    ]


def render(overrides: list[str] | None = None) -> tuple[str, str]:
    """(dvc.yaml, params.yaml) for the default profile, or for `overrides` (`data=web data.source=s3://...`),
    which every stage's command then carries, so DVC runs what params.yaml says."""
    from kiln.config import load_config

    overrides = list(overrides or [])
    cfg = load_config(overrides)
    stages = {**_source_stages(cfg, overrides), **_data_stages(cfg, overrides), **_pool_stages(cfg, overrides), **_training_stages(cfg, overrides), **_post_stages(cfg, overrides)}
    doc = {
        "stages": stages,
        "metrics": METRICS,
        "plots": _plots(cfg),
    }
    composed = hydra_params(overrides)
    for st in stages.values():
        if "params" in st:
            st["params"] = present_params(st["params"], composed)
    header = "# Generated by `kiln dvc write` from kiln/lineage.py and the default config: edit those, not this file.\n"
    dvc_yaml = header + yaml.safe_dump(doc, sort_keys=False, width=200)
    return dvc_yaml, _params_yaml(composed)


def hydra_params(overrides: list[str] | None = None) -> dict:
    """conf/ composed by Hydra, as `dvc exp run` (Hydra enabled in .dvc/config) writes it to params.yaml:
    what conf/ sets, not the schema's defaults."""
    from kiln.config import compose_raw

    return compose_raw(list(overrides or []))[0]


def _params_yaml(composed: dict) -> str:
    """No header: `dvc exp run` rewrites the file with OmegaConf.to_yaml, and must find it unchanged."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(composed))


def present_params(keys: list[str], composed: dict) -> list[str]:
    """A stage's params as keys params.yaml (the composition) has: each key or its nearest section, and no key
    whose section is listed too."""
    out = list(dict.fromkeys(_present_key(k, composed) for k in keys))
    return [k for k in out if not any(k.startswith(other + ".") for other in out)]


def _present_key(key: str, composed: dict) -> str:
    """`key`, or its nearest section that params.yaml has: DVC refuses a stage whose param is missing, and a
    section conf/ leaves to the schema's defaults (data.ingest) is pinned by the code (kiln/config/, a dep)
    until conf/ or `-S +data.ingest.x=...` sets it under a section that is there."""
    parts, node = key.split("."), composed
    for i, part in enumerate(parts):
        if not isinstance(node, dict) or part not in node:
            return ".".join(parts[:i]) or key
        node = node[part]
    return key


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
