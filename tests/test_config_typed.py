"""The typed config (andrea/settings.py): made once from the validated dict, field names and
types from the schema, and what the training path reads is it, not the raw dict.
Run: pytest tests/test_config_typed.py"""

from __future__ import annotations

import copy
import dataclasses
import re
import typing
from pathlib import Path

import pytest
import yaml

from andrea.config import load_config
from andrea.errors import ConfigError
from andrea.settings import MaxRepeat, Settings, TrainSettings, section

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = yaml.safe_load((ROOT / "workflow" / "schemas" / "params.schema.yaml").read_text())
TYPES = {"integer": int, "number": float, "string": str, "boolean": bool}


@pytest.fixture(scope="module")
def cfg():
    return load_config(ROOT / "params.yaml", "tiny")


def _schema_type(prop: dict):
    if "$ref" in prop:
        return _schema_type(SCHEMA["$defs"][prop["$ref"].rsplit("/", 1)[1]])
    if "enum" in prop:
        return type(prop["enum"][0])
    return prop["type"]


def _check(cls, node: dict, d: dict, where: str):
    """Every field of ``cls`` is a schema key of ``node`` with the schema's type and the dict's value."""
    hints, obj = typing.get_type_hints(cls), section(cls, d, where)
    fields = [f.name for f in dataclasses.fields(cls)]
    assert fields == list(node["properties"]), where          # names and order = the schema's
    optional = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(cls)
                if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
    assert set(node["required"]) == set(fields) - set(optional), where     # optional: a default, not required
    d = {**optional, **d}
    for name in fields:
        t, prop, got = hints[name], node["properties"][name], getattr(obj, name)
        st = _schema_type(prop)
        if dataclasses.is_dataclass(t):
            _check(t, prop, d[name], f"{where}.{name}")
        elif st == "object":                                  # free keys (bandit.floors): a dict
            values = _schema_type(prop["additionalProperties"])
            assert typing.get_origin(t) is dict and typing.get_args(t)[1] is TYPES.get(values, values), where
            assert isinstance(got, dict) and got == d[name]
        elif st == "array":
            items = _schema_type(prop["items"])
            assert typing.get_origin(t) is tuple and typing.get_args(t)[0] is TYPES.get(items, items), where
            assert isinstance(got, tuple) and list(got) == list(d[name])
        else:
            want = TYPES.get(st, st)
            assert t is want, f"{where}.{name}: {t} is not the schema's {st}"
            assert type(got) is want and got == d[name], f"{where}.{name}"


def test_every_typed_section_has_the_schemas_keys_types_and_the_dicts_values(cfg):
    s = Settings.from_dict(cfg)
    hints = typing.get_type_hints(Settings)
    for f in dataclasses.fields(Settings):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            _check(t, SCHEMA["properties"][f.name], cfg[f.name], f.name)
            assert getattr(s, f.name) == section(t, cfg[f.name], f.name)
        else:
            assert type(getattr(s, f.name)) is t and getattr(s, f.name) == cfg[f.name]
    assert s.coherence.max_repeat == MaxRepeat(**cfg["coherence"]["max_repeat"])
    assert s.bandit.phases == tuple(cfg["bandit"]["phases"])


def test_settings_are_frozen_and_leave_the_dict_as_it_was(cfg):
    before = copy.deepcopy(cfg)
    s = Settings.from_dict(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.train.lr = 1.0
    assert cfg == before


def test_a_whole_float_is_an_integer_and_anything_else_is_refused_by_key(cfg):
    c = copy.deepcopy(cfg)
    c["train"]["batch_size"] = 16.0                 # the schema's `integer` accepts it
    c["train"]["lr"] = 1                            # an integer is a number
    s = Settings.from_dict(c)
    assert type(s.train.batch_size) is int and s.train.batch_size == 16
    assert type(s.train.lr) is float and s.train.lr == 1.0
    for path, value, message in [(("train", "batch_size"), 2.5, r"^train\.batch_size: expected an integer"),
                                 (("train", "max_steps"), True, r"^train\.max_steps: expected an integer"),
                                 (("bandit", "progress_per_step"), 1, r"^bandit\.progress_per_step: expected true"),
                                 (("bandit", "phases"), 7, r"^bandit\.phases: expected a list"),
                                 (("coherence", "max_repeat"), 0.5, r"^coherence\.max_repeat: expected a mapping"),
                                 (("train", "backend"), 3, r"^train\.backend: expected a string"),
                                 (("bandit", "floors"), [0.1], r"^bandit\.floors: expected a mapping"),
                                 (("bandit", "floors"), {"chat-multi": "x"}, r"^bandit\.floors\.chat-multi: expected a number")]:
        bad = copy.deepcopy(cfg)
        bad[path[0]][path[1]] = value
        with pytest.raises(ConfigError, match=message):
            Settings.from_dict(bad)
    bad = copy.deepcopy(cfg)
    del bad["coherence"]["max_repeat"]["char"]
    with pytest.raises(ConfigError, match=r"^coherence\.max_repeat\.char: missing"):
        Settings.from_dict(bad)
    bad = copy.deepcopy(cfg)
    bad["train"]["lr_typo"] = 1.0
    with pytest.raises(ConfigError, match=r"^train\.lr_typo: unknown key"):
        Settings.from_dict(bad)
    with pytest.raises(ConfigError, match=r"^seed: missing"):
        Settings.from_dict({k: v for k, v in cfg.items() if k != "seed"})


def test_the_engine_pieces_take_the_typed_sections(cfg):
    from andrea.engine.engine import Hyper
    from andrea.engine.model import ModelConfig
    from andrea.engine.schedule import lr_at

    s = Settings.from_dict(cfg)
    mc = ModelConfig.of(s.model, 1281)
    assert (mc.d_model, mc.n_head, mc.n_layer, mc.context, mc.vocab_size) == (128, 4, 4, 128, 1281)
    assert ModelConfig.from_cfg(cfg, 1281) == mc                 # the raw-dict door generate.py still uses
    hp = Hyper.of(s.train)
    assert (hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.grad_clip) == \
        tuple(float(cfg["train"][k]) for k in ("beta1", "beta2", "eps", "weight_decay", "grad_clip"))
    assert lr_at(0, s.train) == pytest.approx(cfg["train"]["lr"] / cfg["train"]["warmup_steps"])
    assert isinstance(s.train, TrainSettings)


def test_the_training_path_reads_no_raw_config_keys():
    """The re-parsing is gone: the modules the typed sections are handed to index no config dict."""
    files = [*sorted((ROOT / "andrea" / "curriculum").glob("*.py")), ROOT / "andrea" / "coherence.py",
             ROOT / "andrea" / "train.py", ROOT / "andrea" / "engine" / "engine.py",
             ROOT / "andrea" / "engine" / "schedule.py"]
    raw = re.compile(r"""\b\w*cfg\w*\[\s*["']""")
    hits = [f"{f.relative_to(ROOT)}:{i}" for f in files for i, line in enumerate(f.read_text().splitlines(), 1)
            if raw.search(line)]
    assert hits == []


def test_the_trainer_builds_its_settings_once_and_records_the_raw_dict(tmp_path, monkeypatch):
    import json

    from rich.console import Console

    from andrea.train import Trainer
    from train_helpers import make_data, micro_cfg

    tok, tokens = make_data(tmp_path / "data")
    c = micro_cfg(6, 12)
    raw = json.dumps(c)
    made = []
    real = Settings.from_dict
    monkeypatch.setattr(Settings, "from_dict", classmethod(lambda cls, d: made.append(d) or real(d)))
    tr = Trainer(c, "warmup", tok, tokens, tmp_path / "w", console=Console(stderr=True, force_terminal=False))
    assert tr.run() == 0
    assert len(made) == 1 and made[0] is c                           # once, from the validated dict
    assert tr.settings.train.max_steps == 12 and tr.cur.policy_name == tr.settings.bandit.policy
    st = json.loads((tmp_path / "w" / "model.state.json").read_text())
    assert st["config"] == c and json.dumps(c) == raw                # recorded as it was given
