"""The config: Hydra composes conf/, pydantic refuses anything it does not know, and says where it came from."""

import subprocess
import sys

import pytest
from pydantic import ValidationError

from kiln.config import ConfigError, KilnConfig, load_config
from kiln.paths import REPO_ROOT


def test_defaults_compose_and_validate():
    cfg = load_config()
    assert isinstance(cfg, KilnConfig)
    assert cfg.model.size == "nano" and cfg.cluster.kind == "local"


def test_overrides_are_typed():
    cfg = load_config(["train.steps=7", "data.filters.min_side=64"])
    assert cfg.train.steps == 7 and cfg.data.filters.min_side == 64


def test_unknown_key_names_the_key_and_the_override():
    with pytest.raises(
        ConfigError, match=r"data\.filters\.min_sizee: unknown key \(from override '\+data\.filters\.min_sizee=3'\)"
    ):
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
    assert (
        cfg.train.parallel.tp == 2
        and cfg.train.telemetry.spike_z == 3.0
        and cfg.train.steps == load_config([]).train.steps
    )
    with pytest.raises(
        ConfigError, match=r"train\.parallel\.tpp: unknown key \(from override 'train\.parallel\.tpp=2'\)"
    ):
        load_config(["train.parallel.tpp=2"])


def test_bad_value_is_a_clear_error():
    with pytest.raises(ConfigError, match="train.steps"):
        load_config(["train.steps=abc"])


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.train.steps = 3  # type: ignore[misc]


def test_cli_config_show_prints_the_composed_config():
    out = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "config", "show", "train.steps=11"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "steps: 11" in out and "min_side:" in out


def test_cli_config_show_fails_with_exit_2_on_a_bad_key():
    r = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "config", "show", "+train.nope=1"], capture_output=True, text=True
    )
    assert r.returncode == 2 and "train.nope: unknown key" in r.stderr


def test_a_key_the_profile_does_not_write_can_be_overridden_twice_and_the_last_wins():
    cfg = load_config(["data.clustering.review_db=/a.duckdb", "data.clustering.review_db=/b.duckdb"])
    assert cfg.data.clustering.review_db == "/b.duckdb"


# ------------------------------------------------------------------------------------------ profiles
def test_the_real_data_profile_holds_no_threshold_and_its_defaults_are_the_schemas():
    import yaml

    from kiln.paths import CONF_DIR

    assert not yaml.safe_load(
        (CONF_DIR / "data" / "web.yaml").read_text()
    )  # every key the schema's; the run names its source
    models = [
        "data.caption.captioner=source",
        "data.embed.embedder=classical",
        "data.rewrite.rewriter=rules",
        "data.stand_ins=[classical_embedder,rules_rewriter]",
    ]
    web = load_config(["data=web", "data.source=/imgs", *models])
    assert web.data.filters == KilnConfig().data.filters and web.data.dedup == KilnConfig().data.dedup


def test_a_real_profile_without_its_models_fails_at_load_naming_each_key_and_the_profile():
    with pytest.raises(ConfigError) as e:
        load_config(["data=web", "data.source=s3://bucket/images/"])
    msg = str(e.value)
    assert "the profile (data=web, model=nano) cannot run" in msg and "conf/data/web.yaml" in msg
    for key in ("data.caption.vlm_path", "data.embed.path", "data.rewrite.llm_path"):
        assert f"{key}: " in msg and "is not set" in msg
    assert "data.source" not in msg


def test_a_model_folder_that_is_not_there_is_named(tmp_path):
    with pytest.raises(
        ConfigError, match=r"data\.embed\.path: the embedder's model folder .*/nowhere does not exist \(from override"
    ):
        load_config(["data=web", "data.source=/imgs", f"data.embed.path={tmp_path / 'nowhere'}"])


def test_a_stand_in_must_be_named_as_one(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"data\.embed\.embedder: classical is an offline stand-in .*data\.stand_ins: \[classical_embedder\]",
    ):
        load_config(["data.stand_ins=[scene_metadata_captioner,rules_labeller,rules_rewriter]"])
    with pytest.raises(ConfigError, match=r"data\.source: no source set"):
        load_config(
            [
                "data=web",
                f"data.caption.vlm_path={tmp_path}",
                f"data.embed.path={tmp_path}",
                f"data.rewrite.llm_path={tmp_path}",
            ]
        )


def test_the_demo_profile_names_its_stand_ins_and_runs():
    cfg = load_config()
    assert cfg.data.source == "demo"
    assert set(cfg.data.stand_ins) == {
        "scene_metadata_captioner",
        "classical_embedder",
        "rules_labeller",
        "rules_rewriter",
    }
    assert (cfg.data.caption.captioner, cfg.data.embed.embedder, cfg.data.rewrite.rewriter) == (
        "scene_metadata",
        "classical",
        "rules",
    )


def test_the_kept_group_composition_with_value_overrides_applied_is_hydras_own_composition(krea):
    """kiln composes the config groups' choices once and applies the value overrides to a copy (Hydra's parser
    and applier): for every rung of every ladder and a spread of overrides, the result is Hydra's `compose`."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from kiln.config.compose import _hydra_compose, conf_dir
    from kiln.ladder import all_rungs, checkpoint_overrides, rung_base, train_set_overrides

    cases = [[], ["train.steps=5"], ["ladder=krea"], ["train=pretrain_256", "train.lr=0.1"], ["data=web", "data.source=/tmp/x"],
             ["train.parallel.tp=2"], ["data.demo.n=40", "data.classify.heads.0.threshold=0.3"], ["model=tiny", "train.steps=3", "train=demo"],
             ["ladder.domains=[]"], ["data.rewrite.form_probs={long:1.0}"], ["train.steps=5", "~train.mix"], ["+train.nope=1"]]  # fmt: skip
    for ladder in ([], krea):
        for r in all_rungs(load_config(ladder)):
            cases += [
                train_set_overrides(r, ladder, "DATA_ROOT"),
                checkpoint_overrides(r, ladder, "data"),
                rung_base(r, ladder),
            ]

    def plain(make, overrides):
        try:
            d = OmegaConf.to_container(make(overrides), resolve=False)
        except Exception as e:  # noqa: BLE001 - a refusal must be the same refusal
            return type(e).__name__, str(e).splitlines()[0]
        return d, d.pop("hydra")["runtime"]["choices"]

    def hydras(overrides):
        with initialize_config_dir(config_dir=str(conf_dir().resolve())):
            return compose("config", overrides=overrides, return_hydra_config=True)

    for overrides in cases:
        assert plain(_hydra_compose, overrides) == plain(hydras, overrides), overrides


def test_repa_settings_without_a_teacher_are_refused_not_silently_off():
    off = ["train.repa.teacher_path=null"]
    with pytest.raises(ConfigError, match="train.repa.*no teacher_path, so REPA would be off"):
        load_config([*off, "train.repa.block=8"])
    assert load_config(off).train.repa.teacher_path is None  # REPA off with its defaults: nothing to refuse
    assert load_config(["train.repa.block=8", "train.repa.teacher_path=classical"]).train.repa.block == 8


def report_table() -> dict[str, dict[str, str]]:
    """docs/training-at-scale.md's table "The krea ladder against the report", by rung."""
    text = (REPO_ROOT / "docs" / "training-at-scale.md").read_text()
    lines = text.split("### The krea ladder against the report", 1)[1].split("\n\n- ", 1)[0].splitlines()
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines if ln.startswith("| ")]
    head, body = rows[0], rows[1:]
    return {r[0]: dict(zip(head[1:], r[1:], strict=True)) for r in body}


def test_every_krea_rung_is_what_the_report_table_says(krea):
    """Each rung of ladder=krea composes to the report's resolution, precision (8-bit at 256 and 512 px, bf16
    from 1024), model, VAE class and text encoder, as transcribed in docs; REPA is off where the report does
    not say where it is on. A cell saying "not stated" is not checked."""
    from kiln.ladder import all_rungs, rung_base

    table = report_table()
    rungs = all_rungs(load_config(krea))
    assert (
        [r.name for r in rungs] == list(table) == ["pretrain_256", "pretrain_512", "pretrain_1024", "midtrain", "sft"]
    )
    for r in rungs:
        cfg = load_config(rung_base(r, krea))
        t, m = cfg.train, cfg.model
        composed = {
            "resolution": str(t.resolution),
            "precision": "float8" if t.parallel.float8 else "bf16" if t.device == "cuda" else "fp32",
            "REPA": "on" if t.repa.teacher_path else "not stated",  # off unless the lab names a teacher
            "model": m.size,
            "VAE": m.autoencoder_class,
            "text encoder": m.text_encoder.model_type,
        }
        stated = {k: v for k, v in table[r.name].items() if v != "not stated"}
        assert {k: composed[k] for k in stated} == stated, r.name
        assert composed["REPA"] == table[r.name]["REPA"], r.name


def test_the_krea_model_profile_refuses_to_start_without_its_folders_or_with_folders_of_other_classes(krea, tmp_path):
    """The report's model needs the lab's Qwen-Image VAE and Qwen3-VL folders: no folder, or a folder of another
    class (a FLUX.1 VAE, a BERT encoder), is refused at config validation, naming the key and what it found."""
    from model.testing import write_tiny_autoencoder_kl, write_tiny_text_encoder

    with pytest.raises(ConfigError) as unset:
        load_config(["ladder=krea"])
    assert "model=krea2_12b" in str(unset.value)
    assert "model.autoencoder_path: the VAE folder of model.autoencoder=kl is not set" in str(unset.value)
    assert "model.text_encoder.path: the text encoder's folder is not set" in str(unset.value)
    flux1, bert = write_tiny_autoencoder_kl(tmp_path / "flux1"), write_tiny_text_encoder(tmp_path / "bert")
    with pytest.raises(ConfigError) as wrong:
        load_config([*krea, f"model.autoencoder_path={flux1}", f"model.text_encoder.path={bert}"])
    assert "holds _class_name 'AutoencoderKL', not 'AutoencoderKLQwenImage'" in str(wrong.value)
    assert "holds model_type 'bert', not 'qwen3_vl'" in str(wrong.value)
    assert load_config([*krea, "model=nano"]).model.size == "nano"  # a user's model= still wins
