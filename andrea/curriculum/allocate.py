"""Predict the source mix a bandit setting gives, in seconds and without training.

    python -m andrea.curriculum.allocate --tokens data/tokens/andrea-12m --profile andrea-12m \
        -S train.max_steps=3000 -S curriculum.warmup_steps=1000 -S curriculum.polish_steps=0 \
        -S bandit.floor=0.1 [--seeds 1337,1,2] [--reward-mean 3.0 --reward-spread 8.5]

It runs the real curriculum (andrea/curriculum: the params' bandit.*, the phase table's rows, the
real shards' sizes, coverage and seeded dice) step by step, as the train stage would, but every
reward a pull earns is drawn from N(``--reward-mean``, ``--reward-spread``) instead of coming from
a model's loss. Why that predicts the mix: at 12M the training-loss rewards cannot separate the
sources (their pooled within-source spread is several times every gap between their means;
docs/FIREHOSE-BANDIT.md, "Why the small sources starve"), so the epoch penalty, the floors and the
UCB radius set the shares, and those this replay runs for real. The defaults are the measured late
figures (means 1.6-3.3, spread 8.5). Checked against one device call (FIREHOSE-BANDIT.md, "At the
recipe's LR-warmup share"): floors are predicted to the batch (``floor: 0.1``: every source 0.10 of
the last third, py-code 0.30; measured 0.100 and 0.297), penalties roughly (``floors: {}``: py-code
0.40 of all batches, measured 0.32, since its real rewards are the lowest); with today's per-source
floors the rest is close (py-code 0.228 of all batches, 0.337 of the last third; measured 0.222, 0.320). Use it to choose the mixes
worth a device call, not to replace one.

Prints each source's share of all batches and of the last third's (the two shares
bench/curriculum_compare.py reports), means over the seeds.
Tests: ``pytest tests/test_curriculum_allocate.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from andrea.curriculum import make_curriculum
from andrea.errors import AndreaError, exit_main
from andrea.phases import phase_at, phase_table, stage_rows


class DrawnRewards:
    """Stands in for a policy's loss EMA (``policy._EmaRewards``): every reward a seeded normal draw."""

    def __init__(self, sources: list[str], rng: np.random.Generator, mean: float, spread: float):
        self.rng, self.mean, self.spread = rng, float(mean), float(spread)
        self.ema: dict[str, float | None] = {s: None for s in sources}

    def update(self, source: str, loss: float, t: int) -> float:
        return float(self.rng.normal(self.mean, self.spread))

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, d: dict) -> None:
        return None


def allocate(settings, shards: dict, seed: int, mean: float = 3.0, spread: float = 8.5) -> dict:
    """Batches per source over a whole run (warmup then main, rows entered as train.py enters them)
    with drawn rewards: ``{"all": {source: batches}, "late": {source: batches of the last third}}``."""
    table = phase_table(settings.train, settings.curriculum)
    B, T, total = settings.train.batch_size, settings.model.context, settings.train.max_steps
    late_from = total * 2 // 3
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 7]))   # apart from the curriculum's streams
    counts = {"all": {s: 0 for s in shards}, "late": {s: 0 for s in shards}}
    state = None
    for stage in ("warmup", "main"):
        rows = stage_rows(table, stage)
        if not rows:
            continue
        cur = make_curriculum(settings.curriculum, settings.bandit, shards, stage, seed)
        if state is not None:
            cur.load_state_dict(state)
        cur.policy.rewards = DrawnRewards(cur.sources, rng, mean, spread)
        for step in range(rows[0].start, rows[-1].end):
            cur.enter(phase_at(table, step), step)
            src, _, _ = cur.next_batch(B, T)
            counts["all"][src] += 1
            if step >= late_from:
                counts["late"][src] += 1
            cur.observe(step, src, 0.0)
        state = cur.state_dict()
    return counts


def shares(counts: dict[str, int]) -> dict[str, float]:
    n = sum(counts.values()) or 1
    return {s: c / n for s, c in counts.items()}


def main(argv=None) -> int:
    from andrea.config import load_config
    from andrea.settings import Settings
    from andrea.shards import Shard

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", required=True, help="a tokens folder (train/<source>.bin)")
    p.add_argument("--profile", default="tiny")
    p.add_argument("--params", default="params.yaml")
    p.add_argument("-S", "--set", action="append", default=[], metavar="KEY=VALUE", help="overrides, as for a run")
    p.add_argument("--seeds", default="1337", help="comma-separated seeds")
    p.add_argument("--reward-mean", type=float, default=3.0)
    p.add_argument("--reward-spread", type=float, default=8.5)
    args = p.parse_args(argv)
    st = Settings.from_dict(load_config(args.params, args.profile, args.set))
    files = sorted((Path(args.tokens) / "train").glob("*.bin"))
    if not files:
        raise AndreaError(f"{Path(args.tokens) / 'train'}: no <source>.bin shards; --tokens must be a tokens folder")
    shards = {f.stem: Shard(f) for f in files}
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    runs = [allocate(st, shards, s, args.reward_mean, args.reward_spread) for s in seeds]
    print(f"bandit.policy {st.bandit.policy}, {st.train.max_steps} steps, seeds {seeds}, rewards "
          f"N({args.reward_mean}, {args.reward_spread}): share of all batches, of the last third's")
    for s in sorted(shards):
        a = np.mean([shares(r["all"])[s] for r in runs])
        late = np.mean([shares(r["late"])[s] for r in runs])
        print(f"  {s:14s} {a:.3f}  {late:.3f}")
    return 0


if __name__ == "__main__":
    exit_main(main, "allocate")
