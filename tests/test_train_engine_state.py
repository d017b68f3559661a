"""An engine's own extra state (the CUDA engine's fp16 dynamic loss scale and its counters)
rides in the run state: saved from ``engine.extra_state()`` into ``.state.json`` "engine",
restored with ``engine.load_extra_state(d)`` on resume and when main starts from warmup.
Driven here with the NumPy engine and a fake extra state on the instance.

    pytest tests/test_train_engine_state.py
"""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from andrea.errors import AndreaError
from andrea.train import Trainer
from train_helpers import make_data, micro_cfg


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("data"))


def _trainer(cfg, phase, data, out, init=None, loaded=None):
    tok, tokens = data
    tr = Trainer(cfg, phase, tok, tokens, out, init, console=Console(stderr=True, force_terminal=False))
    tr.engine.extra_state = lambda: {"loss_scale": 2.0 ** (10 + tr.step), "good_steps": tr.step}
    if loaded is not None:
        tr.engine.load_extra_state = lambda d: loaded.append((tr.step, dict(d)))
    return tr


def test_engine_extra_state_is_saved_and_restored(data, tmp_path):
    cfg = micro_cfg(4, 8)
    w = tmp_path / "w"
    tr = _trainer(cfg, "warmup", data, w, loaded=[])
    tr.end = 2                                          # stop at step 2
    assert tr.run() == 0
    st = json.loads((w / "model.state.json").read_text())
    assert st["engine"] == {"loss_scale": 2.0 ** 12, "good_steps": 2}

    loaded: list = []
    assert _trainer(cfg, "warmup", data, w, loaded=loaded).run() == 0     # resume 2 -> 4
    assert loaded == [(0, {"loss_scale": 2.0 ** 12, "good_steps": 2})]   # restored before the first step
    assert json.loads((w / "model.state.json").read_text())["engine"]["good_steps"] == 4

    loaded = []
    assert _trainer(cfg, "main", data, tmp_path / "m", init=w, loaded=loaded).run() == 0
    assert loaded == [(0, {"loss_scale": 2.0 ** 14, "good_steps": 4})]   # carried from warmup into main
    assert json.loads((tmp_path / "m" / "model.state.json").read_text())["engine"]["good_steps"] == 8


def _resumer(data, tmp_path):
    """A warmup run with engine state stopped at step 2, and a fresh Trainer on its folder (no fake
    extra state) that will resume it."""
    cfg = micro_cfg(4, 4)
    w = tmp_path / "w"
    tr = _trainer(cfg, "warmup", data, w)
    tr.end = 2
    assert tr.run() == 0
    tok, tokens = data
    return Trainer(cfg, "warmup", tok, tokens, w, console=Console(stderr=True))


def test_a_state_with_engine_state_the_engine_cannot_load_is_refused(data, tmp_path):
    plain = _resumer(data, tmp_path)                   # no load_extra_state
    with pytest.raises(AndreaError, match="engine state .*good_steps, loss_scale.* cannot restore"):
        plain.run()


def test_the_refusal_says_why_the_engine_could_not_restore_its_state(data, tmp_path):
    """The engine's own reason (here an fp8 amax history of another site count, as a delayed-scaling run
    saved before the E4M3 head has) reaches the one-line refusal, which names the state file."""
    again = _resumer(data, tmp_path)

    def load(d):
        raise ValueError("fp8 amax history of shape (16, 26), this engine's is (16, 28)")

    again.engine.load_extra_state = load
    with pytest.raises(AndreaError, match=r"model\.state\.json: holds engine state .* cannot restore: fp8 amax "
                                          r"history of shape \(16, 26\), this engine's is \(16, 28\)"):
        again.run()
