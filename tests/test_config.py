"""Params loading and validation: every profile validates; bad keys, types and ranges are
errors that name the key; precedence is params.yaml < overlay < -S overrides.

    pytest tests/test_config.py
"""

from __future__ import annotations

import shutil
import sys
import types
from pathlib import Path

import pytest
import yaml

from andrea import cli
from andrea.config import config_hash, load_config
from andrea.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
PARAMS = ROOT / "params.yaml"
PROFILES = sorted(p.stem for p in (ROOT / "params").glob("*.yaml"))


def test_profiles_exist():
    assert {"tiny", "andrea-12m", "andrea-120m", "andrea-480m"} <= set(PROFILES)


@pytest.mark.parametrize("profile", PROFILES)
def test_every_profile_validates(profile):
    cfg = load_config(PARAMS, profile)
    assert cfg["profile"] == profile
    assert cfg["model"]["d_model"] % cfg["model"]["n_head"] == 0


def test_family_shapes_match_the_seeds():
    want = {"andrea-12m": (384, 12, 6, 4353), "andrea-120m": (768, 12, 12, 8449), "andrea-480m": (1536, 24, 16, 8449)}
    for profile, (d, h, n, vocab) in want.items():
        cfg = load_config(PARAMS, profile)
        m = cfg["model"]
        assert (m["d_model"], m["n_head"], m["n_layer"], m["context"]) == (d, h, n, 1024)
        assert 256 + cfg["tokenizer"]["n_morphemes"] + 1 == vocab


def test_recipe_is_the_default_profile():
    assert yaml.safe_load(PARAMS.read_text())["profile"] == "andrea-12m"
    assert load_config(PARAMS)["profile"] == "andrea-12m"


@pytest.mark.parametrize("override,key", [
    ("bandit.nope=1", "bandit.nope: unknown key"),
    ("nosuchsection.x=1", "nosuchsection: unknown key"),
    ("train.backend=gpu", "train.backend:"),
    ("model.d_model=abc", "model.d_model:"),
    ("bandit.coverage_bonus=0.5", "bandit.coverage_bonus:"),
    ("megachat.val_fraction=0", "megachat.val_fraction:"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(PARAMS, "tiny", [override])


def test_overrides_parse_as_yaml_and_win():
    cfg = load_config(PARAMS, "tiny", ["bandit.coverage_bonus=1.7", "bandit.phases=[1, 2]", "train.lr=0.01"])
    assert cfg["bandit"]["coverage_bonus"] == 1.7
    assert cfg["bandit"]["phases"] == [1, 2]
    assert cfg["train"]["lr"] == 0.01


def test_exponent_without_a_dot_is_a_number():
    cfg = load_config(PARAMS, "tiny", ["coherence.temperature=1e-6", "train.lr=3E-4"])
    assert cfg["coherence"]["temperature"] == 1e-6 and cfg["train"]["lr"] == 3e-4
    assert load_config(PARAMS, "tiny", ["profile=tiny"])["profile"] == "tiny"


def test_overlay_wins_over_base_and_lists_are_replaced():
    base = yaml.safe_load(PARAMS.read_text())
    tiny = load_config(PARAMS, "tiny")
    assert base["hermes3"]["source"] == "hub" and tiny["hermes3"]["source"] == "embedded"
    assert tiny["diet"]["sweep"] == yaml.safe_load((ROOT / "params/tiny.yaml").read_text())["diet"]["sweep"]


def test_unknown_profile_lists_the_known_ones():
    with pytest.raises(ConfigError, match="known: .*tiny"):
        load_config(PARAMS, "andrea-9b")


def test_malformed_override():
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(PARAMS, "tiny", ["bandit.coverage_bonus"])
    with pytest.raises(ConfigError, match="not a mapping"):
        load_config(PARAMS, "tiny", ["seed.x=1"])


def test_config_hash_is_stable_and_sensitive():
    a, b = load_config(PARAMS, "tiny"), load_config(PARAMS, "tiny")
    assert config_hash(a) == config_hash(b)
    assert config_hash(a) != config_hash(load_config(PARAMS, "tiny", ["seed=7"]))


def test_params_file_errors_name_the_file(tmp_path):
    shutil.copytree(ROOT / "params", tmp_path / "params")
    shutil.copytree(ROOT / "workflow", tmp_path / "workflow")
    bad = tmp_path / "params.yaml"
    bad.write_text("profile: tiny\nseed: [unclosed\n")
    with pytest.raises(ConfigError, match="params.yaml: not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "missing.yaml")


@pytest.fixture()
def fake_stage(monkeypatch):
    mod = types.ModuleType("andrea_fake_stage")
    mod.add_arguments = lambda p: p.add_argument("--fail", action="store_true")

    def run(args, cfg):
        from andrea.errors import AndreaError
        if args.fail:
            raise AndreaError("data/x.parquet row 3: bad role 'robot'")
        print(f"coverage_bonus={cfg['bandit']['coverage_bonus']}")
        return 0

    mod.run = run
    monkeypatch.setitem(sys.modules, "andrea_fake_stage", mod)
    monkeypatch.setitem(cli.COMMANDS, "fake", cli.Command("andrea_fake_stage", "test stage"))
    monkeypatch.chdir(ROOT)


def test_cli_runs_a_stage_with_overrides(fake_stage, capsys):
    assert cli.main(["fake", "--profile", "tiny", "-S", "bandit.coverage_bonus=1.3"]) == 0
    assert "coverage_bonus=1.3" in capsys.readouterr().out


def test_cli_errors_are_one_line_with_exit_codes(fake_stage, capsys):
    assert cli.main(["fake", "--fail", "--profile", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "andrea fake: error: data/x.parquet row 3: bad role 'robot'"
    assert cli.main(["fake", "--profile", "tiny", "-S", "bandit.bogus=1"]) == 3
    assert "bandit.bogus: unknown key" in capsys.readouterr().err


def test_cli_unknown_stage_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["no-such-stage"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
