"""`kiln ablate PLAN.yaml`: named override sets x seeds, each a DVC experiment, compared on one protocol.

A plan is base overrides, named variants (each a list of Hydra overrides, the ones `kiln` and
`dvc exp run -S` take) and seeds. Every variant is checked before anything is queued: DVC's own Hydra
composition must accept its overrides (a key conf/ does not set needs `+`) and kiln's config must validate.
Then each variant x seed is queued with `dvc exp run --queue -S ...` and the queue is run (`--run-all`),
so `dvc exp show` lists them; every run ends in the same target stage (the evaluation) and the same
metrics file, which kiln.ablate_report turns into the comparison table and plot.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kiln.config import SEED_MAX
from kiln.errors import UserError

NAME = r"^[a-z0-9][a-z0-9_-]{0,47}$"  # part of a DVC experiment name and of a file name
Override = Annotated[str, Field(min_length=1, max_length=10_000)]
DEFAULT_METRICS = ["heldout_loss.mean", "prompt_following.all", "prompt_following.shape", "prompt_following.color",
                   "prompt_following.position", "prompt_following.count", "checkpoint.final_loss"]  # fmt: skip


class Variant(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(pattern=NAME)
    overrides: list[Override] = Field(
        default_factory=list, max_length=256, description="Hydra overrides on top of the plan's base"
    )


class AblationPlan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(
        pattern=NAME, description="names the experiments (<name>-<variant>-s<seed>) and the output folder"
    )
    description: str = ""
    base: list[Override] = Field(default_factory=list, max_length=256, description="overrides every variant gets first")
    variants: list[Variant] = Field(min_length=2, max_length=64)
    baseline: str | None = Field(None, description="the variant deltas are taken against; default the first")
    seeds: list[Annotated[int, Field(ge=0, le=SEED_MAX)]] = Field(
        default_factory=lambda: [0], min_length=1, max_length=32
    )
    seed_keys: list[str] = Field(
        default_factory=lambda: ["train.seed"], min_length=1, max_length=8, description="keys each seed is written to"
    )
    target: str = Field(
        "evaluation", pattern=r"^[A-Za-z0-9_./:@-]+$", description="the DVC stage every experiment runs to"
    )
    metrics_file: str = Field(
        "data/eval/headline.json",
        description="what the target writes (a metrics file dvc.yaml lists); one protocol for every variant",
    )
    metrics: list[str] = Field(
        default_factory=lambda: list(DEFAULT_METRICS),
        min_length=1,
        max_length=64,
        description="dotted keys of the metrics file",
    )

    @model_validator(mode="after")
    def _names(self) -> AblationPlan:
        names = [v.name for v in self.variants]
        if dupes := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"variant names must be unique; repeated: {', '.join(dupes)}")
        if self.baseline is not None and self.baseline not in names:
            raise ValueError(f"baseline '{self.baseline}' is not a variant ({', '.join(names)})")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds repeat: {self.seeds}")
        return self

    @property
    def baseline_name(self) -> str:
        return self.baseline or self.variants[0].name

    def runs(self) -> list[tuple[Variant, int, str, list[str]]]:
        """(variant, seed, experiment name, overrides) of every run, baseline first. A seed is written with
        `++` (set or add): a lean conf/ leaves a key at its schema default out, and Hydra refuses a plain
        override of a key it does not have."""
        order = sorted(self.variants, key=lambda v: v.name != self.baseline_name)
        return [
            (v, s, f"{self.name}-{v.name}-s{s}", [*self.base, *v.overrides, *(f"++{k}={s}" for k in self.seed_keys)])
            for v in order
            for s in self.seeds
        ]


class _UniqueKeyLoader(__import__("yaml").SafeLoader):
    """yaml.safe_load keeps the last of two equal keys; a plan with a repeated key is refused instead."""


def _no_duplicate_keys(loader, node, deep=False):
    keys = [loader.construct_object(k, deep=deep) for k, _ in node.value]
    if dupes := sorted({str(k) for k in keys if keys.count(k) > 1}):
        raise UserError(f"plan: key repeated in one mapping (line {node.start_mark.line + 1}): {', '.join(dupes)}")
    return loader.construct_mapping(node, deep)


_UniqueKeyLoader.add_constructor(__import__("yaml").resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicate_keys)


def load_plan(path: Path) -> AblationPlan:
    import yaml

    if not path.is_file():
        raise UserError(f"no ablation plan at {path}")
    try:
        raw = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not YAML: {e}") from None
    try:
        return AblationPlan.model_validate(raw)
    except ValidationError as e:
        lines = [
            f"  {'.'.join(str(p) for p in err['loc']) or '(plan)'}: {err['msg'].removeprefix('Value error, ')}"
            for err in e.errors()
        ]
        raise UserError(f"invalid ablation plan {path}:\n" + "\n".join(lines)) from None


def check_plan(plan: AblationPlan, root: Path) -> None:
    """Refuse, before anything is queued, a plan a run would fail on: an override DVC's Hydra composition
    rejects (an unknown key, a sweep), a config kiln refuses, a target stage dvc.yaml lacks."""
    import yaml
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from kiln.config import ConfigError, load_config

    stages = (
        (yaml.safe_load((root / "dvc.yaml").read_text()) or {}).get("stages", {})
        if (root / "dvc.yaml").is_file()
        else {}
    )
    if plan.target not in stages:
        raise UserError(
            f"plan {plan.name}: target stage '{plan.target}' is not in {root / 'dvc.yaml'} (stages: {', '.join(stages) or 'none'})"
        )
    parser = OverridesParser.create()
    for variant, seed, _, overrides in plan.runs():
        where = f"plan {plan.name}, variant {variant.name}"
        for o in overrides:
            try:
                parsed = parser.parse_override(o)
            except HydraException as e:
                raise UserError(f"{where}: override '{o}' is not a Hydra override: {e}") from None
            if parsed.is_sweep_override():
                raise UserError(f"{where}: override '{o}' is a sweep; give each value its own variant")
        try:
            composed = dvc_compose(root, overrides)
        except Exception as e:  # Hydra's and OmegaConf's errors, as `dvc exp run -S` would meet them
            hint = (
                " (a key conf/ does not set is added with '+': +section.key=value)"
                if "not in struct" in str(e) and "+" not in str(e)
                else ""
            )
            raise UserError(f"{where}: DVC's Hydra composition refuses {overrides}: {e}{hint}") from None
        try:
            load_config(overrides)
        except ConfigError as e:
            raise UserError(f"{where}: {e}") from None
        if seed == plan.seeds[0] and not composed:
            raise UserError(f"{where}: composed to an empty config")


def dvc_compose(root: Path, overrides: list[str]) -> dict:
    """What `dvc exp run -S ...` writes to params.yaml, from the repo's .dvc/config Hydra settings."""
    import yaml
    from dvc.repo import Repo
    from dvc.utils.hydra import compose_and_dump

    with Repo(str(root)) as repo:
        hydra = repo.config.get("hydra", {})
    if not hydra.get("enabled"):
        raise UserError(
            f"{root}/.dvc/config: Hydra is not enabled (dvc config hydra.enabled true), so `-S` would not compose conf/"
        )
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Hydra's version_base notice, which dvc triggers
        out = Path(tmp) / "params.yaml"
        compose_and_dump(
            out,
            str(root / hydra.get("config_dir", "conf")),
            None,
            hydra.get("config_name", "config"),
            str(root / hydra.get("plugins_path", "")),
            overrides,
        )
        return yaml.safe_load(out.read_text()) or {}


def _dvc(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    dvc = shutil.which("dvc", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if dvc is None:
        raise UserError("dvc is not installed (pip install dvc)")
    env = {
        **os.environ,
        "DVC_NO_ANALYTICS": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    proc = subprocess.run([dvc, *args], cwd=root, env=env, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise UserError(
            f"`dvc {' '.join(args)}` failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()[-2000:]}"
        )
    return proc


def existing_experiments(root: Path) -> set[str]:
    proc = _dvc(root, "exp", "ls", "--name-only", check=False)
    return (
        {line.strip() for line in proc.stdout.splitlines() if line.strip() and not line.startswith(" ")}
        if proc.returncode == 0
        else set()
    )


def run_plan(plan: AblationPlan, root: Path, jobs: int = 1, force: bool = False, log=print) -> list[str]:
    """Queue every variant x seed as a DVC experiment and run the queue; return the experiment names."""
    runs = plan.runs()
    taken = existing_experiments(root) & {name for *_, name, _ in runs}
    if taken and not force:
        raise UserError(
            f"experiments {', '.join(sorted(taken))} already exist on this commit: --force reruns them, or rename the plan"
        )
    for _variant, _seed, name, overrides in runs:
        args = [
            "exp",
            "run",
            "--queue",
            "-n",
            name,
            *(["-f"] if force else []),
            *(a for o in overrides for a in ("-S", o)),
            plan.target,
        ]
        _dvc(root, *args)
        log(f"queued {name}: {' '.join(overrides)}")
    log(f"running {len(runs)} experiments ({jobs} at a time); `dvc queue status` and `dvc queue logs NAME` follow them")
    proc = _dvc(root, "exp", "run", "--run-all", "-j", str(jobs), check=False)
    if proc.returncode != 0 or "Failed to reproduce" in proc.stderr + proc.stdout:
        raise UserError(
            f"some experiments failed (`dvc queue logs NAME` says why): {(proc.stderr + proc.stdout).strip()[-2000:]}"
        )
    return [name for *_, name, _ in runs]


def collect(plan: AblationPlan, root: Path) -> list[dict]:
    """One record per run: variant, seed, experiment, and each plan metric read from the experiment's
    metrics file (`dvc exp show`), so the table is what DVC recorded, not what this process saw."""
    import json

    shown = json.loads(_dvc(root, "exp", "show", "--json").stdout or "[]")
    by_name = {}
    for commit in shown:
        for exp in commit.get("experiments") or []:
            for rev in exp.get("revs") or []:
                if rev.get("name"):
                    by_name[rev["name"]] = rev
    records = []
    for variant, seed, name, overrides in plan.runs():
        rev = by_name.get(name)
        if rev is None:
            raise UserError(f"experiment {name} is not in `dvc exp show`: did its run fail? (`dvc queue logs {name}`)")
        data = _metrics_of(rev, plan.metrics_file)
        if data is None:
            raise UserError(
                f"experiment {name} has no {plan.metrics_file}: does target '{plan.target}' write it, and does dvc.yaml list it under metrics?"
            )
        row = {"variant": variant.name, "seed": seed, "experiment": name, "overrides": " ".join(overrides)}
        for key in plan.metrics:
            row[key] = _dotted(data, key)
        records.append(row)
    return records


def _metrics_of(rev: dict, metrics_file: str) -> dict | None:
    metrics = (rev.get("data") or {}).get("metrics") or {}
    for path, entry in metrics.items():
        if Path(path).as_posix() == Path(metrics_file).as_posix():
            return (entry or {}).get("data")
    return None


def _dotted(data: dict, key: str) -> float | None:
    """data[key] for a dotted key whose parts may hold dots themselves (`heldout_loss.t=0.1`)."""
    node, rest = data, key
    while rest:
        if not isinstance(node, dict):
            return None
        part = next(
            (k for k in sorted(map(str, node), key=len, reverse=True) if rest == k or rest.startswith(k + ".")), None
        )
        if part is None:
            return None
        node, rest = node[part], rest[len(part) + 1 :]
    return float(node) if isinstance(node, int | float) and not isinstance(node, bool) else None


def ablate(
    plan_path: Path, out: Path | None = None, root: Path | None = None, jobs: int = 1, force: bool = False, log=print
) -> dict[str, Path]:
    """Check the plan, run it as DVC experiments, write the comparison; return the written files."""
    from kiln.ablate_report import write_report

    root = (root or Path.cwd()).resolve()
    plan = load_plan(plan_path)
    if not (root / ".dvc").is_dir():
        raise UserError(f"{root} is not a DVC repository (no .dvc/): run kiln ablate from the repo root")
    check_plan(plan, root)
    run_plan(plan, root, jobs=jobs, force=force, log=log)
    records = collect(plan, root)
    out = out or root / "data" / "ablations" / plan.name
    return write_report(records, plan.metrics, plan.baseline_name, out, plan.name, plan.description)
