"""Params loading and validation: every profile validates; bad keys, types, ranges and
non-finite numbers are errors that name the key; precedence is params/config.yaml < profile
overlay < -S overrides, the same composition DVC's Hydra integration writes to params.yaml.

    pytest tests/test_config.py
"""

from __future__ import annotations

import re
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
PROFILES = sorted(p.stem for p in (ROOT / "params" / "profile").glob("*.yaml"))


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
    assert tiny["diet"]["sweep"] == yaml.safe_load((ROOT / "params/profile/tiny.yaml").read_text())["diet"]["sweep"]


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


def hydra_compose(overrides: list[str]) -> dict:
    """What `dvc exp run -S ...` writes to params.yaml (.dvc/config: hydra, params/, config)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(str(ROOT / "params"), version_base=None):
        return OmegaConf.to_container(compose(config_name="config", overrides=overrides), resolve=True)


def test_dvc_hydra_setup_points_at_params():
    text = (ROOT / ".dvc" / "config").read_text()
    assert re.search(r"\[hydra\]\s+enabled = true\s+config_dir = params\s+config_name = config", text)


@pytest.mark.parametrize("profile", PROFILES)
def test_hydra_composes_what_load_config_composes(profile):
    """The effective config is the same whichever composes it: a run trained by DVC (params.yaml
    from Hydra, read as is) and one by Snakemake/`andrea --profile` hash and save identically."""
    over = ["model.d_model=64", "model.n_head=2", "train.lr=0.002"]
    composed = hydra_compose([f"profile={profile}", *over])
    ours = load_config(PARAMS, profile, over)
    assert composed == ours
    assert ours["profile"] == profile and ours["model"]["d_model"] == 64  # -S wins over the profile


def test_params_yaml_as_dvc_writes_it_reads_back_identically(tmp_path):
    from omegaconf import OmegaConf

    shutil.copytree(ROOT / "workflow", tmp_path / "workflow")
    shutil.copytree(ROOT / "params", tmp_path / "params")
    cfg = hydra_compose(["profile=tiny", "model.d_model=64", "model.n_head=2"])
    (tmp_path / "params.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(cfg)))
    as_read = load_config(tmp_path / "params.yaml")
    composed = load_config(PARAMS, "tiny", ["model.d_model=64", "model.n_head=2"])
    assert as_read == composed and list(as_read) == list(composed)  # same bytes in model.state.json
    assert config_hash(as_read) == config_hash(composed)


def test_profile_override_picks_the_profile_as_in_dvc():
    assert load_config(PARAMS, None, ["profile=tiny"]) == load_config(PARAMS, "tiny")
    assert load_config(PARAMS)["profile"] == "andrea-12m"
    for profile in PROFILES:
        first = (ROOT / "params/profile" / f"{profile}.yaml").read_text().splitlines()[0]
        assert first == "# @package _global_", f"{profile}: Hydra needs the package header on line 1"


@pytest.mark.parametrize("override", ["train.lr=.nan", "train.grad_clip=.inf", "bandit.reward_scale=-.inf",
                                      "coherence.max_repeat.word=.nan", "eval.judge.timeout_s=.inf"])
def test_non_finite_numbers_are_refused(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=re.escape(key) + r": -?(nan|inf) is not a finite number"):
        load_config(PARAMS, "tiny", [override])


def test_non_finite_in_a_params_file_is_refused(tmp_path):
    shutil.copytree(ROOT / "workflow", tmp_path / "workflow")
    text = (ROOT / "params.yaml").read_text().replace("lr: 0.0006", "lr: .nan")
    assert ".nan" in text
    (tmp_path / "params.yaml").write_text(text)
    with pytest.raises(ConfigError, match=r"train\.lr: nan is not a finite number"):
        load_config(tmp_path / "params.yaml")


def test_params_file_not_utf8_is_one_line(tmp_path, capsys):
    shutil.copytree(ROOT / "workflow", tmp_path / "workflow")
    bad = tmp_path / "params.yaml"
    bad.write_bytes((ROOT / "params.yaml").read_bytes().replace(b"seed: 1337", b"seed: 1337 # caf\xe9"))
    with pytest.raises(ConfigError, match=r"params\.yaml: not UTF-8 text \(byte \d+\): save it as UTF-8"):
        load_config(bad)
    assert cli.main(["tokenizer", "--params", str(bad), "--train", "x", "--out", str(tmp_path / "t")]) == 3
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not UTF-8" in err and str(bad) in err


def test_backend_check_refuses_what_needs_cupy(monkeypatch):
    import importlib.util

    from andrea.config import check_backend

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError, match=r"train\.precision=bf16 needs CuPy.*pip install -e '\.\[gpu-cuda13\]'"):
        check_backend(load_config(PARAMS, "andrea-120m"))
    with pytest.raises(ConfigError, match=r"train\.backend=auto and CuPy is not installed.*train\.backend=numpy"):
        check_backend(load_config(PARAMS, "andrea-12m"))
    with pytest.raises(ConfigError, match=r"train\.backend=cupy but CuPy is not installed"):
        check_backend(load_config(PARAMS, "tiny", ["train.backend=cupy"]))
    assert check_backend(load_config(PARAMS, "andrea-12m", ["train.backend=numpy"])) == ""
    assert "auto -> numpy" in check_backend(load_config(PARAMS, "tiny", ["train.backend=auto"]))


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
