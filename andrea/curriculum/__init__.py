"""The training curriculum: which source each batch comes from, and the batch itself.

    from andrea.curriculum import make_curriculum
    cur = make_curriculum(settings.curriculum, settings.bandit, shards, phase="warmup", seed=settings.seed)
                                           # settings: andrea.settings.Settings; shards: {source: Shard}
    source, x, y = cur.next_batch(B, T)    # x, y: int32 (B, T); y is x shifted by one
    record = cur.observe(step, source, loss)  # once after every next_batch; a dict for .loss.json "pulls" or None
    state = cur.state_dict()               # JSON-able; cur.load_state_dict(state) resumes bit-exactly

Contract details the engine can rely on:
  * every row of one batch comes from the one ``source`` returned;
  * in the ``warmup`` phase only ``curriculum.warmup_sources`` that are present in
    ``shards`` are drawn (none present is an error); in ``main`` every shard is;
  * call ``observe`` exactly once after each ``next_batch``, with the loss of that batch
    (a NaN/inf loss is fine: it is ignored for the reward, the pull still advances);
  * ``state_dict()`` holds the two seeded PCG64 generators (``sample``: window starts;
    ``dice``: source choice and dwell rolls), the policy's whole state and every source's
    coverage bitset and token count; ``load_state_dict`` of it makes the same batches and
    pulls as an uninterrupted run. Loading a warmup state into a main-phase curriculum
    carries the learned statistics, RNGs and coverage over (that is how main continues
    from warmup);
  * ``summary()`` gives per-source figures (batches, epochs, coverage) for logs;
  * ``enter(row, step)`` switches to a row of the phase table (andrea/phases.py: the polish
    draws only ``curriculum.polish_sources``); the state records the row and its sources, so
    a run resumed inside the polish draws what the straight run draws.

Policy: ``bandit.policy`` = ``uniform`` (i.i.d. uniform over the eligible sources, plain
token-uniform windows) or ``ucb1`` (the FIREHOSE bandit in ``policy.py``; its coverage
bonus also weights window starts towards unseen documents). docs/curriculum.md explains
the design. Tests: ``pytest tests/test_curriculum.py``.
"""

from __future__ import annotations

import numpy as np

from andrea.curriculum.policy import POLICIES, UCB1Policy, UniformPolicy
from andrea.curriculum.sampler import SourceStream, sequential_windows
from andrea.errors import AndreaError
from andrea.settings import BanditSettings, CurriculumSettings
from andrea.shards import Shard

__all__ = ["Curriculum", "make_curriculum", "SourceStream", "sequential_windows", "UCB1Policy", "UniformPolicy"]

STATE_FORMAT = "andrea.curriculum/1"
PHASES = ("warmup", "main")


class Curriculum:
    """Batches from token shards, mixed across sources by a policy; fully resumable."""

    def __init__(self, curriculum: CurriculumSettings, bandit: BanditSettings, shards: dict[str, Shard], phase: str,
                 seed: int):
        if phase not in PHASES:
            raise AndreaError(f"curriculum phase {phase!r}: expected one of {', '.join(PHASES)}")
        if not shards:
            raise AndreaError("curriculum: no token shards given (expected data/tokens/<variant>/train/<source>.bin)")
        self.phase, self.seed = phase, int(seed)
        self.sources = sorted(shards)
        self.streams = {s: SourceStream(s, shards[s]) for s in self.sources}
        if phase == "warmup":
            wanted = list(curriculum.warmup_sources)
            self.eligible = [s for s in wanted if s in shards]
            if not self.eligible:
                raise AndreaError(f"curriculum.warmup_sources {wanted}: none of them has a shard "
                                  f"(shards: {', '.join(self.sources)})")
        else:
            self.eligible = list(self.sources)
        self.policy_name = bandit.policy
        if self.policy_name not in POLICIES:
            raise AndreaError(f"bandit.policy {self.policy_name!r}: expected one of {', '.join(POLICIES)}")
        self.policy = POLICIES[self.policy_name](self.sources, self.eligible, bandit, phase)
        self.bonus = bandit.coverage_bonus if self.policy_name == "ucb1" else 1.0
        ss_sample, ss_dice = np.random.SeedSequence(self.seed).spawn(2)
        self.rng = np.random.Generator(np.random.PCG64(ss_sample))
        self.dice = np.random.Generator(np.random.PCG64(ss_dice))
        self.last_source: str | None = None
        self.row = phase                          # the phase-table row drawn for (andrea/phases.py)

    def enter(self, row, step: int) -> dict | None:
        """Draw for phase-table row ``row`` (andrea.phases.Phase) from global ``step`` on: only its
        sources that have a shard (``row.sources`` None: every shard). The policy keeps its whole
        state for the sources it no longer draws (their EMAs, pull counts and rewards stand still
        until a later row draws them; the bandit's phase halvings go on for every arm) and scores only
        the drawn ones. A dwell never crosses a row boundary: an open pull is closed here with the
        reward of the batches it had, as a cut dwell is; its pull record (or None) is returned."""
        if row.name == self.row:
            return None
        wanted = list(self.sources if row.sources is None else row.sources)
        eligible = [s for s in wanted if s in self.streams]
        if not eligible:
            raise AndreaError(f"curriculum.{row.name}_sources {wanted}: none of them has a shard "
                              f"(shards: {', '.join(self.sources)})")
        rec = self.policy.cut(int(step) - 1, self.streams)      # an open dwell ends at the boundary
        self.row, self.eligible = row.name, eligible
        self.policy.eligible = eligible
        return rec

    def next_batch(self, batch_size: int, context: int) -> tuple[str, np.ndarray, np.ndarray]:
        """One batch: ``(source, x, y)``, x and y int32 (B, T), y[:, t] = x[:, t + 1] of the window."""
        source = self.policy.select(self.dice, self.streams)
        w = self.streams[source].draw(self.rng, int(batch_size), int(context), self.bonus)  # (B, T + 1)
        self.last_source = source
        return source, w[:, :-1].astype(np.int32), w[:, 1:].astype(np.int32)

    def observe(self, step: int, source: str, loss: float) -> dict | None:
        """Report the loss of the batch just drawn; returns a pull record when a pull ends."""
        if source not in self.streams:
            raise AndreaError(f"curriculum.observe(step={step}): unknown source {source!r}")
        return self.policy.observe(step, source, float(loss), self.streams)

    def summary(self) -> dict:
        return {s: {"batches": int(self.policy.batches[s]),
                    "epochs": st.epochs, "coverage": round(1.0 - st.unseen_share, 6), "passes": st.passes,
                    "ema": self.policy.rewards.ema[s]}
                for s, st in self.streams.items()}

    def state_dict(self) -> dict:
        return {
            "format": STATE_FORMAT,
            "policy": self.policy_name,
            "phase": self.phase,
            "seed": self.seed,
            "rng": {"sample": self.rng.bit_generator.state, "dice": self.dice.bit_generator.state},
            "sources": {s: st.state_dict() for s, st in self.streams.items()},
            "bandit": self.policy.state_dict(),
            "row": self.row,
            "eligible": list(self.eligible),
        }

    def load_state_dict(self, d: dict) -> None:
        if not isinstance(d, dict) or d.get("format") != STATE_FORMAT:
            raise AndreaError(f"curriculum state: expected format {STATE_FORMAT!r}, got "
                              f"{d.get('format') if isinstance(d, dict) else type(d).__name__!r}")
        if d.get("policy") != self.policy_name:
            raise AndreaError(f"curriculum state was made by bandit.policy={d.get('policy')!r}, "
                              f"this run has bandit.policy={self.policy_name!r}")
        missing = sorted(set(d.get("sources", {})) - set(self.streams))
        if missing:
            raise AndreaError(f"curriculum state names source(s) with no shard: {', '.join(missing)}")
        for s, sd in d["sources"].items():
            self.streams[s].load_state_dict(sd)
        try:
            self.rng.bit_generator.state = d["rng"]["sample"]
            self.dice.bit_generator.state = d["rng"]["dice"]
        except (KeyError, TypeError, ValueError) as e:
            raise AndreaError(f"curriculum state: bad RNG state ({e})") from None
        self.policy.load_state_dict(d["bandit"], same_phase=d.get("phase") == self.phase)
        if d.get("phase") == self.phase and d.get("row", self.phase) != self.row:   # resumed inside a later row
            eligible = [s for s in d.get("eligible", ()) if s in self.streams]
            if not eligible:
                raise AndreaError(f"curriculum state: row {d.get('row')!r} names no source with a shard")
            self.row, self.eligible = d["row"], eligible
            self.policy.eligible = eligible


def make_curriculum(curriculum: CurriculumSettings, bandit: BanditSettings, shards: dict[str, Shard], phase: str,
                    seed: int) -> Curriculum:
    """The curriculum for one training phase (``warmup`` | ``main``) over ``shards`` ({source: Shard})."""
    return Curriculum(curriculum, bandit, shards, phase, seed)
