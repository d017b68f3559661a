"""Source-mixing policies: ``uniform`` (the baseline) and ``ucb1`` (the FIREHOSE bandit).

A policy picks the source of every batch (``select``) and learns from the loss the
engine reports back (``observe``). Both keep a per-source loss EMA
``ema <- a * ema + (1 - a) * loss`` (a = ``bandit.ema``; the first loss of a source
sets it) and derive the reward of an observation from it:

  * ``bandit.reward: progress`` -- learning progress, the drop of the EMA
    ``(ema_before - ema_after) * bandit.reward_scale``, divided by the batches since the
    source's previous batch when ``bandit.progress_per_step`` is true;
  * ``bandit.reward: relative`` -- the same drop over ``ema_before`` (progress as a share of
    the source's own loss level);
  * ``bandit.reward: loss`` -- the ODM-style ablation: the EMA itself (in nats, not
    scaled), so the bandit prefers the sources the model still finds hard.

``UCB1Policy`` (docs/FIREHOSE-BANDIT.md is its spec with a worked example and the
measurements behind the defaults; docs/curriculum.md the reading of the seeds):
  * a *pull* chooses a source and holds it for a dwell of 1dN batches rolled on the
    seeded dice (N = ``bandit.dice_warmup`` in the warmup phase, ``bandit.dice_main``
    after; both 1 by default, one batch a pull); its reward is the mean reward over its
    batches. A pull with no reward at all (a source's very first batch only starts its
    EMA; NaN losses) does not count as a pull, so a source is never judged on a reward of
    0 it could not have earned;
  * the run is cut into phases of ``bandit.phases[k % len] * bandit.phase_unit``
    batches; a dwell never crosses a phase boundary, and at each boundary the bandit
    halves its pull counts and reward sums (means kept, confidence widened), so it
    re-explores on the 7/14/21/28/42 cadence while learning progress drifts;
  * score of source i: the UCB1 index ``mean_i + c * u * sqrt(2 ln N / n_i)`` (an unpulled
    source scores +inf; u = 1 with ``bandit.ucb_scale: one``, the pooled within-source
    standard deviation of pull rewards with ``std``), times the epoch penalty
    ``1 / (1 + epochs_i)`` (epochs counted as ``bandit.epoch_penalty`` says: ``tokens``,
    ``excess`` or ``none``; see ``UCB1Policy.epochs``), times the
    freshness factor ``1 + (bonus - 1) * unseen_share_i``. A factor below one always
    lowers a score and one above one always raises it: a negative score is divided by
    the factor instead of multiplied;
  * floors: before scoring, a source that is a whole batch or more behind its floor share
    x (this phase's batches) is pulled (largest deficit first), so every source keeps its
    floor share to within a batch and a dwell. The share is ``bandit.floors[source]`` where
    given, else ``bandit.floor``.

Policies hold no RNG of their own: the curriculum passes its seeded dice generator, so
the whole state is the curriculum's ``state_dict()``. Tests: ``pytest tests/test_curriculum.py``.
"""

from __future__ import annotations

import math

import numpy as np

from andrea.errors import AndreaError
from andrea.settings import BanditSettings


def _finite(v: float | None) -> float | None:
    """JSON-safe number for a log record: inf/nan become None; 7 significant digits."""
    return None if v is None or not math.isfinite(v) else float(f"{v:.7g}")


def apply_factor(score: float, factor: float) -> float:
    """Scale a score so that factor < 1 lowers it and factor > 1 raises it, whatever its sign."""
    if not math.isfinite(score):
        return score
    return score * factor if score >= 0 else score / factor


class _EmaRewards:
    """Per-source loss EMA and the reward derived from it."""

    def __init__(self, sources: list[str], bandit: BanditSettings):
        self.a = bandit.ema
        self.mode = bandit.reward
        self.scale = bandit.reward_scale
        self.per_step = bandit.progress_per_step
        self.ema: dict[str, float | None] = {s: None for s in sources}
        self.last: dict[str, int | None] = {s: None for s in sources}  # batch index of the EMA's last update

    def update(self, source: str, loss: float, t: int) -> float | None:
        """Fold the loss of batch ``t`` into the source's EMA; return the reward, or None when
        there is none: a non-finite loss, or (progress) the source's first loss, which only
        starts its EMA. With ``progress_per_step`` the drop is divided by the batches since
        the EMA's previous update, so a source is not credited for what it learned while
        others were trained."""
        if not math.isfinite(loss):
            return None
        before, last = self.ema[source], self.last[source]
        after = loss if before is None else self.a * before + (1.0 - self.a) * loss
        self.ema[source], self.last[source] = after, int(t)
        if self.mode == "loss":
            return after
        if before is None:
            return None
        gap = max(1, int(t) - last) if self.per_step and last is not None else 1
        drop = before - after
        if self.mode == "relative":  # the drop as a share of the source's own loss level
            drop /= max(abs(before), 1e-12)
        return drop * self.scale / gap

    def state_dict(self) -> dict:
        return {"ema": dict(self.ema), "last": dict(self.last)}

    def load_state_dict(self, d: dict) -> None:
        for s, v in d.get("ema", {}).items():
            if s in self.ema:
                self.ema[s] = None if v is None else float(v)
        for s, v in d.get("last", {}).items():
            if s in self.last:
                self.last[s] = None if v is None else int(v)


class UniformPolicy:
    """Every batch from a source chosen uniformly at random among the eligible ones."""

    name = "uniform"

    def __init__(self, sources: list[str], eligible: list[str], bandit: BanditSettings, phase: str):
        self.sources, self.eligible = sources, eligible
        self.rewards = _EmaRewards(sources, bandit)
        self.batches = {s: 0 for s in sources}    # batches drawn in this training phase
        self.t = 0                                # batches drawn in total
        self.current: str | None = None

    def select(self, dice: np.random.Generator, streams: dict) -> str:
        self.current = self.eligible[int(dice.integers(len(self.eligible)))]
        self.batches[self.current] += 1
        self.t += 1
        return self.current

    def observe(self, step: int, source: str, loss: float, streams: dict) -> dict | None:
        r = self.rewards.update(source, loss, self.t)
        share = 1.0 / len(self.eligible)
        return {"step": int(step), "source": source, "reward": _finite(r), "why": "uniform", "dwell": 1,
                "scores": {s: share for s in self.eligible}, "ema": _finite(self.rewards.ema[source]),
                "epochs": streams[source].epochs, "coverage": 1.0 - streams[source].unseen_share}

    def cut(self, last_step: int, streams: dict) -> None:
        """Uniform holds no pull across batches: nothing to end at a row boundary."""
        return None

    def state_dict(self) -> dict:
        return {"rewards": self.rewards.state_dict(), "batches": dict(self.batches), "t": self.t,
                "current": self.current}

    def load_state_dict(self, d: dict, same_phase: bool) -> None:
        self.rewards.load_state_dict(d.get("rewards", {}))
        self.t = int(d.get("t", 0))
        self.current = d.get("current") if same_phase else None
        if same_phase:
            for s, v in d.get("batches", {}).items():
                if s in self.batches:
                    self.batches[s] = int(v)


class UCB1Policy:
    """The FIREHOSE bandit: UCB1 over sources with dice dwell, phases, floors, epochs, coverage."""

    name = "ucb1"

    def __init__(self, sources: list[str], eligible: list[str], bandit: BanditSettings, phase: str):
        b = bandit
        self.sources, self.eligible = sources, eligible
        self.rewards = _EmaRewards(sources, b)
        self.c = b.ucb_c
        self.ucb_scale = b.ucb_scale
        self.phases = list(b.phases)
        self.unit = b.phase_unit
        self.die = b.dice_warmup if phase == "warmup" else b.dice_main
        self.floor = {s: float(b.floors.get(s, b.floor)) for s in sources}
        self.bonus = b.coverage_bonus
        self.epoch_unit = b.epoch_penalty
        if sum(self.floor[s] for s in eligible) > 1.0 + 1e-9:
            named = ", ".join(f"{s} {self.floor[s]:g}" for s in eligible if s in b.floors)
            raise AndreaError(f"bandit.floor = {b.floor}" + (f" (bandit.floors: {named})" if named else "")
                              + f": the {len(eligible)} sources cannot each keep their share (the floors of "
                              f"{', '.join(eligible)} must add up to <= 1)")
        self.n = {s: 0.0 for s in sources}        # pulls, halved at each phase boundary
        self.rsum = {s: 0.0 for s in sources}     # summed pull rewards, halved alongside
        self.rsq = {s: 0.0 for s in sources}      # summed squared pull rewards, halved alongside
        self.batches = {s: 0 for s in sources}    # batches drawn in this training phase (floors)
        self.t = 0                                # batches drawn in total
        self.phase_idx = 0
        self.phase_end = self.phases[0] * self.unit
        self.pull: dict | None = None

    # ---- scoring ---------------------------------------------------------------------
    def reward_spread(self) -> float:
        """The unit of the confidence radius: 1 (``ucb_scale: one``, plain UCB1, which assumes
        rewards in [0, 1]) or (``std``) the pooled within-source standard deviation of pull
        rewards, so exploration keeps pace with however large the rewards are (progress x1000
        is in the hundreds early in a run and near 1 late)."""
        if self.ucb_scale == "one":
            return 1.0
        num = den = 0.0
        for s in self.eligible:
            if self.n[s] > 1.0:
                num += max(0.0, self.rsq[s] - self.rsum[s] ** 2 / self.n[s])
                den += self.n[s] - 1.0
        if den <= 0.0:
            n = sum(self.n[s] for s in self.eligible)
            if n <= 1.0:
                return 1.0
            mean = sum(self.rsum[s] for s in self.eligible) / n
            num, den = max(0.0, sum(self.rsq[s] for s in self.eligible) - n * mean * mean), n - 1.0
        return math.sqrt(num / den) if num > 0.0 else 1.0

    def epochs(self, source: str, streams: dict) -> float:
        """The epochs the penalty counts (``bandit.epoch_penalty``): ``tokens``, the completed
        passes over the source's tokens; ``excess``, the passes drawn beyond what the uniform
        mix would have drawn by now (all sources' tokens / eligible sources), so a source is
        penalised only for the repetition the bandit adds; ``none``, no penalty."""
        if self.epoch_unit == "none":
            return 0.0
        st = streams[source]
        if self.epoch_unit == "tokens":
            return float(st.epochs)
        fair = sum(streams[s].tokens_drawn for s in self.sources) / len(self.eligible)
        return max(0.0, (st.tokens_drawn - fair) / st.n_tokens)

    def scores(self, streams: dict) -> dict[str, float]:
        total = sum(self.n[s] for s in self.eligible)
        log_n = math.log(total) if total > 1.0 else 0.0
        unit = self.reward_spread()
        out = {}
        for s in self.eligible:
            if self.n[s] <= 0.0:
                out[s] = math.inf
                continue
            idx = self.rsum[s] / self.n[s] + self.c * unit * math.sqrt(2.0 * log_n / self.n[s])
            idx = apply_factor(idx, 1.0 / (1.0 + self.epochs(s, streams)))
            out[s] = apply_factor(idx, 1.0 + (self.bonus - 1.0) * streams[s].unseen_share)
        return out

    def _advance_phase(self) -> None:
        while self.t >= self.phase_end:
            self.phase_idx += 1
            self.phase_end += self.phases[self.phase_idx % len(self.phases)] * self.unit
            for s in self.sources:
                self.n[s] *= 0.5
                self.rsum[s] *= 0.5
                self.rsq[s] *= 0.5

    def _choose(self, dice: np.random.Generator, scores: dict[str, float]) -> tuple[str, str]:
        total = sum(self.batches[s] for s in self.eligible)
        if total > 0:
            deficit = {s: self.floor[s] * total - self.batches[s] for s in self.eligible}
            worst = max(self.eligible, key=lambda s: (deficit[s], -self.eligible.index(s)))
            if deficit[worst] >= 1.0:  # a whole batch behind its floor share
                return worst, "floor"
        unpulled = [s for s in self.eligible if math.isinf(scores[s])]
        if unpulled:  # the least tried of the untried sources, ties by the dice
            fewest = min(self.batches[s] for s in unpulled)
            unpulled = [s for s in unpulled if self.batches[s] == fewest]
            return unpulled[int(dice.integers(len(unpulled)))], "explore"
        best = max(scores.values())
        top = [s for s in self.eligible if scores[s] == best]
        return top[int(dice.integers(len(top)))] if len(top) > 1 else top[0], "ucb"

    # ---- the policy interface ----------------------------------------------------------
    def select(self, dice: np.random.Generator, streams: dict) -> str:
        if self.pull is not None and self.pull["left"] <= 0:
            self._finish()  # the engine skipped observe() on the pull's last batch
        if self.pull is None:
            self._advance_phase()
            sc = self.scores(streams)
            source, why = self._choose(dice, sc)
            roll = int(dice.integers(1, self.die + 1))
            dwell = min(roll, self.phase_end - self.t)
            self.pull = {"source": source, "why": why, "dwell": dwell, "left": dwell, "rsum": 0.0, "k": 0,
                         "scores": {s: _finite(v) for s, v in sc.items()}, "phase": self.phase_idx}
        self.pull["left"] -= 1
        self.t += 1
        source = self.pull["source"]
        self.batches[source] += 1
        return source

    def observe(self, step: int, source: str, loss: float, streams: dict) -> dict | None:
        if self.pull is None or source != self.pull["source"]:
            want = None if self.pull is None else self.pull["source"]
            raise AndreaError(f"curriculum.observe(step={step}): loss reported for source {source!r} but the "
                              f"open pull is {want!r}; call observe once after each next_batch")
        r = self.rewards.update(source, loss, self.t)
        if r is not None:
            self.pull["rsum"] += r
            self.pull["k"] += 1
        if self.pull["left"] > 0:
            return None
        return self._stamp(self._finish(), step, streams)

    def cut(self, last_step: int, streams: dict) -> dict | None:
        """End the open pull early (a phase-table row boundary: a dwell never crosses one), credited
        with the batches it had; its record (``last_step``: the step of its last batch), or None."""
        if self.pull is None:
            return None
        drawn = self.pull["dwell"] - self.pull["left"]
        rec = self._stamp(self._finish(), last_step, streams)
        rec["dwell"] = drawn
        return rec

    @staticmethod
    def _stamp(rec: dict, step: int, streams: dict) -> dict:
        """A finished pull's record with its step and its source's epochs and coverage."""
        st = streams[rec["source"]]
        rec.update(step=int(step), epochs=st.epochs, coverage=1.0 - st.unseen_share)
        return rec

    def _finish(self) -> dict:
        p, self.pull = self.pull, None
        s = p["source"]
        reward = p["rsum"] / p["k"] if p["k"] else None
        if reward is not None:
            self.n[s] += 1.0
            self.rsum[s] += reward
            self.rsq[s] += reward * reward
        return {"step": None, "source": s, "reward": _finite(reward), "why": p["why"], "dwell": p["dwell"],
                "phase": p["phase"], "scores": p["scores"], "ema": _finite(self.rewards.ema[s])}

    def state_dict(self) -> dict:
        return {"rewards": self.rewards.state_dict(), "n": dict(self.n), "rsum": dict(self.rsum),
                "rsq": dict(self.rsq),
                "batches": dict(self.batches), "t": self.t, "phase_idx": self.phase_idx,
                "phase_end": self.phase_end, "pull": None if self.pull is None else dict(self.pull)}

    def load_state_dict(self, d: dict, same_phase: bool) -> None:
        """Restore; a state from the other training phase keeps what was learned (EMAs,
        counts, the phase clock) but starts the floors' batch shares and the pull afresh."""
        self.rewards.load_state_dict(d.get("rewards", {}))
        try:
            for key in ("n", "rsum", "rsq"):
                for s, v in d[key].items():
                    if s in self.sources:
                        getattr(self, key)[s] = float(v)
            self.t, self.phase_idx, self.phase_end = int(d["t"]), int(d["phase_idx"]), int(d["phase_end"])
            if same_phase:
                for s, v in d["batches"].items():
                    if s in self.sources:
                        self.batches[s] = int(v)
                self.pull = None if d["pull"] is None else dict(d["pull"])
            else:
                self.pull = None
        except (KeyError, TypeError, ValueError) as e:
            raise AndreaError(f"curriculum state (bandit): malformed ({e})") from None


POLICIES = {"uniform": UniformPolicy, "ucb1": UCB1Policy}
