"""The config: Hydra composes conf/, pydantic refuses anything it does not know, and says where it came from."""

import subprocess
import sys

import pytest

from kiln.config import ConfigError, KilnConfig, load_config


def test_defaults_compose_and_validate():
    cfg = load_config()
    assert isinstance(cfg, KilnConfig)
    assert cfg.model.size == "tiny" and cfg.cluster.kind == "local"


def test_overrides_are_typed():
    cfg = load_config(["train.steps=7", "data.filters.min_side=64"])
    assert cfg.train.steps == 7 and cfg.data.filters.min_side == 64


def test_unknown_key_names_the_key_and_the_override():
    with pytest.raises(ConfigError, match=r"data\.filters\.min_sizee: unknown key \(from override '\+data\.filters\.min_sizee=3'\)"):
        load_config(["+data.filters.min_sizee=3"])


def test_unknown_key_in_a_file_names_the_file(tmp_path, monkeypatch):
    import shutil

    from kiln.paths import CONF_DIR

    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "train" / "demo.yaml").write_text((conf / "train" / "demo.yaml").read_text() + "stepz: 3\n")
    monkeypatch.setenv("KILN_CONF", str(conf))
    with pytest.raises(ConfigError) as e:
        load_config()
    assert "train.stepz: unknown key" in str(e.value) and str(conf / "train" / "demo.yaml") in str(e.value)


def test_a_schema_key_the_yaml_never_wrote_is_overridable_and_a_typo_is_named():
    cfg = load_config(["train.parallel.tp=2", "train.telemetry.spike_z=3"])  # conf/train/demo.yaml has neither
    assert cfg.train.parallel.tp == 2 and cfg.train.telemetry.spike_z == 3.0 and cfg.train.steps == load_config([]).train.steps
    with pytest.raises(ConfigError, match=r"train\.parallel\.tpp: unknown key \(from override 'train\.parallel\.tpp=2'\)"):
        load_config(["train.parallel.tpp=2"])


def test_bad_value_is_a_clear_error():
    with pytest.raises(ConfigError, match="train.steps"):
        load_config(["train.steps=abc"])


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(Exception):
        cfg.train.steps = 3  # type: ignore[misc]


def test_cli_config_show_prints_the_composed_config():
    out = subprocess.run([sys.executable, "-m", "kiln.cli", "config", "show", "train.steps=11"], capture_output=True, text=True, check=True).stdout
    assert "steps: 11" in out and "min_side:" in out


def test_cli_config_show_fails_with_exit_2_on_a_bad_key():
    r = subprocess.run([sys.executable, "-m", "kiln.cli", "config", "show", "+train.nope=1"], capture_output=True, text=True)
    assert r.returncode == 2 and "train.nope: unknown key" in r.stderr
