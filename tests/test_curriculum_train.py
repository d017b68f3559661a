"""The curriculum and the coherence stop inside real `andrea train` runs (micro model).

    pytest tests/test_curriculum_train.py

* ucb1 (the recipe's policy) through warmup and main, with a SIGTERM + resume in the
  middle of main: byte-identical checkpoint and identical pull log to the straight run.
* the coherence early stop: with every repetition limit at 0 and greedy sampling, the
  run halts after `coherence.patience` checks: exit 0, a clear message, the reason in
  .state.json, the samples in .samples.json; a rerun does nothing.
"""

from __future__ import annotations

import json
import signal

import pytest

from andrea.engine import checkpoint as ck
from test_train_resume import _run_with_signal
from train_helpers import andrea_cmd, make_data, micro_overrides, run_cli

WARMUP, TOTAL, K = 12, 90, 40


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("data"))


@pytest.mark.slow
def test_ucb1_run_resumes_bit_exactly_with_the_same_pulls(data, tmp_path):
    tok, tokens = data
    ov = micro_overrides(WARMUP, TOTAL, **{"bandit.policy": "ucb1", "bandit.phase_unit": 1,
                                           "bandit.floor": 0.1})
    warm = tmp_path / "warmup"
    r = run_cli("warmup", tok, tokens, warm, ov)
    assert r.returncode == 0, r.stderr
    wl = json.loads((warm / "model.loss.json").read_text())
    assert {p["source"] for p in wl["pulls"]} <= {"chat-system", "py-topics"}  # warmup sources only

    a = tmp_path / "a"
    r = run_cli("main", tok, tokens, a, ov, init=warm)
    assert r.returncode == 0, r.stderr
    c = tmp_path / "c"
    rc, err = _run_with_signal(andrea_cmd("main", tok, tokens, c, ov, init=warm), signal.SIGTERM, K)
    assert rc == 143, err  # stopped, not finished: no front end may mark it done
    stopped = ck.read_checkpoint(c / "model.bin", None)[0]
    assert K <= stopped < TOTAL
    r = run_cli("main", tok, tokens, c, ov, init=warm)
    assert r.returncode == 0, r.stderr
    assert (c / "model.bin").read_bytes() == (a / "model.bin").read_bytes()

    pa = json.loads((a / "model.loss.json").read_text())["pulls"]
    pc = json.loads((c / "model.loss.json").read_text())["pulls"]
    assert pa == pc
    main_pulls = [p for p in pa if p["step"] >= WARMUP]
    assert {p["source"] for p in main_pulls} == {"chat-system", "py-topics", "py-code"}
    assert {p["why"] for p in main_pulls} <= {"explore", "ucb", "floor"}
    assert all(1 <= p["dwell"] <= 4 for p in main_pulls) and all(1 <= p["dwell"] <= 3 for p in wl["pulls"])
    st = json.loads((a / "model.state.json").read_text())
    assert st["curriculum"]["policy"] == "ucb1" and st["curriculum"]["phase"] == "main"
    assert set(st["curriculum"]["sources"]) == {"chat-system", "py-topics", "py-code"}


def test_degenerate_samples_halt_the_run_cleanly(data, tmp_path):
    tok, tokens = data
    ov = micro_overrides(40, 60, **{"coherence.every": 5, "coherence.patience": 2,
                                    "coherence.max_new_tokens": 24, "coherence.temperature": "0.000001",
                                    "coherence.max_repeat": "{bigram: 0, trigram: 0, word: 0, char: 0}"})
    out = tmp_path / "warmup"
    r = run_cli("warmup", tok, tokens, out, ov)
    assert r.returncode == 0, r.stderr
    assert "halted at step 10" in r.stderr and "coherence" in r.stderr
    st = json.loads((out / "model.state.json").read_text())
    assert st["halt"]["kind"] == "coherence" and st["halt"]["step"] == 10 and st["step"] == 10
    assert "coherence.max_repeat" in st["halt"]["reason"]
    assert st["hooks"]["coherence"]["streak"] == 2
    samples = json.loads((out / "model.samples.json").read_text())["samples"]
    assert [s["step"] for s in samples].count(10) == [s["step"] for s in samples].count(5) > 0
    assert all(s["degenerate"] for s in samples if s["step"] == 10)
    r = run_cli("warmup", tok, tokens, out, ov)
    assert r.returncode == 0 and "nothing to do" in r.stderr


def test_coherent_enough_samples_do_not_halt(data, tmp_path):
    tok, tokens = data
    ov = micro_overrides(12, 24, **{"coherence.every": 5, "coherence.patience": 1,
                                    "coherence.max_new_tokens": 8,
                                    "coherence.max_repeat": "{bigram: 1, trigram: 1, word: 1, char: 1}"})
    out = tmp_path / "warmup"
    r = run_cli("warmup", tok, tokens, out, ov)
    assert r.returncode == 0, r.stderr
    st = json.loads((out / "model.state.json").read_text())
    assert st["halt"] is None and st["step"] == 12
    ev = json.loads((out / "model.loss.json").read_text())["events"]
    assert [e["step"] for e in ev if e["kind"] == "coherence"] == [5, 10]
