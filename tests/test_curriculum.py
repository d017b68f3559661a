"""The curriculum API: batch shapes and contents, warmup sources, state round-trips, errors.

    pytest tests/test_curriculum.py

Shards are small synthetic ones written with ShardWriter in a temp folder; the token ids
encode (document, position) so a test can check where a window came from.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from andrea.config import load_config
from andrea.curriculum import make_curriculum, sequential_windows
from andrea.curriculum.sampler import SourceStream
from andrea.errors import AndreaError
from andrea.settings import Settings
from andrea.shards import Shard, ShardWriter

VOCAB = 4000
EOT = VOCAB - 1


def curriculum_of(cfg: dict, shards, phase, seed):
    """The curriculum of a test config dict: its typed sections, as the train stage hands them down."""
    s = Settings.from_dict(cfg)
    return make_curriculum(s.curriculum, s.bandit, shards, phase, seed)


def write_shard(path, doc_lens, base=0):
    """A shard whose document d holds ids base + d*10 + (0, 1, 2, ...) % 10 (then EOT)."""
    with ShardWriter(path, vocab_size=VOCAB, eot_id=EOT) as w:
        for d, n in enumerate(doc_lens):
            w.add((base + d * 10 + np.arange(n) % 10) % EOT)
    return Shard(path)


@pytest.fixture(scope="module")
def cfg():
    c = load_config("params.yaml", "tiny")
    c["curriculum"]["warmup_sources"] = ["chat", "prose", "absent"]
    return c


@pytest.fixture()
def shards(tmp_path):
    rng = np.random.default_rng(0)
    return {name: write_shard(tmp_path / f"{name}.bin", rng.integers(1, 60, size=n), base=i * 1000)
            for i, (name, n) in enumerate([("chat", 40), ("prose", 25), ("code", 30)])}


def drive(cur, steps, B=4, T=16, loss_of=lambda step, src: 3.0):
    """Run the draw/observe loop; returns the batches and pull records."""
    out, pulls = [], []
    for step in range(steps):
        src, x, y = cur.next_batch(B, T)
        out.append((src, x.copy(), y.copy()))
        rec = cur.observe(step, src, loss_of(step, src))
        if rec is not None:
            pulls.append(rec)
    return out, pulls


@pytest.mark.parametrize("policy", ["uniform", "ucb1"])
def test_batches_are_shifted_windows_of_the_source_shard(cfg, shards, policy):
    c = copy.deepcopy(cfg)
    c["bandit"]["policy"] = policy
    cur = curriculum_of(c, shards, "main", seed=7)
    B, T = 5, 33
    for _ in range(30):
        src, x, y = cur.next_batch(B, T)
        assert x.dtype == np.int32 and y.dtype == np.int32 and x.shape == y.shape == (B, T)
        np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
        toks = np.asarray(shards[src].tokens)
        n = toks.size
        for row_x, row_y in zip(x, y):
            w = np.concatenate([row_x, row_y[-1:]])
            starts = np.flatnonzero(toks == w[0])
            assert any(np.array_equal(toks[(s + np.arange(T + 1)) % n], w) for s in starts), src
        cur.observe(0, src, 2.0)


@pytest.mark.parametrize("policy", ["uniform", "ucb1"])
def test_warmup_draws_only_warmup_sources_present(cfg, shards, policy):
    c = copy.deepcopy(cfg)
    c["bandit"]["policy"] = policy
    cur = curriculum_of(c, shards, "warmup", seed=1)
    seen = {src for src, _, _ in drive(cur, 200)[0]}
    assert seen == {"chat", "prose"}
    main = curriculum_of(c, shards, "main", seed=1)
    assert {src for src, _, _ in drive(main, 200)[0]} == {"chat", "prose", "code"}


def test_warmup_without_any_warmup_shard_is_an_error(cfg, shards):
    c = copy.deepcopy(cfg)
    c["curriculum"]["warmup_sources"] = ["absent"]
    with pytest.raises(AndreaError, match="warmup_sources"):
        curriculum_of(c, shards, "warmup", seed=1)


@pytest.mark.parametrize("policy", ["uniform", "ucb1"])
@pytest.mark.parametrize("cut", [1, 13, 50])
def test_resume_from_json_state_draws_identical_batches(cfg, shards, policy, cut):
    c = copy.deepcopy(cfg)
    c["bandit"]["policy"] = policy
    loss = lambda step, src: 5.0 - 0.01 * step + 0.1 * (src == "code")  # noqa: E731
    straight = curriculum_of(c, shards, "main", seed=3)
    ref_batches, ref_pulls = drive(straight, 80, loss_of=loss)

    first = curriculum_of(c, shards, "main", seed=3)
    a_batches, a_pulls = drive(first, cut, loss_of=loss)
    state = json.loads(json.dumps(first.state_dict()))  # through JSON, as in .state.json
    resumed = curriculum_of(c, shards, "main", seed=3)
    resumed.load_state_dict(state)
    b_batches, b_pulls = drive(resumed, 80 - cut, loss_of=lambda step, src: loss(step + cut, src))
    got = a_batches + b_batches
    assert [s for s, _, _ in got] == [s for s, _, _ in ref_batches]
    for (_, x1, y1), (_, x2, y2) in zip(got, ref_batches):
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)
    strip = lambda ps: [{k: v for k, v in p.items() if k != "step"} for p in ps]  # noqa: E731
    assert strip(a_pulls + b_pulls) == strip(ref_pulls)
    assert resumed.state_dict() == json.loads(json.dumps(straight.state_dict()))


def test_warmup_state_carries_into_main(cfg, shards):
    c = copy.deepcopy(cfg)
    warm = curriculum_of(c, shards, "warmup", seed=5)
    drive(warm, 40, loss_of=lambda s, src: 4.0 - 0.01 * s)
    st = json.loads(json.dumps(warm.state_dict()))
    main = curriculum_of(c, shards, "main", seed=99)
    main.load_state_dict(st)
    assert main.policy.rewards.ema["chat"] == warm.policy.rewards.ema["chat"]
    assert main.streams["prose"].tokens_drawn == warm.streams["prose"].tokens_drawn
    assert main.policy.batches == {"chat": 0, "code": 0, "prose": 0}  # floors count main's own batches
    assert main.policy.die == c["bandit"]["dice_main"]
    assert "code" in {src for src, _, _ in drive(main, 100)[0]}


def test_state_from_other_shards_or_policy_is_refused(cfg, shards, tmp_path):
    cur = curriculum_of(cfg, shards, "main", seed=1)
    drive(cur, 5)
    st = cur.state_dict()
    other = dict(shards)
    other["code"] = write_shard(tmp_path / "code2.bin", [5, 6, 7])
    with pytest.raises(AndreaError, match="code"):
        curriculum_of(cfg, other, "main", seed=1).load_state_dict(st)
    c = copy.deepcopy(cfg)
    c["bandit"]["policy"] = "uniform"
    with pytest.raises(AndreaError, match="bandit.policy"):
        curriculum_of(c, shards, "main", seed=1).load_state_dict(st)
    with pytest.raises(AndreaError, match="no shard"):
        curriculum_of(cfg, {k: v for k, v in shards.items() if k != "code"}, "main", seed=1).load_state_dict(st)


def test_observe_for_the_wrong_source_is_an_error(cfg, shards):
    cur = curriculum_of(cfg, shards, "main", seed=2)
    src, _, _ = cur.next_batch(2, 8)
    wrong = next(s for s in shards if s != src)
    with pytest.raises(AndreaError, match="open pull"):
        cur.observe(0, wrong, 1.0)


def test_nan_loss_is_ignored_for_the_reward(cfg, shards):
    cur = curriculum_of(cfg, shards, "main", seed=2)
    for step in range(30):
        src, _, _ = cur.next_batch(2, 8)
        rec = cur.observe(step, src, float("nan") if step % 3 == 0 else 3.0)
        json.dumps(rec, allow_nan=False)
    assert all(v is None or np.isfinite(v) for v in cur.policy.rewards.ema.values())


def test_window_longer_than_shard_tiles_it_and_covers_everything(tmp_path):
    st = SourceStream("s", write_shard(tmp_path / "s.bin", [3, 2]))  # 7 tokens with EOTs
    w = st.draw(np.random.default_rng(0), B=2, T=20)
    toks = np.asarray(st.tokens)
    assert w.shape == (2, 21)
    assert set(w.ravel()) == set(toks)
    assert st.passes == 2 and st.tokens_drawn == 40 and st.epochs == 5


def test_sequential_windows_score_each_target_once(tmp_path):
    sh = write_shard(tmp_path / "v.bin", [30, 41, 12])  # 86 tokens
    batches = list(sequential_windows(sh, B=2, T=10))
    ys = np.concatenate([y.ravel() for _, y in batches])
    assert sum(x.shape[0] for x, _ in batches) == 8
    np.testing.assert_array_equal(ys, np.asarray(sh.tokens)[1:81])
    assert len(list(sequential_windows(sh, B=2, T=10, max_batches=1))) == 1


@pytest.mark.parametrize("policy", ["uniform", "ucb1"])
def test_summary_counts_batches_epochs_and_coverage(cfg, shards, policy):
    c = copy.deepcopy(cfg)
    c["bandit"]["policy"] = policy
    cur = curriculum_of(c, shards, "main", seed=4)
    batches, _ = drive(cur, 60, B=4, T=16)
    summ = cur.summary()
    assert sum(v["batches"] for v in summ.values()) == 60
    for s, v in summ.items():
        assert v["batches"] == sum(1 for src, _, _ in batches if src == s)
        assert v["epochs"] == v["batches"] * 4 * 16 // shards[s].n_tokens
        assert 0.0 < v["coverage"] <= 1.0 or v["passes"] > 0
    json.dumps(summ, allow_nan=False)
