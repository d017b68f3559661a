"""Recompute every logged ``ucb1`` score of a run from its pull records (the worked examples of
docs/FIREHOSE-BANDIT.md are this replay's output).

    python -m andrea.curriculum.replay --loss runs/tiny/main/model.loss.json --tokens data/tokens/tiny \
        --profile tiny [--step 332] [-S key=value ...]

A pull record (``model.loss.json`` ``"pulls"``; a main run's include the warmup's) holds the step,
source, reward, dwell, phase, the scores as they were when the pull was chosen and the source's
coverage when it ended. That is enough to rebuild the bandit's counts: apply the halvings at each
record's ``phase``, score the eligible sources (the keys of ``scores``) with the params' bandit.*,
then add the pull's reward and its batches. A source's coverage is the one of its previous record
(it changes only when the source is drawn); its drawn tokens are its batches x B x T. Prints the
largest relative gap between a recomputed and a logged score and, with ``--step``, every term of
that pull's scores. The records keep 7 significant digits, so a faithful replay agrees to ~1e-6.
Tests: ``pytest tests/test_curriculum_bandit.py -k replay``.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from andrea.curriculum.policy import UCB1Policy
from andrea.errors import AndreaError, exit_main
from andrea.settings import BanditSettings


@dataclass
class _Stream:
    """The figures of a source's stream that ``UCB1Policy`` scores with, rebuilt from the records."""

    n_tokens: int
    tokens_drawn: int = 0
    unseen_share: float = 1.0

    @property
    def epochs(self) -> int:
        return self.tokens_drawn // self.n_tokens


def replay(pulls: list[dict], n_tokens: dict[str, int], bandit: BanditSettings, B: int, T: int):
    """Yield ``(record, terms)`` for every pull, ``terms[source]`` the recomputed score and its parts
    (``n``, ``mean``, ``radius``, ``drawn``, ``epochs``, ``unseen``, ``score``) for each eligible
    source with a finite score, plus ``"_"``: ``{"N", "u", "fair"}``. The scores are the policy's
    own (``UCB1Policy.scores`` over the replayed counts and streams)."""
    srcs = sorted(n_tokens)
    pol = UCB1Policy(srcs, srcs, replace(bandit, floor=0.0, floors={}), "main")
    streams = {s: _Stream(int(n_tokens[s])) for s in srcs}
    phase = 0
    for rec in pulls:
        while phase < int(rec["phase"]):
            phase += 1
            for s in srcs:
                pol.n[s], pol.rsum[s], pol.rsq[s] = 0.5 * pol.n[s], 0.5 * pol.rsum[s], 0.5 * pol.rsq[s]
        pol.eligible = elig = list(rec["scores"])
        u = pol.reward_spread()
        total = sum(pol.n[s] for s in elig)
        log_n = math.log(total) if total > 1.0 else 0.0
        fair = sum(st.tokens_drawn for st in streams.values()) / len(elig)
        scores = pol.scores(streams)
        terms: dict = {"_": {"N": total, "u": u, "fair": fair}}
        for s in elig:
            if math.isinf(scores[s]):
                continue
            n = pol.n[s]
            terms[s] = {"n": n, "mean": pol.rsum[s] / n, "radius": bandit.ucb_c * u * math.sqrt(2.0 * log_n / n),
                        "drawn": streams[s].tokens_drawn, "epochs": pol.epochs(s, streams),
                        "unseen": streams[s].unseen_share, "score": scores[s]}
        yield rec, terms
        st = streams[rec["source"]]
        st.tokens_drawn += int(rec.get("dwell", 1)) * B * T
        st.unseen_share = 1.0 - float(rec["coverage"])
        if rec.get("reward") is not None:
            r, src = float(rec["reward"]), rec["source"]
            pol.n[src], pol.rsum[src], pol.rsq[src] = pol.n[src] + 1.0, pol.rsum[src] + r, pol.rsq[src] + r * r


def max_gap(pulls, n_tokens, bandit, B, T) -> float:
    """The largest relative gap between a recomputed and a logged finite score."""
    worst = 0.0
    for rec, terms in replay(pulls, n_tokens, bandit, B, T):
        for s, v in rec["scores"].items():
            if v is not None and s in terms:
                worst = max(worst, abs(terms[s]["score"] - v) / max(abs(v), 1e-12))
    return worst


def main(argv=None) -> int:
    from andrea.config import load_config
    from andrea.settings import Settings
    from andrea.shards import Shard

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loss", required=True, help="a run's model.loss.json (a main run's holds the warmup's pulls too)")
    p.add_argument("--tokens", required=True, help="the tokens folder the run trained on (train/<source>.bin)")
    p.add_argument("--profile", default="tiny")
    p.add_argument("--params", default="params.yaml")
    p.add_argument("-S", "--set", action="append", default=[], metavar="KEY=VALUE", help="the run's overrides")
    p.add_argument("--step", type=int, help="print every term of the scores of the pull at this step")
    args = p.parse_args(argv)
    st = Settings.from_dict(load_config(args.params, args.profile, args.set))
    try:
        pulls = json.loads(Path(args.loss).read_text(encoding="utf-8"))["pulls"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise AndreaError(f"{args.loss}: no pull records to replay ({e})") from None
    names = {s for r in pulls for s in r["scores"]}
    n_tokens = {}
    for s in sorted(names):
        f = Path(args.tokens) / "train" / f"{s}.bin"
        if not f.exists():
            raise AndreaError(f"{f}: missing; --tokens must be the folder the run trained on")
        n_tokens[s] = int(Shard(f).n_tokens)
    B, T = st.train.batch_size, st.model.context
    for rec, terms in replay(pulls, n_tokens, st.bandit, B, T):
        if args.step is not None and int(rec["step"]) == args.step:
            g = terms["_"]
            print(f"step {rec['step']}: pulled {rec['source']} ({rec['why']}), phase {rec['phase']}, "
                  f"N {g['N']:.4f}, u {g['u']:.4f}, fair {g['fair']:.0f} tokens")
            for s in rec["scores"]:
                t = terms.get(s)
                if t is None:
                    print(f"  {s:12s} untried (+inf)")
                    continue
                print(f"  {s:12s} n {t['n']:.4f} mean {t['mean']:.4f} radius {t['radius']:.4f} drawn {t['drawn']} "
                      f"epochs {t['epochs']:.4f} unseen {t['unseen']:.5f} score {t['score']:.5f} "
                      f"(logged {rec['scores'][s]})")
    print(f"{len(pulls)} pulls: largest relative gap to the logged scores {max_gap(pulls, n_tokens, st.bandit, B, T):.2g}")
    return 0


if __name__ == "__main__":
    exit_main(main, "replay")
