"""The typed config: frozen dataclasses of the sections the training path reads, made once
from the validated dict and handed down (the raw dict stays what is recorded: the run
state's ``config`` and ``config_hash``).

    from andrea.config import load_config
    from andrea.settings import Settings
    s = Settings.from_dict(load_config("params.yaml", "tiny"))
    s.train.lr, s.model.d_model, s.bandit.phases, s.coherence.max_repeat.trigram

Field names are the param keys; types follow workflow/schemas/params.schema.yaml: an
``integer`` is an ``int`` (a whole float such as 16.0 is taken as 16), a ``number`` a
``float``, an array a tuple, an object with named keys a nested dataclass, an object with free keys
(``bandit.floors``) a dict. Sections the
training path does not read (hermes3, megachat, tokenizer, diet: their stages read the dict)
are not typed here. ``from_dict`` expects a config ``andrea.config.load_config`` validated;
for a hand-made dict (tests) a missing, unknown or mistyped key is a ``ConfigError`` naming
the dotted key. Tests: ``pytest tests/test_config_typed.py``.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from andrea.errors import ConfigError


@dataclass(frozen=True)
class ModelSettings:
    d_model: int
    n_head: int
    n_layer: int
    context: int


@dataclass(frozen=True)
class TrainSettings:
    backend: str
    precision: str
    batch_size: int
    grad_accum: int
    max_steps: int
    lr: float
    min_lr: float
    warmup_steps: int
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    grad_clip: float
    log_every: int
    eval_every: int
    eval_batches: int
    checkpoint_every: int
    max_bad_steps: int
    smma_period: int
    gpus: int = 1          # data-parallel world size (andrea/dist.py); optional in params, 1 when absent
    fp8_scaling: str = "delayed"   # fp8 only: delayed | current (docs/FP8.md); optional, like gpus
    fp8_amax_history: int = 16     # fp8 delayed: steps of amax history per cast site
    recompute: str = "auto"        # auto | gelu: what the backward recomputes (andrea.engine.model.recompute_set)
    attention: str = "auto"        # GPU: auto | cudnn | kernels (andrea/cuda/cudnn_attention.py); optional, like gpus


@dataclass(frozen=True)
class CurriculumSettings:
    warmup_steps: int
    warmup_sources: tuple[str, ...]
    polish_steps: int
    polish_sources: tuple[str, ...]


@dataclass(frozen=True)
class BanditSettings:
    policy: str
    reward: str
    reward_scale: float
    ema: float
    ucb_c: float
    ucb_scale: str
    progress_per_step: bool
    phases: tuple[int, ...]
    phase_unit: int
    dice_warmup: int
    dice_main: int
    floor: float
    coverage_bonus: float
    epoch_penalty: str
    floors: dict[str, float] = dataclasses.field(default_factory=dict)  # per-source floor shares over ``floor``


@dataclass(frozen=True)
class MaxRepeat:
    """``coherence.max_repeat``: the highest repetition rate of each kind a sample may have."""

    bigram: float
    trigram: float
    word: float
    char: float


@dataclass(frozen=True)
class CoherenceSettings:
    every: int
    max_new_tokens: int
    temperature: float
    top_k: int
    patience: int
    max_repeat: MaxRepeat
    diverge_ratio: float


@dataclass(frozen=True)
class AuditSettings:
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    samples_per_prompt: int


@dataclass(frozen=True)
class JudgeSettings:
    url: str
    model: str
    api_key_env: str
    timeout_s: float
    retries: int


@dataclass(frozen=True)
class EvalSettings:
    max_batches: int
    judge: JudgeSettings


@dataclass(frozen=True)
class Settings:
    profile: str
    seed: int
    model: ModelSettings
    train: TrainSettings
    curriculum: CurriculumSettings
    bandit: BanditSettings
    coherence: CoherenceSettings
    audit: AuditSettings
    eval: EvalSettings

    @classmethod
    def from_dict(cls, cfg: dict) -> "Settings":
        """The typed sections of a validated config; the sections not typed here are not read."""
        return _build(cls, cfg, "", others_ok=True)


def section(cls: type, d: dict, where: str):
    """One section dataclass ``cls`` from its dict ``d`` (``where``: its dotted key, for errors)."""
    return _build(cls, d, where, others_ok=False)


def _build(cls: type, d: dict, where: str, others_ok: bool):
    if not isinstance(d, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    names = list(fields)
    unknown = sorted(set(d) - set(names))
    if unknown and not others_ok:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key (expected {', '.join(names)})")
    hints, out = typing.get_type_hints(cls), {}
    for n in names:
        key = f"{where}.{n}" if where else n
        if n not in d and fields[n].default is not dataclasses.MISSING:
            continue                                   # an optional key with its default
        if n not in d:
            raise ConfigError(f"{key}: missing (see workflow/schemas/params.schema.yaml)")
        out[n] = _value(hints[n], d[n], key)
    return cls(**out)  # optional keys left out take their dataclass default


def _value(t, v, where: str):
    if dataclasses.is_dataclass(t):
        return section(t, v, where)
    if typing.get_origin(t) is dict:
        if not isinstance(v, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(v).__name__}")
        (_, elem) = typing.get_args(t)
        return {str(k): _value(elem, x, f"{where}.{k}") for k, x in v.items()}
    if typing.get_origin(t) is tuple:
        if not isinstance(v, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(v).__name__}")
        (elem, _) = typing.get_args(t)
        return tuple(_value(elem, x, f"{where}[{i}]") for i, x in enumerate(v))
    if t is bool:
        if not isinstance(v, bool):
            raise ConfigError(f"{where}: expected true or false, got {v!r}")
        return v
    if t is int:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not float(v).is_integer():
            raise ConfigError(f"{where}: expected an integer, got {v!r}")
        return int(v)
    if t is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {v!r}")
        return float(v)
    if not isinstance(v, str):
        raise ConfigError(f"{where}: expected a string, got {v!r}")
    return v
