"""andrea.curriculum.allocate: the source mix of a bandit setting, replayed with drawn rewards.

    pytest tests/test_curriculum_allocate.py
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from andrea.config import load_config
from andrea.curriculum import make_curriculum
from andrea.curriculum.allocate import allocate, main, shares
from andrea.errors import AndreaError
from andrea.settings import Settings
from andrea.shards import Shard, ShardWriter

VOCAB = 500
SIZES = {"big": 200, "mid": 60, "small": 15}   # documents of 40 tokens each


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokens")
    (d / "train").mkdir()
    for i, (name, n_docs) in enumerate(SIZES.items()):
        rng = np.random.default_rng(i)
        with ShardWriter(d / "train" / f"{name}.bin", vocab_size=VOCAB, eot_id=VOCAB - 1) as w:
            for _ in range(n_docs):
                w.add(rng.integers(0, VOCAB - 1, size=40))
    return d


@pytest.fixture(scope="module")
def shards(tokens):
    return {name: Shard(tokens / "train" / f"{name}.bin") for name in SIZES}


def settings(**bandit):
    """tiny's params over the three test sources: one main phase of 300 steps, batches of 2 x 16."""
    c = copy.deepcopy(load_config("params.yaml", "tiny"))
    c["train"].update(max_steps=300, batch_size=2)
    c["model"]["context"] = 16
    c["curriculum"].update(warmup_steps=0, polish_steps=0)
    c["bandit"].update({"policy": "ucb1", **bandit})
    return Settings.from_dict(c)


def test_uniform_draws_what_a_real_run_draws(shards):
    # Uniform ignores rewards, so the replay must make exactly the source sequence of the curriculum
    # driven by real losses: the tool runs the real curriculum and dice, nothing of its own.
    st = settings(policy="uniform")
    got = allocate(st, shards, seed=5)
    cur = make_curriculum(st.curriculum, st.bandit, shards, "main", 5)
    want = {s: 0 for s in shards}
    for step in range(300):
        src, _, _ = cur.next_batch(2, 16)
        want[src] += 1
        cur.observe(step, src, 3.0 + 0.01 * step)
    assert got["all"] == want
    assert sum(got["late"].values()) == 100


def test_floors_hold_and_the_tokens_penalty_orders_by_size(shards):
    f = shares(allocate(settings(floor=0.3), shards, seed=1)["all"])
    assert min(f.values()) >= 0.3 - 1.0 / 300, f
    t = shares(allocate(settings(floor=0.0, epoch_penalty="tokens"), shards, seed=1)["all"])
    assert t["big"] > t["mid"] > t["small"], t
    e = shares(allocate(settings(floor=0.0, epoch_penalty="excess"), shards, seed=1)["all"])
    assert all(abs(v - 1 / 3) < 0.1 for v in e.values()), e    # excess holds the uniform mix's shares
    assert t["small"] < e["small"] - 0.1, (t, e)


def test_seeded_and_the_rewards_are_drawn(shards):
    st = settings(floor=0.0)
    a, b = allocate(st, shards, seed=3), allocate(st, shards, seed=3)
    assert a == b
    assert allocate(st, shards, seed=3, mean=3.0, spread=0.0) != a     # the reward draws reach the policy


def test_polish_rows_draw_only_their_sources(shards):
    c = copy.deepcopy(load_config("params.yaml", "tiny"))
    c["train"].update(max_steps=300, batch_size=2)
    c["model"]["context"] = 16
    c["curriculum"].update(warmup_steps=60, warmup_sources=["mid", "small"], polish_steps=100, polish_sources=["big"])
    c["bandit"]["policy"] = "ucb1"
    got = allocate(Settings.from_dict(c), shards, seed=2)
    assert got["late"]["big"] == 100 and got["late"]["mid"] == got["late"]["small"] == 0   # steps 200-299: polish
    assert got["all"]["big"] >= 100 and got["all"]["mid"] >= 1 and got["all"]["small"] >= 1


def test_cli_prints_every_source_and_refuses_an_empty_folder(tokens, tmp_path, capsys):
    main(["--tokens", str(tokens), "--profile", "tiny", "-S", "train.max_steps=120", "-S", "curriculum.warmup_steps=0",
          "-S", "curriculum.polish_steps=0", "--seeds", "1,2"])
    out = capsys.readouterr().out
    assert all(s in out for s in SIZES) and "seeds [1, 2]" in out
    with pytest.raises(AndreaError, match="no <source>.bin shards"):
        main(["--tokens", str(tmp_path), "--profile", "tiny"])
