"""Hydra composes `conf/`; pydantic validates the result, and every error names the key and the file or override
it came from. `load_config` is the one way to get a config."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kiln.config.data import STAND_INS, DataConfig
from kiln.config.model import ModelConfig
from kiln.config.schema import KilnConfig
from kiln.config.train import REPA_CLASSICAL
from kiln.paths import CONF_DIR


class ConfigError(ValueError):
    """A config that does not validate; the message names each bad key and where it came from."""


GROUPS = ("data", "model", "train", "cluster", "metrics", "ladder", "post", "expander")


def conf_dir() -> Path:
    return Path(os.environ.get("KILN_CONF", CONF_DIR))


def _hydra_compose(overrides: list[str]):
    """Hydra's composition in its two steps, the first kept: the config groups' choices (the defaults list, whose
    YAML reads take ~0.3 s) composed once per set of choices and conf files, then the value overrides applied to a
    copy by Hydra's own parser and applier, in order, as `compose` applies them after the defaults list."""
    import copy

    groups = [o for o in overrides if _is_group_override(o)]
    values = [o for o in overrides if not _is_group_override(o)]
    root = conf_dir().resolve()
    cfg = copy.deepcopy(_compose_groups(str(root), tuple(groups), _fingerprint(root)))
    if values:
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra.core.override_parser.overrides_parser import OverridesParser

        ConfigLoaderImpl._apply_overrides_to_config(OverridesParser.create().parse_overrides(overrides=values), cfg)
    return cfg


def _is_group_override(override: str) -> bool:
    """`train=demo`, `+ladder=krea`, `~metrics`: a choice of a config group (a key without dots among GROUPS)."""
    key = override.split("=", 1)[0].lstrip("+~").split("@", 1)[0]
    return key.split("/", 1)[0] in GROUPS and "." not in key


@functools.lru_cache(maxsize=64)
def _compose_groups(root: str, groups: tuple[str, ...], fingerprint: tuple):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=root):
        return compose("config", overrides=list(groups), return_hydra_config=True)


def _add_missing_keys(overrides: list[str]) -> list[str]:
    """`train.parallel.tp=2` where the YAML never wrote `train.parallel` is still a key of the config (a
    pydantic default): Hydra only overrides keys it has, so such overrides become add-or-override
    (`++key=value`, which a second override of the same key may follow). A key that is not in the schema
    either is added too, and validation then names it as unknown."""
    from omegaconf import OmegaConf

    groups = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in GROUPS]
    base = _hydra_compose(groups)
    missing = object()
    out = []
    for o in overrides:
        key = o.split("=", 1)[0]
        if (
            "=" in o
            and not key.startswith(("+", "~"))
            and key not in GROUPS
            and OmegaConf.select(base, key, default=missing) is missing
        ):
            o = "++" + o
        out.append(o)
    return out


def compose_raw(overrides: list[str] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Compose with Hydra; return the plain dict and the chosen option of each group. A composition is kept per
    process for the same overrides over the same files (a change to any file under conf/ composes again): the
    registry composes each node's config, and Hydra takes ~0.4 s a time."""
    import copy

    overrides = list(overrides or [])
    root = conf_dir().resolve()
    raw, choices = _compose_cached(str(root), tuple(overrides), _fingerprint(root))
    return copy.deepcopy(raw), dict(choices)


def _fingerprint(root: Path) -> tuple:
    """What the files under conf/ are now: each one's path, size and modification time."""
    return tuple(sorted((str(p), s.st_size, s.st_mtime_ns) for p in root.rglob("*") if p.is_file() for s in [p.stat()]))


@functools.lru_cache(maxsize=256)
def _compose_cached(root: str, overrides: tuple[str, ...], fingerprint: tuple) -> tuple[dict[str, Any], dict[str, str]]:
    return _compose_uncached(list(overrides))


def _compose_uncached(overrides: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    from hydra.errors import HydraException
    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import OmegaConfBaseException

    try:
        try:
            cfg = _hydra_compose(overrides)
        except HydraException as e:
            if "Could not override" not in str(e):
                raise
            cfg = _hydra_compose(_add_missing_keys(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(f"cannot compose config from {conf_dir()} with overrides {overrides}: {e}") from e
    choices = {k: str(v) for k, v in cfg.hydra.runtime.choices.items() if k in GROUPS}
    with open_dict(cfg):
        del cfg["hydra"]  # its sweep interpolations only resolve inside a Hydra app
    raw = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(raw, dict)
    return raw, choices


def _source_of(loc: tuple[Any, ...], choices: dict[str, str], overrides: list[str]) -> str:
    dotted = ".".join(str(p) for p in loc)
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key in GROUPS:  # `data=web` picks a file; the file is where the key came from
            continue
        if dotted == key or dotted.startswith(key + ".") or key.startswith(dotted + "."):
            return f"override '{o}'"
    group = str(loc[0]) if loc else ""
    if group in choices:
        return str(conf_dir() / group / f"{choices[group]}.yaml")
    return str(conf_dir() / "config.yaml")


def _missing_path(path: str | None) -> str | None:
    """Why a model path cannot be used, or None: unset (Hydra's `???` in a profile: the lab must name it), or a
    local folder that is not there."""
    if not path or path == "???":
        return "is not set"
    if "://" not in path and not Path(path).exists():
        return f"{path} does not exist"
    return None


def _stand_in(key: str, choice: str, stand_in: str, real: str, used: list[str]) -> tuple[str, str] | None:
    if stand_in in used:
        return None
    return (
        key,
        f"{choice} is an offline stand-in ({STAND_INS[stand_in]}); use {real}, or name it in data.stand_ins: [{stand_in}]",
    )


def model_problems(data: DataConfig) -> list[tuple[str, str]]:
    """(key, problem) for each model stage whose model is missing, or that uses a stand-in not named as one.

    Checked when a config is loaded, so a real profile fails before any work rather than hours into a run."""
    used, out = data.stand_ins, []
    if data.source is None or data.source == []:
        out.append(
            (
                "data.source",
                "no source set: `demo`, or uris of folders, prefixes (s3:// gs:// https:// file://), .tar shards, .txt or .parquet lists",
            )
        )
    cap = data.caption
    if cap.captioner == "scene_metadata":
        out.append(
            _stand_in(
                "data.caption.captioner",
                "scene_metadata",
                "scene_metadata_captioner",
                "captioner=vlm with data.caption.vlm_path, or captioner=source",
                used,
            )
        )
    elif cap.captioner == "vlm" and (why := _missing_path(cap.vlm_path)):
        out.append(("data.caption.vlm_path", f"the VLM captioner's model folder {why}"))
    if data.embed.embedder == "classical":
        out.append(
            _stand_in(
                "data.embed.embedder",
                "classical",
                "classical_embedder",
                "embedder=hf with data.embed.path (a SigLIP-2 / DINOv3 class folder)",
                used,
            )
        )
    elif why := _missing_path(data.embed.path):
        out.append(("data.embed.path", f"the embedder's model folder {why}"))
    if data.rewrite.rewriter == "rules":
        out.append(
            _stand_in(
                "data.rewrite.rewriter", "rules", "rules_rewriter", "rewriter=llm with data.rewrite.llm_path", used
            )
        )
    elif why := _missing_path(data.rewrite.llm_path):
        out.append(("data.rewrite.llm_path", f"the LLM rewriter's model folder {why}"))
    if (data.user_prompts.writer or data.rewrite.rewriter) == "rules":
        out.append(
            _stand_in(
                "data.user_prompts.writer",
                "rules",
                "rules_rewriter",
                "writer=llm with data.user_prompts.llm_path",
                used,
            )
        )
    elif why := _missing_path(data.user_prompts.llm_path or data.rewrite.llm_path):
        out.append(
            ("data.user_prompts.llm_path", f"the user-prompt writer's LLM folder {why} (nor is data.rewrite.llm_path)")
        )
    for i, head in enumerate(data.classify.heads):
        if head.labeller == "rules":
            out.append(
                _stand_in(
                    f"data.classify.heads.{i}.labeller",
                    f"rules (head {head.name})",
                    "rules_labeller",
                    "labeller=vlm with a vlm.vlm_path",
                    used,
                )
            )
        elif head.vlm is not None and (why := _missing_path(head.vlm.vlm_path)):
            out.append((f"data.classify.heads.{i}.vlm.vlm_path", f"head {head.name}'s VLM folder {why}"))
    if data.clustering.namer == "vlm" and (why := _missing_path(data.clustering.namer_vlm_path)):
        out.append(("data.clustering.namer_vlm_path", f"the cluster namer's VLM folder {why}"))
    return [p for p in out if p is not None]


def _holds(path: str, key: str, expected: str | None) -> str | None:
    """Why a local model folder is not the class a profile promised (config.json `key`), or None."""
    config = Path(path) / "config.json"
    if expected is None or "://" in path or not config.is_file():
        return None  # an object-store folder, or one without config.json, is the loader's to refuse
    found = json.loads(config.read_text()).get(key)
    return None if found == expected else f"{path} holds {key} {found!r}, not {expected!r}"


def model_path_problems(model: ModelConfig) -> list[tuple[str, str]]:
    """(key, problem) for each folder the DiT's profile names that cannot be used: a latent profile's VAE, a text
    encoder other than the packaged MiniLM, a style-reference encoder by path; and a folder of another class
    than the profile promises (model.autoencoder_class, model.text_encoder.model_type)."""
    out = []
    te = model.text_encoder
    if model.autoencoder == "kl":
        if why := _missing_path(model.autoencoder_path) or _holds(
            model.autoencoder_path or "", "_class_name", model.autoencoder_class
        ):
            out.append(("model.autoencoder_path", f"the VAE folder of model.autoencoder=kl {why}"))
    if te.path is not None and (why := _missing_path(te.path) or _holds(te.path, "model_type", te.model_type)):
        out.append(("model.text_encoder.path", f"the text encoder's folder {why} (null: the packaged MiniLM)"))
    ref = model.reference
    if ref.enabled and ref.encoder == "hf" and (why := _missing_path(ref.encoder_path)):
        out.append(("model.reference.encoder_path", f"the style-reference encoder's folder {why}"))
    return out


def error_keys(err: Any) -> tuple[str, ...]:
    """The keys a PairError names (relative to its model), or () for any other error."""
    return getattr((err.get("ctx") or {}).get("error"), "keys", ())


def validate(
    raw: dict[str, Any], choices: dict[str, str] | None = None, overrides: list[str] | None = None
) -> KilnConfig:
    def line(loc: tuple, what: str, keys: tuple[str, ...] = ()) -> str:
        where = [loc + tuple(k.split(".")) for k in keys] or [loc]  # a PairError: where each of its keys came from
        sources = ", ".join(dict.fromkeys(_source_of(w, choices or {}, overrides or []) for w in where))
        return f"  {'.'.join(str(p) for p in loc)}: {what} (from {sources})"

    try:
        cfg = KilnConfig.model_validate(raw)
    except ValidationError as e:
        lines = [
            line(
                tuple(err["loc"]),
                "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, "),
                error_keys(err),
            )
            for err in e.errors()
        ]
        raise ConfigError("invalid kiln config:\n" + "\n".join(lines)) from None
    problems = model_problems(cfg.data) + model_path_problems(cfg.model)
    if cfg.post.judge == "vlm" and (
        why := _missing_path(cfg.post.judge_vlm_path)
    ):  # the evaluation's prompt following asks it
        problems.append(
            (
                "post.judge_vlm_path",
                f"the rubric judge's VLM folder {why} (post=demo judges demo drawings with the pixel checker)",
            )
        )
    teacher = cfg.train.repa.teacher_path
    if teacher is not None and teacher != REPA_CLASSICAL and (why := _missing_path(teacher)):
        problems.append(
            (
                "train.repa.teacher_path",
                f"the REPA teacher's model folder {why} (or `classical`, the hand-made descriptor)",
            )
        )
    if problems:
        picked = ", ".join(f"{g}={(choices or {}).get(g, '?')}" for g in ("data", "model"))
        lines = [line(tuple(key.split(".")), what) for key, what in problems]
        raise ConfigError(f"the profile ({picked}) cannot run:\n" + "\n".join(lines))
    return cfg


def stage_overrides() -> list[str]:
    """The overrides params.yaml carries beyond conf/, in a stage of a DVC experiment; [] elsewhere."""
    from kiln.dvc_params import diff_overrides, experiment_params

    params = experiment_params()
    return [] if params is None else diff_overrides(compose_raw([])[0], params)


def load_config(overrides: list[str] | None = None) -> KilnConfig:
    """The one way to get a config: compose `conf/` with overrides, then validate. Inside a DVC stage, what
    `dvc exp run -S` composed into params.yaml comes last (kiln.dvc_params)."""
    overrides = [*(overrides or []), *stage_overrides()]
    raw, choices = compose_raw(overrides)
    return validate(raw, choices, overrides)


def to_yaml(cfg: KilnConfig) -> str:
    import yaml

    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
