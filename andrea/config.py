"""Params: the effective config of a run, composed and validated.

    from andrea.config import load_config
    cfg = load_config("params.yaml", "tiny", ["bandit.coverage_bonus=1.3"])  # compose profile tiny
    cfg = load_config("params.yaml")                                         # params.yaml as it is

With a profile, the config is composed from ``params/``: ``params/config.yaml`` (the base
recipe) < ``params/profile/<profile>.yaml`` < overrides, the same composition DVC's Hydra
integration performs on ``dvc exp run -S ...`` (``-S profile=P`` picks the profile there; here
an override ``profile=P`` does the same). Without one, ``params.yaml`` is read as the
effective config it is: the composed default profile, or what ``dvc exp run`` wrote.

Overlays and overrides may only name keys the schema knows; an unknown key, a wrong type, an
out-of-range or non-finite number raises ConfigError naming the dotted key. The result
carries ``profile`` and its top-level keys in schema order, so ``config_hash(cfg)`` and the
run state's bytes are the same whichever front end composed it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

import yaml

from andrea.errors import ConfigError

SCHEMA_RELPATH = Path("workflow") / "schemas" / "params.schema.yaml"
_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}): save it as UTF-8") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def deep_merge(base: dict, overlay: dict) -> dict:
    """A new dict: ``overlay`` wins; nested mappings merge, everything else (lists too) is replaced."""
    out = copy.deepcopy(base)
    for k, v in overlay.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def apply_override(cfg: dict, item: str) -> None:
    """Apply one ``dotted.key=value`` in place; the value is parsed as YAML (1.3, true, [a, b])."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected KEY=VALUE")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r}: empty key segment")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {key}: value {raw!r} is not valid YAML: {e}") from None
    if isinstance(value, str) and _NUMBER.match(value.strip()):
        value = float(value)  # YAML 1.1 reads 1e-6 (no dot) as a string; on a command line it means a number
    node = cfg
    for i, p in enumerate(parts[:-1]):
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {key}: {'.'.join(parts[:i + 1])} is not a mapping")
        node = nxt
    node[parts[-1]] = value


def find_schema(params_path: Path) -> Path:
    for root in (params_path.resolve().parent, Path(__file__).resolve().parents[1]):
        candidate = root / SCHEMA_RELPATH
        if candidate.is_file():
            return candidate
    raise ConfigError(f"schema {SCHEMA_RELPATH} not found beside {params_path}")


def _non_finite(node: Any, where: str = ""):
    """Dotted keys of the NaN/inf floats in ``node`` (JSON schema cannot exclude NaN)."""
    if isinstance(node, float) and not math.isfinite(node):
        yield where or "<top>", node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _non_finite(v, f"{where}.{k}" if where else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _non_finite(v, f"{where}.{i}")


def validate(cfg: dict, schema_path: Path) -> None:
    import jsonschema

    bad = list(_non_finite(cfg))
    if bad:
        raise ConfigError("invalid params: " + "; ".join(f"{k}: {v} is not a finite number" for k, v in bad[:10]))
    schema = yaml.safe_load(schema_path.read_text(encoding="utf-8"))
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(cfg), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        lines = []
        for e in errors[:10]:
            where = ".".join(str(p) for p in e.absolute_path) or "<top>"
            if e.validator == "additionalProperties":
                extra = sorted(set(e.instance) - set(e.schema.get("properties", {})))
                where = ".".join([*map(str, e.absolute_path), extra[0]]) if extra else where
                lines.append(f"{where}: unknown key")
            else:
                lines.append(f"{where}: {e.message}")
        raise ConfigError("invalid params: " + "; ".join(lines))


def default_profile(params_dir: Path) -> str:
    """The profile ``params/config.yaml``'s Hydra defaults list selects."""
    for entry in _read_yaml(params_dir / "config.yaml").get("defaults") or []:
        if isinstance(entry, dict) and "profile" in entry:
            return str(entry["profile"])
    raise ConfigError(f"{params_dir / 'config.yaml'}: its defaults list names no profile")


def compose(params_dir: Path, profile: str) -> dict:
    """``params/config.yaml`` (without its defaults list) overlaid by ``params/profile/<profile>.yaml``."""
    base = _read_yaml(params_dir / "config.yaml")
    base.pop("defaults", None)
    overlay_path = params_dir / "profile" / f"{profile}.yaml"
    if not overlay_path.is_file():
        known = sorted(p.stem for p in (params_dir / "profile").glob("*.yaml"))
        raise ConfigError(f"profile {profile!r}: {overlay_path} not found (known: {', '.join(known) or 'none'})")
    return deep_merge(base, _read_yaml(overlay_path))


def _schema_order(cfg: dict, schema_path: Path) -> dict:
    order = list(yaml.safe_load(schema_path.read_text(encoding="utf-8")).get("properties", {}))
    rank = {k: i for i, k in enumerate(order)}
    return dict(sorted(cfg.items(), key=lambda kv: rank.get(kv[0], len(rank))))


def load_config(params: str | Path = "params.yaml", profile: str | None = None,
                overrides: list[str] | None = None) -> dict:
    params_path = Path(params)
    overrides = list(overrides or [])
    picks = [o.split("=", 1)[1].strip() for o in overrides if o.split("=", 1)[0].strip() == "profile" and "=" in o]
    overrides = [o for o in overrides if o.split("=", 1)[0].strip() != "profile" or "=" not in o]
    if picks:
        profile = picks[-1]
    if profile:
        cfg = compose(params_path.parent / "params", profile)
    else:
        cfg = _read_yaml(params_path)
        profile = cfg.get("profile")
        if not profile:
            raise ConfigError(f"{params_path}: no --profile given and no `profile` key")
    for item in overrides:
        apply_override(cfg, item)
    cfg["profile"] = profile
    schema = find_schema(params_path)
    cfg = _schema_order(cfg, schema)
    validate(cfg, schema)
    check_phases(cfg)
    return cfg


def check_phases(cfg: dict) -> None:
    """The cross-key rule of the phase table (andrea/phases.py) the schema cannot state: the
    phases fit in train.max_steps (the polish in the main phase)."""
    from andrea.phases import phase_table
    from andrea.settings import CurriculumSettings, TrainSettings, section

    phase_table(section(TrainSettings, cfg["train"], "train"), section(CurriculumSettings, cfg["curriculum"], "curriculum"))


def check_source_names(cfg: dict) -> None:
    """The train stage's rule: the sources the curriculum names, ``curriculum.polish_sources``
    (when there is a polish) and the keys of ``bandit.floors``, are sources ``megachat.sources``
    makes (a data experiment that renames the sources is not held to it until it trains)."""
    made = [s["name"] for s in cfg["megachat"]["sources"]]
    named = [(f"bandit.floors.{n}", n) for n in cfg["bandit"].get("floors") or {}]
    if cfg["curriculum"]["polish_steps"]:
        named = [(f"curriculum.polish_sources[{i}]", n) for i, n in enumerate(cfg["curriculum"]["polish_sources"])] + named
    for key, name in named:
        if name not in made:
            raise ConfigError(f"{key}: unknown source {name!r} (megachat.sources makes {', '.join(made)})")


def get(cfg: dict, dotted: str) -> Any:
    node: Any = cfg
    for p in dotted.split("."):
        node = node[p]
    return node


def config_hash(cfg: dict) -> str:
    """sha256 of the canonical JSON of a merged config."""
    blob = json.dumps(cfg, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


# --- can this machine train this config? ------------------------------------------------------

GPU_INSTALL = "pip install -e '.[gpu-cuda13]' (CUDA 13) or pip install -e '.[gpu]' (CUDA 12)"
# Training compute above which `train.backend: auto` refuses to fall back to NumPy: 6 * params *
# tokens FLOPs. The NumPy engine does ~1e11 FLOP/s on this project's 2-core CI box (the tiny
# profile, 7e12 FLOPs, trains in ~80 s), so 1e15 is about three hours there; ANDREA-12M is 6e16.
CPU_FLOPS = 1e11
NUMPY_MAX_FLOPS = 1e15


def train_flops(cfg: dict) -> float:
    m, t = cfg["model"], cfg["train"]
    vocab = 256 + cfg["tokenizer"]["n_morphemes"] + 1
    n_params = 12 * m["n_layer"] * m["d_model"] ** 2 + (vocab + m["context"]) * m["d_model"]
    tokens = t["max_steps"] * t["batch_size"] * t["grad_accum"] * m["context"]
    return 6.0 * n_params * tokens


def check_backend(cfg: dict) -> str:
    """Refuse, before any work, a config this machine cannot train (ConfigError naming
    train.backend / train.precision and the install command). Returns what ``auto`` will pick,
    or "" for an explicit backend."""
    import importlib.util

    t = cfg["train"]
    backend, precision = t["backend"], t["precision"]
    has_cupy = importlib.util.find_spec("cupy") is not None
    where = f"profile {cfg['profile']}"
    if has_cupy:
        if backend == "auto":
            return f"{where}: train.backend=auto -> cupy where a CUDA device is usable (CuPy is installed), else numpy"
        return ""
    if precision != "fp32":
        raise ConfigError(f"{where}: train.precision={precision} needs CuPy (the NumPy engine runs fp32 only) and "
                          f"CuPy is not installed: {GPU_INSTALL}; or set train.precision=fp32 train.backend=numpy")
    if backend == "cupy":
        raise ConfigError(f"{where}: train.backend=cupy but CuPy is not installed: {GPU_INSTALL}")
    if backend == "auto":
        flops = train_flops(cfg)
        if flops > NUMPY_MAX_FLOPS:
            hours = flops / CPU_FLOPS / 3600
            raise ConfigError(f"{where}: train.backend=auto and CuPy is not installed; on NumPy this run ({flops:.1e} "
                              f"FLOPs) takes ~{hours:,.0f} h on 2 cores: {GPU_INSTALL}, or set train.backend=numpy "
                              f"to train it on the CPU anyway")
        return f"{where}: train.backend=auto -> numpy (CuPy is not installed)"
    return ""
