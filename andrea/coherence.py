"""Coherence control: repetition scores of generated text, and the early-stop monitor.

    from andrea.coherence import scores, is_degenerate, CoherenceMonitor
    s = scores("the cat sat on the mat the cat sat on the mat")
    is_degenerate(s, settings.coherence.max_repeat)    # True when any rate exceeds its limit (a MaxRepeat)
    mon = CoherenceMonitor(settings.coherence)

``scores(text)`` (all in [0, 1]; a text too short to have an n-gram scores 0 for it):
  * ``bigram`` / ``trigram``: repeated word n-gram rate, 1 - distinct / total n-grams;
  * ``word``: repeated word rate, 1 - distinct / total words;
  * ``char``: repeated character rate, 1 - distinct / total character 4-grams (catches
    loops inside words and in text without spaces: ``=====``, ``abababab``);
  * ``distinct_1`` .. ``distinct_3``: the distinct-n shares (distinct / total word
    n-grams, 1.0 for an empty set), the usual diversity figures;
  * ``n_words``, ``n_chars``.
Words are runs of letters/digits/underscore or runs of punctuation, lower-cased, so code
and chat markup count too.

``CoherenceMonitor`` is the training loop's side of the early stop: every
``coherence.every`` steps the loop samples the fixed ``PROMPTS`` and hands the texts to
``check``; ``coherence.patience`` consecutive checks in which a majority of samples is
degenerate (any rate above ``coherence.max_repeat``) halt the run. ``observe_loss`` also
halts a run whose loss diverges: per source (the step's batch label), its EMA (smoothing
``DIVERGE_EMA``, tracked after ``DIVERGE_WARM`` of that source's steps) rises above
``coherence.diverge_ratio`` x the lowest EMA that source has had. One EMA over all sources
would read the bandit's switch from an easy source to a hard one as divergence.
``sample_check(step, model, tokenizer, seed)`` does the sampling itself with
``andrea.generate.generate_batch`` (all prompts together) on an ``InferenceModel`` built once
over the training weights with a KV-cache slot per prompt.
The monitor's state (streak, per-source loss EMA and best) is JSON-able for ``.state.json``.
Tests: ``pytest tests/test_coherence.py``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

import numpy as np

from andrea.errors import AndreaError
from andrea.settings import CoherenceSettings, MaxRepeat

_WORD = re.compile(r"\w+|[^\w\s]+")
RATES = ("bigram", "trigram", "word", "char")
DIVERGE_EMA = 0.98
DIVERGE_WARM = 50
CHAR_N = 4


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _repeat_and_distinct(items: Sequence, n: int) -> tuple[float, float]:
    grams = [tuple(items[i:i + n]) for i in range(len(items) - n + 1)]
    if not grams:
        return 0.0, 1.0
    distinct = len(set(grams)) / len(grams)
    return 1.0 - distinct, distinct


def scores(text: str) -> dict:
    """Repetition rates and distinct-n shares of one text (see the module docstring)."""
    if not isinstance(text, str):
        raise AndreaError(f"coherence.scores: expected a str, got {type(text).__name__}")
    words = _words(text)
    out: dict = {}
    for n, name in ((1, "word"), (2, "bigram"), (3, "trigram")):
        rep, dist = _repeat_and_distinct(words, n)
        out[name] = round(rep, 6)
        out[f"distinct_{n}"] = round(dist, 6)
    chars = re.sub(r"\s+", " ", text)
    out["char"] = round(_repeat_and_distinct(chars, CHAR_N)[0], 6)
    out["n_words"] = len(words)
    out["n_chars"] = len(text)
    return {k: out[k] for k in ("bigram", "trigram", "word", "char", "distinct_1", "distinct_2", "distinct_3",
                                "n_words", "n_chars")}


def reasons(s: dict, max_repeat: MaxRepeat) -> list[str]:
    """The rates of ``s`` above their limits, as ``'trigram 0.71 > 0.40'`` strings."""
    out = []
    for k in RATES:
        limit = getattr(max_repeat, k)
        if s[k] > limit:
            out.append(f"{k} {s[k]:.2f} > {limit:.2f}")
    return out


def is_degenerate(s: dict, max_repeat: MaxRepeat) -> bool:
    """True when any repetition rate of ``s`` exceeds its limit in ``max_repeat``."""
    return bool(reasons(s, max_repeat))


def _prompts() -> list[str]:
    from andrea.data.template import render_prompt

    chat = [
        [{"from": "human", "value": "What is a Python list?"}],
        [{"from": "system", "value": "You are a concise assistant."},
         {"from": "human", "value": "Explain what a dictionary is used for."}],
    ]
    return [render_prompt(c) for c in chat] + ["The module provides", "def main("]


PROMPTS: list[str] = _prompts()


class CoherenceMonitor:
    """Patience counter over periodic sample checks, plus a loss-divergence guard."""

    def __init__(self, coherence: CoherenceSettings):
        c = coherence
        self.every, self.patience, self.max_repeat = c.every, c.patience, c.max_repeat
        self.diverge_ratio = c.diverge_ratio
        self.max_new_tokens, self.temperature, self.top_k = c.max_new_tokens, c.temperature, c.top_k
        self.streak = 0
        self.ema: dict[str, dict] = {}                 # source -> {"ema", "best", "n"}

    @property
    def n_loss(self) -> int:
        """Finite training losses folded in, over all sources."""
        return sum(e["n"] for e in self.ema.values())

    def due(self, step: int) -> bool:
        """Whether a coherence check belongs after ``step`` (every ``coherence.every`` steps)."""
        return step > 0 and step % self.every == 0

    def check(self, step: int, samples: Sequence[tuple[str, str]]) -> dict:
        """Score ``[(prompt, text), ...]``; returns ``{"samples", "degenerate", "streak", "halt"}``.

        ``samples`` are records for ``.samples.json`` (step, prompt, text, scores);
        ``halt`` is None or ``{"reason", "step"}`` once ``patience`` consecutive checks
        were degenerate (a majority of their samples over a limit).
        """
        if not samples:
            raise AndreaError(f"coherence check at step {step}: no samples to score")
        recs, bad = [], 0
        for prompt, text in samples:
            s = scores(text)
            why = reasons(s, self.max_repeat)
            bad += bool(why)
            recs.append({"step": int(step), "prompt": prompt, "text": text, "scores": s, "degenerate": why})
        degenerate = bad * 2 > len(samples)
        self.streak = self.streak + 1 if degenerate else 0
        halt = None
        if self.streak >= self.patience:
            halt = {"reason": f"degenerate samples: {self.streak} consecutive coherence checks with "
                              f"{bad}/{len(samples)} samples over coherence.max_repeat", "step": int(step)}
        return {"samples": recs, "degenerate": degenerate, "streak": self.streak, "halt": halt}

    def run_check(self, step: int, generate: Callable[[str], str], prompts: Sequence[str] = PROMPTS) -> dict:
        """Sample every prompt with ``generate(prompt) -> continuation`` and ``check`` the texts."""
        return self.check(step, [(p, generate(p)) for p in prompts])

    def sample_check(self, step: int, model, tokenizer, seed: int, prompts: Sequence[str] = PROMPTS) -> dict:
        """Sample every prompt from an ``andrea.generate.InferenceModel`` and ``check`` the texts.

        Sampling uses ``coherence.max_new_tokens`` / ``temperature`` / ``top_k``; prompt i draws
        from a Generator seeded by ``(seed, step, i)``, so a check is reproducible, leaves no RNG
        state behind, and the prompts are decoded as one batch (``generate_batch``, up to the
        model's ``slots`` at a time) with the texts each gets alone; chat answers stop at the
        template's end tag.
        """
        from andrea.data.template import STOP_STRINGS
        from andrea.generate import SamplingOptions, generate_batch

        opts = SamplingOptions(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                               top_k=self.top_k, stop_strings=tuple(STOP_STRINGS))
        jobs = [(tokenizer.encode(p), opts, np.random.default_rng([int(seed), int(step), i]))
                for i, p in enumerate(prompts)]
        gens = generate_batch(model, jobs, eot_id=tokenizer.eot_id, tokenizer=tokenizer)
        return self.check(step, [(p, g.text) for p, g in zip(prompts, gens)])

    def observe_loss(self, step: int, loss: float, source: str = "") -> dict | None:
        """Fold one training loss of ``source`` in; returns ``{"reason", "step"}`` when that
        source's loss diverges."""
        if not math.isfinite(loss):
            return None  # NaN/inf steps are the engine's bad-step counter's business
        e = self.ema.setdefault(source, {"ema": loss, "best": None, "n": 0})
        e["ema"] = loss if e["n"] == 0 else DIVERGE_EMA * e["ema"] + (1 - DIVERGE_EMA) * loss
        e["n"] += 1
        if e["n"] < DIVERGE_WARM:
            return None
        if e["best"] is None or e["ema"] < e["best"]:
            e["best"] = e["ema"]
        if self.diverge_ratio > 0 and e["ema"] > self.diverge_ratio * e["best"]:
            where = f"{source} " if source else ""
            return {"reason": f"loss diverged: {where}EMA {e['ema']:.3f} > coherence.diverge_ratio "
                              f"{self.diverge_ratio:g} x best {e['best']:.3f}", "step": int(step)}
        return None

    def state_dict(self) -> dict:
        return {"streak": self.streak, "n_loss": self.n_loss,
                "loss": {k: dict(v) for k, v in sorted(self.ema.items())}}

    def load_state_dict(self, d: dict) -> None:
        try:
            self.streak = int(d["streak"])
            if "loss" in d:
                self.ema = {str(k): {"ema": float(v["ema"]), "n": int(v["n"]),
                                     "best": None if v["best"] is None else float(v["best"])}
                            for k, v in d["loss"].items()}
            else:                                      # a run saved before the per-source EMA
                self.ema = {} if d["loss_ema"] is None else {"": {
                    "ema": float(d["loss_ema"]), "n": int(d["n_loss"]),
                    "best": None if d["best_ema"] is None else float(d["best_ema"])}}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise AndreaError(f"coherence state: malformed ({e})") from None
