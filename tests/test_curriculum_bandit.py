"""Simulations of the FIREHOSE bandit on synthetic sources with known learning curves.

    pytest tests/test_curriculum_bandit.py

No network is trained: each source has a fake loss that depends only on how many
batches of that source were drawn so far (plus seeded noise), e.g. one source is learned
after a few dozen batches while another keeps improving for hundreds. The tests check
the behaviour the seeds ask for: pulls move to the source still learning, floors hold,
the epoch penalty spreads pulls, the coverage bonus raises coverage, the dice and phases
behave as documented, and a run is reproducible from its seed.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import replace

import numpy as np
import pytest

from andrea.config import load_config
from andrea.errors import AndreaError
from andrea.curriculum import make_curriculum
from andrea.curriculum.policy import apply_factor
from andrea.curriculum.sampler import SourceStream
from andrea.settings import Settings
from andrea.shards import Shard, ShardWriter

VOCAB = 1000


def curriculum_of(cfg: dict, shards, phase, seed):
    """The curriculum of a test config dict: its typed sections, as the train stage hands them down."""
    s = Settings.from_dict(cfg)
    return make_curriculum(s.curriculum, s.bandit, shards, phase, seed)


def write_shard(path, n_docs, doc_len, seed=0):
    rng = np.random.default_rng(seed)
    with ShardWriter(path, vocab_size=VOCAB, eot_id=VOCAB - 1) as w:
        for _ in range(n_docs):
            w.add(rng.integers(0, VOCAB - 1, size=doc_len))
    return Shard(path)


CURVES = {
    "learned": lambda k: 2.0 + 3.0 * math.exp(-k / 15.0),    # flat after ~50 batches
    "learning": lambda k: 2.0 + 3.0 * math.exp(-k / 600.0),  # keeps improving for the whole run
    "noise": lambda k: 4.0,                                  # nothing to learn
    "slow": lambda k: 2.0 + 3.0 * math.exp(-k / 300.0),
}


@pytest.fixture(scope="module")
def base_cfg():
    c = load_config("params.yaml", "tiny")
    c["bandit"]["policy"] = "ucb1"
    return c


def simulate(cfg, shards, steps, seed=0, noise=0.02, curves=CURVES, B=2, T=8, phase="main", cur=None):
    """Drive a curriculum with fake losses; returns (curriculum, sources per batch, pull records)."""
    cur = cur or curriculum_of(cfg, shards, phase, seed)
    rng = np.random.default_rng(seed + 1000)
    k = {s: 0 for s in shards}
    order, pulls = [], []
    for step in range(steps):
        src, _, _ = cur.next_batch(B, T)
        k[src] += 1
        loss = curves[src](k[src]) + noise * rng.standard_normal()
        rec = cur.observe(step, src, loss)
        order.append(src)
        if rec is not None:
            pulls.append(rec)
    return cur, order, pulls


@pytest.fixture(scope="module")
def big_shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("big")
    return {s: write_shard(d / f"{s}.bin", 400, 50, seed=i) for i, s in enumerate(["learned", "learning", "noise"])}


def test_pulls_move_to_the_source_still_learning(base_cfg, big_shards):
    cur, order, pulls = simulate(base_cfg, big_shards, 900)
    late = order[300:]
    share = {s: late.count(s) / len(late) for s in big_shards}
    assert share["learning"] > 0.6, share
    assert share["learning"] > 3 * share["learned"] and share["learning"] > 3 * share["noise"], share
    # the uniform baseline spreads evenly on the same sources
    u = copy.deepcopy(base_cfg)
    u["bandit"]["policy"] = "uniform"
    _, uorder, _ = simulate(u, big_shards, 900)
    assert uorder[300:].count("learning") / 600 < 0.45


def test_loss_reward_prefers_the_hard_source(base_cfg, big_shards):
    c = copy.deepcopy(base_cfg)
    c["bandit"]["reward"] = "loss"
    _, order, _ = simulate(c, big_shards, 600)
    late = order[200:]
    # "noise" sits at 4.0 nats while the others fall towards 2.0: ODM-style reward chases it
    assert late.count("noise") > max(late.count("learned"), late.count("learning")), \
        {s: late.count(s) for s in big_shards}


def test_floors_hold(base_cfg, big_shards):
    c = copy.deepcopy(base_cfg)
    c["bandit"]["floor"] = 0.25
    steps = 900
    cur, order, pulls = simulate(c, big_shards, steps)
    die = c["bandit"]["dice_main"]
    for s in big_shards:
        assert order.count(s) / steps >= 0.25 - (die + 1) / steps, (s, order.count(s))
    assert any(p["why"] == "floor" for p in pulls)
    # without a floor the learned or the noise source falls well below that share
    c["bandit"]["floor"] = 0.0
    _, order0, _ = simulate(c, big_shards, steps)
    assert min(order0.count("learned"), order0.count("noise")) / steps < 0.2


def test_floor_that_cannot_hold_is_refused(base_cfg, big_shards):
    c = copy.deepcopy(base_cfg)
    c["bandit"]["floor"] = 0.4
    with pytest.raises(Exception, match="bandit.floor"):
        curriculum_of(c, big_shards, "main", 0)


def test_per_source_floors_hold_each_their_own_share(base_cfg, big_shards):
    # bandit.floors gives one source a share of its own; the others keep bandit.floor. Without it
    # that source falls far below the share (the test above), so the floor pulls are what hold it.
    c = copy.deepcopy(base_cfg)
    src = sorted(big_shards)[0]
    c["bandit"].update(floor=0.05, floors={src: 0.5})
    steps = 900
    _, order, pulls = simulate(c, big_shards, steps)
    slack = (c["bandit"]["dice_main"] + 1) / steps
    assert order.count(src) / steps >= 0.5 - slack, order.count(src)
    for s in big_shards:
        assert order.count(s) / steps >= 0.05 - slack, (s, order.count(s))
    c["bandit"]["floors"] = {}
    _, order0, _ = simulate(c, big_shards, steps)
    assert order0.count(src) / steps < 0.45, order0.count(src)


def test_per_source_floors_that_cannot_hold_are_refused(base_cfg, big_shards):
    c = copy.deepcopy(base_cfg)
    a, b = sorted(big_shards)[:2]
    c["bandit"].update(floor=0.1, floors={a: 0.5, b: 0.45})
    with pytest.raises(AndreaError, match=f"bandit.floors: {a} 0.5, {b} 0.45"):
        curriculum_of(c, big_shards, "main", 0)


def test_epoch_penalty_spreads_pulls(base_cfg, tmp_path):
    # Source "a" learns faster than "b", so with both shards large the bandit leans to "a".
    # Make "a" small enough that its epochs count climbs during the run: its score is cut
    # by 1/(1+epochs) and the pulls spread to "b".
    c = copy.deepcopy(base_cfg)
    c["bandit"]["floor"] = 0.0
    curves = {"a": lambda k: 2.0 + 3.0 * math.exp(-k / 250.0), "b": CURVES["learning"]}
    big_a = write_shard(tmp_path / "a_big.bin", 400, 50, seed=1)
    big_b = write_shard(tmp_path / "b_big.bin", 400, 50, seed=2)
    small_a = write_shard(tmp_path / "a_small.bin", 20, 10, seed=3)  # 220 tokens: an epoch every ~14 batches
    shares_small, shares_big = [], []
    for seed in range(3):
        cur, order, _ = simulate(c, {"a": small_a, "b": big_b}, 600, seed=seed, curves=curves)
        shares_small.append(order.count("a") / len(order))
        assert cur.streams["a"].epochs >= 1  # the penalty engaged (1d1 dwell: ~20 of 600 batches)
        cur2, order2, _ = simulate(c, {"a": big_a, "b": big_b}, 600, seed=seed, curves=curves)
        shares_big.append(order2.count("a") / len(order2))
        assert cur2.streams["a"].epochs == 0
    assert np.mean(shares_big) > 0.5, shares_big
    assert np.mean(shares_small) < 0.25, shares_small


def test_coverage_bonus_raises_document_coverage_inside_a_source(tmp_path):
    sh = write_shard(tmp_path / "c.bin", 2000, 20, seed=5)
    cov = {}
    for bonus in (1.0, 1.3, 3.0):
        vals = []
        for seed in range(3):
            st = SourceStream("c", sh)
            rng = np.random.default_rng(seed)
            for _ in range(150):
                st.draw(rng, B=8, T=8, bonus=bonus)
            assert st.passes == 0
            vals.append(1.0 - st.unseen_share)
        cov[bonus] = np.mean(vals)
    assert cov[1.0] < cov[1.3] < cov[3.0], cov
    assert cov[1.3] - cov[1.0] > 0.015, cov


def test_coverage_bonus_steers_source_choice_to_fresh_documents(base_cfg, tmp_path):
    # Two same-sized sources with nothing to learn (flat loss); "stale" starts with 90% of
    # its documents already seen in this pass. Without the bonus the bandit splits its
    # pulls about evenly; with it, the fresh source is favoured and total coverage rises.
    flat = {"stale": lambda k: 3.0, "fresh": lambda k: 3.0}
    shards = {"stale": write_shard(tmp_path / "s.bin", 3000, 30, seed=1),
              "fresh": write_shard(tmp_path / "f.bin", 3000, 30, seed=2)}
    res = {}
    for bonus in (1.0, 1.3, 3.0):
        c = copy.deepcopy(base_cfg)
        c["bandit"].update(coverage_bonus=bonus, floor=0.0, reward="loss")
        shares, seen = [], []
        for seed in range(3):
            cur = curriculum_of(c, shards, "main", seed)
            cur.streams["stale"]._mark_range(0, 2700)
            cur, order, _ = simulate(c, shards, 400, seed=seed, curves=flat, noise=0.0, cur=cur)
            shares.append(order.count("fresh") / len(order))
            seen.append(cur.streams["fresh"].n_seen + cur.streams["stale"].n_seen - 2700)
        res[bonus] = (np.mean(shares), np.mean(seen))
    assert abs(res[1.0][0] - 0.5) < 0.1, res
    assert res[1.3][0] > res[1.0][0] + 0.05 and res[3.0][0] > res[1.3][0], res
    assert res[3.0][1] > res[1.3][1] > res[1.0][1], res


def test_dice_dwell_and_phases(base_cfg, big_shards):
    c = copy.deepcopy(base_cfg)
    c["bandit"].update(phases=[3, 5], phase_unit=2, dice_main=4, dice_warmup=3)
    c["curriculum"]["warmup_sources"] = ["learned", "learning", "noise"]
    for phase, die in (("main", 4), ("warmup", 3)):
        cur, order, pulls = simulate(c, big_shards, 400, phase=phase)
        dwells = [p["dwell"] for p in pulls]
        assert sum(dwells) == 400 and set(dwells) <= set(range(1, die + 1))
        assert max(dwells) == die  # the full die is rolled
        # phase boundaries at 6, 16, 22, 32, ... (3 and 5 units of 2 batches, cycling): no dwell crosses one
        bounds, b, i = set(), 0, 0
        while b < 400:
            b += [6, 10][i % 2]
            i += 1
            bounds.add(b)
        t = 0
        for p in pulls:
            assert not any(t < x < t + p["dwell"] for x in bounds), (t, p["dwell"])
            t += p["dwell"]
        assert pulls[-1]["phase"] == sum(1 for x in bounds if x <= t - pulls[-1]["dwell"])
        # a pull holds one source for its whole dwell
        t = 0
        for p in pulls:
            assert set(order[t:t + p["dwell"]]) == {p["source"]}
            t += p["dwell"]


def test_phase_boundary_halves_the_counts(base_cfg, big_shards):
    c = copy.deepcopy(base_cfg)
    c["bandit"].update(phases=[5], phase_unit=2)
    cur, _, _ = simulate(c, big_shards, 10)
    before = dict(cur.policy.n)
    total = sum(before.values())
    simulate(c, big_shards, 1, cur=cur)  # the 11th batch opens phase 1
    assert cur.policy.phase_idx == 1
    assert sum(cur.policy.n.values()) == pytest.approx(total / 2, abs=1.0)


def test_every_pull_is_logged_json_safe(base_cfg, big_shards):
    cur, order, pulls = simulate(base_cfg, big_shards, 200)
    open_pull = cur.policy.pull
    in_open = 0 if open_pull is None else open_pull["dwell"] - open_pull["left"]
    assert sum(p["dwell"] for p in pulls) + in_open == len(order)
    for p in pulls:
        json.dumps(p, allow_nan=False)
        assert {"step", "source", "reward", "scores", "why", "dwell"} <= set(p)
        assert set(p["scores"]) == set(big_shards)
    assert pulls[0]["why"] == "explore" and pulls[0]["scores"][pulls[0]["source"]] is None  # unpulled = +inf


def test_simulated_run_is_reproducible_and_resumable(base_cfg, big_shards):
    _, o1, p1 = simulate(base_cfg, big_shards, 300, seed=4)
    _, o2, p2 = simulate(base_cfg, big_shards, 300, seed=4)
    _, o3, _ = simulate(base_cfg, big_shards, 300, seed=5)
    assert o1 == o2 and p1 == p2 and o1 != o3
    # stop at 137 (inside a pull), resume from JSON state: same pulls after
    cur, oa, pa = simulate(base_cfg, big_shards, 137, seed=4)
    state = json.loads(json.dumps(cur.state_dict()))
    cur2 = curriculum_of(base_cfg, big_shards, "main", 4)
    cur2.load_state_dict(state)
    k = {s: oa.count(s) for s in big_shards}
    rng = np.random.default_rng(4 + 1000)
    rng.standard_normal(137)
    ob = []
    pb = []
    for step in range(137, 300):
        src, _, _ = cur2.next_batch(2, 8)
        k[src] += 1
        rec = cur2.observe(step, src, CURVES[src](k[src]) + 0.02 * rng.standard_normal())
        ob.append(src)
        if rec:
            pb.append(rec)
    assert oa + ob == o1 and pa + pb == p1


def test_apply_factor_moves_scores_the_right_way():
    assert apply_factor(2.0, 0.5) == 1.0 and apply_factor(-2.0, 0.5) == -4.0
    assert apply_factor(2.0, 1.3) == pytest.approx(2.6) and apply_factor(-2.6, 1.3) == pytest.approx(-2.0)
    assert apply_factor(math.inf, 0.5) == math.inf


def test_a_first_batch_without_progress_does_not_count_as_a_pull(base_cfg, big_shards):
    # dwell 1: each source's first pull is its first loss, which only starts its EMA. Such a
    # pull earns nothing, so the source stays untried (+inf) and is explored once more.
    c = copy.deepcopy(base_cfg)
    c["bandit"].update(dice_main=1, floor=0.0)
    cur, order, pulls = simulate(c, big_shards, 2 * len(big_shards))
    assert [p["why"] for p in pulls] == ["explore"] * (2 * len(big_shards))
    assert [p["reward"] for p in pulls[:3]] == [None] * 3 and all(p["reward"] is not None for p in pulls[3:])
    assert sorted(order[:3]) == sorted(order[3:]) == sorted(big_shards)
    assert all(v == 1.0 for v in cur.policy.n.values())


def test_reward_scaled_confidence_prevents_lock_in(base_cfg, tmp_path):
    # Four identical sources whose progress rewards are large and noisy (early training).
    # Plain UCB1 (radius in units of 1) is then greedy on a few noisy first rewards and
    # starves some sources; with the radius in units of the pooled reward spread the
    # pulls stay even, as they should between identical sources.
    shards = {s: write_shard(tmp_path / f"{s}.bin", 400, 50, seed=i) for i, s in enumerate("abcd")}
    curves = {s: (lambda k: 2.0 + 5.0 * math.exp(-k / 100.0)) for s in shards}
    mins = {}
    for scale in ("one", "std"):
        c = copy.deepcopy(base_cfg)
        c["bandit"].update(ucb_scale=scale, floor=0.0)
        mins[scale] = [min(order.count(s) for s in shards) / len(order)
                       for order in (simulate(c, shards, 400, seed=seed, curves=curves, noise=0.3)[1]
                                     for seed in range(3))]
    assert min(mins["std"]) > 0.15, mins
    assert min(mins["one"]) < 0.05, mins


def test_progress_per_step_divides_a_drop_by_the_gap():
    from andrea.curriculum.policy import _EmaRewards

    tiny = Settings.from_dict(load_config("params.yaml", "tiny")).bandit
    b = replace(tiny, ema=0.5, reward="progress", reward_scale=1000.0, progress_per_step=True)
    r = _EmaRewards(["s"], b)
    assert r.update("s", 4.0, t=1) is None                  # first loss: EMA starts, no reward
    assert r.update("s", 3.0, t=2) == pytest.approx(500.0)  # drop 0.5 over one batch
    assert r.update("s", 2.5, t=12) == pytest.approx(50.0)  # drop 0.5 over ten batches
    r2 = _EmaRewards(["s"], replace(b, progress_per_step=False))
    for t, loss in ((1, 4.0), (2, 3.0)):
        r2.update("s", loss, t)
    assert r2.update("s", 2.5, t=12) == pytest.approx(500.0)
    assert _EmaRewards(["s"], replace(b, reward="loss")).update("s", 4.0, t=1) == 4.0


def test_relative_reward_is_the_drop_as_a_share_of_the_loss_level():
    from andrea.curriculum.policy import _EmaRewards

    tiny = Settings.from_dict(load_config("params.yaml", "tiny")).bandit
    b = replace(tiny, ema=0.5, reward="relative", reward_scale=1000.0, progress_per_step=True)
    hi, lo = _EmaRewards(["s"], b), _EmaRewards(["s"], b)
    hi.update("s", 4.0, t=1)
    lo.update("s", 1.0, t=1)
    # the same absolute EMA drop (0.5) is 12.5% of a 4-nat level and 50% of a 1-nat one
    assert hi.update("s", 3.0, t=2) == pytest.approx(125.0)
    assert lo.update("s", 0.0, t=2) == pytest.approx(500.0)


def test_default_bandit_holds_no_source_past_one_batch(base_cfg, big_shards):
    # The 12M sweep (docs/FIREHOSE-BANDIT.md, "Measured") found the 1d3/1d4 dwell cost ~4% of
    # held-out bits/byte against the same policy with one batch a pull: the recipe is 1d1 now.
    assert (base_cfg["bandit"]["dice_warmup"], base_cfg["bandit"]["dice_main"]) == (1, 1)
    _, order, pulls = simulate(base_cfg, big_shards, 300)
    assert {p["dwell"] for p in pulls} == {1} and len(pulls) == 300


def _small_vs_big(tmp_path):
    """A 220-token source "a" and a 20,000-token source "b" with the same learning curve."""
    curves = {"a": CURVES["learning"], "b": CURVES["learning"]}
    return curves, {"a": write_shard(tmp_path / "a.bin", 20, 10, seed=3),
                    "b": write_shard(tmp_path / "b.bin", 400, 50, seed=2)}


@pytest.mark.parametrize("unit", ["excess", "none"])
def test_small_source_keeps_its_share_unless_the_bandit_adds_repetition(base_cfg, tmp_path, unit):
    # Two sources that learn alike; "a" is 90x smaller, so under the uniform mix it already
    # repeats every ~14 batches. The `tokens` unit counts those passes and starves it (the
    # 12M table: pull shares ordered by source size); `excess` counts only the passes drawn
    # beyond the uniform mix's, and `none` nothing, so "a" keeps about half.
    curves, shards = _small_vs_big(tmp_path)
    shares = {}
    for u in ("tokens", unit):
        c = copy.deepcopy(base_cfg)
        c["bandit"].update(floor=0.0, epoch_penalty=u)
        shares[u] = np.mean([simulate(c, shards, 600, seed=s, curves=curves)[1].count("a") / 600 for s in range(3)])
    assert shares["tokens"] < 0.3, shares
    assert 0.38 < shares[unit] < 0.62, shares


def test_excess_epochs_count_only_passes_beyond_the_uniform_mix(base_cfg, tmp_path):
    _, shards = _small_vs_big(tmp_path)
    c = copy.deepcopy(base_cfg)
    c["bandit"]["epoch_penalty"] = "excess"
    cur = curriculum_of(c, shards, "main", 0)
    a, b = cur.streams["a"], cur.streams["b"]
    a.tokens_drawn, b.tokens_drawn = 2200, 2200     # an even split: "a" 10 passes, none of them extra
    assert cur.policy.epochs("a", cur.streams) == 0.0
    a.tokens_drawn = 3300                           # 1100 over the even share of 2750 -> 550 / 220 = 2.5
    assert cur.policy.epochs("a", cur.streams) == pytest.approx(2.5)
    assert cur.policy.epochs("b", cur.streams) == 0.0
    c["bandit"]["epoch_penalty"] = "tokens"
    assert curriculum_of(c, shards, "main", 0).policy.epochs("a", cur.streams) == 15.0


@pytest.mark.parametrize("unit,scale,die", [("tokens", "std", 1), ("excess", "std", 3), ("none", "one", 2)])
def test_replay_recomputes_every_logged_score(base_cfg, tmp_path, unit, scale, die):
    # The worked examples of docs/FIREHOSE-BANDIT.md come from andrea.curriculum.replay: rebuilt
    # from the pull records alone (halvings, pooled spread, epochs, freshness), every finite score
    # must match what the policy logged, over dwells, floors and a small source that repeats.
    from andrea.curriculum.replay import max_gap, replay
    curves, shards = _small_vs_big(tmp_path)
    c = copy.deepcopy(base_cfg)
    c["bandit"].update(epoch_penalty=unit, ucb_scale=scale, dice_main=die, floor=0.1)
    cur, _, pulls = simulate(c, shards, 400, seed=1, curves=curves)
    n_tokens = {s: st.n_tokens for s, st in cur.streams.items()}
    bandit = Settings.from_dict(c).bandit
    assert sum(r["why"] == "floor" for r in pulls) > 0 and any(r["phase"] > 3 for r in pulls)
    assert max_gap(pulls, n_tokens, bandit, 2, 8) < 1e-5
    finite = sum(v is not None for r in pulls for v in r["scores"].values())
    checked = sum(len([s for s in t if s != "_"]) for _, t in replay(pulls, n_tokens, bandit, 2, 8))
    assert checked == finite > 0.9 * 2 * len(pulls)     # every logged score was recomputed
    # a replay that forgets the phase halvings is caught
    flat = [dict(r, phase=0) for r in pulls]
    assert max_gap(flat, n_tokens, bandit, 2, 8) > 1e-3


def test_replay_names_a_missing_shard(tmp_path):
    from andrea.curriculum import replay
    loss = tmp_path / "model.loss.json"
    loss.write_text(json.dumps({"pulls": [{"step": 0, "source": "a", "reward": None, "why": "explore", "dwell": 1,
                                           "phase": 0, "scores": {"a": None}, "coverage": 0.5}]}), encoding="utf-8")
    (tmp_path / "train").mkdir()
    with pytest.raises(AndreaError, match=r"train/a\.bin: missing; --tokens must be the folder the run trained on"):
        replay.main(["--loss", str(loss), "--tokens", str(tmp_path), "--profile", "tiny"])
    with pytest.raises(AndreaError, match="no pull records"):
        replay.main(["--loss", str(tmp_path / "none.json"), "--tokens", str(tmp_path), "--profile", "tiny"])
