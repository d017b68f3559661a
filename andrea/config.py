"""Params: load ``params.yaml``, overlay ``params/<profile>.yaml``, apply ``-S`` overrides,
validate the result against ``workflow/schemas/params.schema.yaml``.

    from andrea.config import load_config
    cfg = load_config("params.yaml", "tiny", ["bandit.coverage_bonus=1.3"])

Precedence: params.yaml < overlay < overrides. Overlays and overrides may only name
keys the schema knows; an unknown key, a wrong type or an out-of-range value raises
ConfigError naming the dotted key. The merged config carries ``profile`` set to the
overlay actually applied, so ``config_hash(cfg)`` tells two runs apart.
"""

from __future__ import annotations

import copy
import hashlib
import json
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


def validate(cfg: dict, schema_path: Path) -> None:
    import jsonschema

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


def load_config(params: str | Path = "params.yaml", profile: str | None = None,
                overrides: list[str] | None = None) -> dict:
    params_path = Path(params)
    cfg = _read_yaml(params_path)
    profile = profile or cfg.get("profile")
    if not profile:
        raise ConfigError(f"{params_path}: no --profile given and no `profile` key")
    overlay_path = params_path.parent / "params" / f"{profile}.yaml"
    if not overlay_path.is_file():
        known = sorted(p.stem for p in (params_path.parent / "params").glob("*.yaml"))
        raise ConfigError(f"profile {profile!r}: {overlay_path} not found (known: {', '.join(known) or 'none'})")
    cfg = deep_merge(cfg, _read_yaml(overlay_path))
    for item in overrides or []:
        apply_override(cfg, item)
    cfg["profile"] = profile
    validate(cfg, find_schema(params_path))
    return cfg


def get(cfg: dict, dotted: str) -> Any:
    node: Any = cfg
    for p in dotted.split("."):
        node = node[p]
    return node


def config_hash(cfg: dict) -> str:
    """sha256 of the canonical JSON of a merged config."""
    blob = json.dumps(cfg, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()
