"""The train stage in process: warmup -> main on synthetic shards, run files, refusals,
NaN/inf handling, halting hooks, the checkpoint's exact byte layout.

    pytest tests/test_train.py
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from rich.console import Console

from andrea import runs
from andrea.engine import checkpoint as ck
from andrea.errors import AndreaError
from andrea.train import Hook, Trainer
from train_helpers import make_data, micro_cfg


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("data"))


def _trainer(cfg, phase, data, out, init=None):
    tok, tokens = data
    return Trainer(cfg, phase, tok, tokens, out, init, console=Console(stderr=True, force_terminal=False))


def test_warmup_then_main_writes_run_files_and_learns(data, tmp_path):
    cfg = micro_cfg(20, 80)
    assert _trainer(cfg, "warmup", data, tmp_path / "w").run() == 0
    st = json.loads((tmp_path / "w" / "model.state.json").read_text())
    assert st["step"] == 20 and st["phase"] == "warmup" and st["halt"] is None
    wl = json.loads((tmp_path / "w" / "model.loss.json").read_text())
    assert {r["source"] for r in wl["train"]} == {"chat-system", "py-topics"}   # warmup sources only

    assert _trainer(cfg, "main", data, tmp_path / "m", init=tmp_path / "w").run() == 0
    loss = json.loads((tmp_path / "m" / "model.loss.json").read_text())
    assert loss["format"] == "andrea.loss/1"
    assert [r["step"] for r in loss["train"]] == list(range(80))              # warmup history carried over
    assert [r["phase"] for r in loss["train"]] == ["warmup"] * 20 + ["main"] * 60
    assert "py-code" in {r["source"] for r in loss["train"][20:]}
    for r in loss["train"]:                          # only what the params determine: no wall clock
        assert set(r) == {"step", "phase", "loss", "lr", "grad_norm", "source", "smma"}
    assert "time" not in json.loads((tmp_path / "m" / "model.state.json").read_text())
    perf = runs.read_perf(tmp_path / "m" / runs.PERF)     # the sidecar has them, warmup's carried over
    assert sorted(perf) == list(range(80)) and all(perf[s]["tokens_per_s"] > 0 and perf[s]["time"] > 0 for s in perf)
    val = loss["val"][-1]
    assert val["step"] == 80 and set(val["per_source"]) == {"chat-system", "py-code", "py-topics"}
    assert val["loss"] < val["unigram"] - 0.3, "held-out loss should beat the unigram baseline"
    assert val["loss"] < loss["val"][0]["loss"]
    step, w, m, v = ck.read_checkpoint(tmp_path / "m" / "model.bin", None)
    assert step == 80 and np.abs(m).max() > 0 and v.min() >= 0
    # a finished run is left alone
    before = (tmp_path / "m" / "model.bin").read_bytes()
    assert _trainer(cfg, "main", data, tmp_path / "m", init=tmp_path / "w").run() == 0
    assert (tmp_path / "m" / "model.bin").read_bytes() == before


def test_checkpoint_layout_is_exact(tmp_path):
    rng = np.random.default_rng(0)
    w, m, v = (rng.normal(size=5).astype(np.float32) for _ in range(3))
    p = tmp_path / "model.bin"
    ck.write_checkpoint(p, 7, w, m, v)
    raw = p.read_bytes()
    assert len(raw) == 8 + 12 * 5
    assert struct.unpack("<ii", raw[:8]) == (7, 5)
    assert raw[8:] == w.astype("<f4").tobytes() + m.astype("<f4").tobytes() + v.astype("<f4").tobytes()
    step, w2, m2, v2 = ck.read_checkpoint(p, 5)
    assert step == 7 and (w2 == w).all() and (m2 == m).all() and (v2 == v).all()
    with pytest.raises(AndreaError, match="n_params 5 in the file, but the model has 6"):
        ck.read_checkpoint(p, 6)
    p.write_bytes(raw[:-4])
    with pytest.raises(AndreaError, match="truncated"):
        ck.read_checkpoint(p, 5)
    p.write_bytes(raw[:6])
    with pytest.raises(AndreaError, match="too short"):
        ck.read_checkpoint(p, 5)


def test_resume_refuses_mismatches(data, tmp_path):
    cfg = micro_cfg(6, 12)
    out = tmp_path / "w"
    assert _trainer(cfg, "warmup", data, out).run() == 0
    # another trajectory-relevant config
    with pytest.raises(AndreaError, match="another config"):
        _trainer(micro_cfg(6, 12, **{"train.lr": 2e-2}), "warmup", data, out).run()
    # logging-only keys and sections that act only through the data may change
    assert _trainer(micro_cfg(6, 12, **{"train.log_every": 3, "diet.sweep": "[64, 128]"}), "warmup", data, out).run() == 0
    # other train shards
    import shutil
    tok, tokens = data
    other = tmp_path / "tokens"
    shutil.copytree(tokens, other)
    (other / "train" / "py-code.bin").unlink()
    with pytest.raises(AndreaError, match="train token shards changed"):
        Trainer(cfg, "warmup", tok, other, out, console=Console(stderr=True)).run()
    # another model shape: n_params differs from the file
    with pytest.raises(AndreaError):
        _trainer(micro_cfg(6, 12, **{"model.d_model": 16}), "warmup", data, out).run()
    # another tokenizer
    st = json.loads((out / "model.state.json").read_text())
    st["tokenizer_sha256"] = "0" * 64
    (out / "model.state.json").write_text(json.dumps(st))
    with pytest.raises(AndreaError, match="tokenizer"):
        _trainer(cfg, "warmup", data, out).run()
    # truncated checkpoint
    st["tokenizer_sha256"] = _trainer(cfg, "warmup", data, tmp_path / "x").tok.sha256
    (out / "model.state.json").write_text(json.dumps(st))
    raw = (out / "model.bin").read_bytes()
    (out / "model.bin").write_bytes(raw[:-100])
    with pytest.raises(AndreaError, match="truncated"):
        _trainer(cfg, "warmup", data, out).run()
    # main without a finished warmup
    with pytest.raises(AndreaError, match="--init"):
        _trainer(cfg, "main", data, tmp_path / "m").run()


def test_bad_steps_never_touch_weights_and_halt_after_max(data, tmp_path):
    cfg = micro_cfg(30, 40, **{"train.max_bad_steps": 3})
    tr = _trainer(cfg, "warmup", data, tmp_path / "w")
    eng = tr.engine
    orig = eng.micro_step
    snaps = {}

    def micro_step(x, y):
        s = tr.step
        snaps[s] = (eng.w.copy(), eng.m.copy(), eng.v.copy())
        loss = orig(x, y)
        if s == 4:
            return float("nan")              # NaN loss
        if s == 6:
            eng.g[3] = np.inf                # inf gradient, finite loss
        if s >= 10:
            eng.g[-1] = np.nan               # from step 10 on every step is bad
        return loss

    eng.micro_step = micro_step
    with pytest.raises(AndreaError, match="3 consecutive steps"):
        tr.run()
    st = json.loads((tmp_path / "w" / "model.state.json").read_text())
    assert st["halt"]["kind"] == "bad_steps" and st["bad_steps"] == {"consecutive": 3, "total": 5}
    assert st["step"] == 13
    step, w, m, v = ck.read_checkpoint(tmp_path / "w" / "model.bin", eng.n_params)
    # the checkpoint holds the weights after the last good step (9), untouched by steps 10-12
    assert (w == snaps[10][0]).all() and (m == snaps[10][1]).all() and (v == snaps[10][2]).all()
    assert np.isfinite(w).all()
    # the skipped steps 4 and 6 left w, m, v exactly as they were
    for s in (4, 6):
        assert all((a == b).all() for a, b in zip(snaps[s], snaps[s + 1]))
    assert not (snaps[5][0] == snaps[6][0]).all()   # a good step does move the weights
    events = json.loads((tmp_path / "w" / "model.loss.json").read_text())["events"]
    assert [e["step"] for e in events if e["kind"] == "bad_step"] == [4, 6, 10, 11, 12]
    with pytest.raises(AndreaError, match="halted"):
        _trainer(cfg, "warmup", data, tmp_path / "w").run()


def test_a_hook_can_halt_the_run_with_a_reason(data, tmp_path):
    cfg = micro_cfg(30, 40)
    tr = _trainer(cfg, "warmup", data, tmp_path / "w")
    seen = []

    def fn(trainer, step):
        seen.append(step)
        return {"reason": "test says stop", "step": step} if step == 15 else None

    tr.hooks.append(Hook("probe", 5, fn, lambda: {"seen": list(seen)}))
    assert tr.run() == 0
    assert seen == [5, 10, 15]
    st = json.loads((tmp_path / "w" / "model.state.json").read_text())
    assert st["step"] == 15 and st["halt"] == {"kind": "probe", "reason": "test says stop", "step": 15}
    assert st["hooks"]["probe"] == {"seen": [5, 10, 15]}
    assert _trainer(cfg, "warmup", data, tmp_path / "w").run() == 0   # halted: nothing more to do
    assert json.loads((tmp_path / "w" / "model.state.json").read_text())["step"] == 15


def test_numpy_backend_refuses_mixed_precision(data, tmp_path):
    with pytest.raises(AndreaError, match="train.precision=bf16: the numpy backend supports fp32"):
        _trainer(micro_cfg(2, 4, **{"train.precision": "bf16"}), "warmup", data, tmp_path / "w")


def test_cli_run_wires_the_coherence_check(data, tmp_path):
    """`andrea train` samples the fixed prompts every coherence.every steps into .samples.json."""
    import argparse

    from andrea.train import run

    tok, tokens = data
    cfg = micro_cfg(10, 20, **{"coherence.every": 5, "coherence.max_new_tokens": 8})
    args = argparse.Namespace(phase="warmup", tokenizer=str(tok), tokens=str(tokens), out=str(tmp_path / "w"), init=None)
    assert run(args, cfg) == 0
    samples = json.loads((tmp_path / "w" / "model.samples.json").read_text())
    assert samples["format"] == "andrea.samples/1"
    assert sorted({s["step"] for s in samples["samples"]}) == [5, 10]
    assert all({"step", "prompt", "text", "scores"} <= set(s) for s in samples["samples"])
    st = json.loads((tmp_path / "w" / "model.state.json").read_text())
    assert set(st["hooks"]["coherence"]) >= {"streak", "n_loss"} and st["hooks"]["coherence"]["n_loss"] == 10


def test_on_mismatch_restart_moves_the_old_run_aside(data, tmp_path):
    out = tmp_path / "w"
    assert _trainer(micro_cfg(4, 8), "warmup", data, out).run() == 0
    old = (out / "model.bin").read_bytes()
    cfg2 = micro_cfg(4, 8, **{"bandit.coverage_bonus": 1.5})
    with pytest.raises(AndreaError, match="another config"):
        _trainer(cfg2, "warmup", data, out).run()
    tok, tokens = data
    tr = Trainer(cfg2, "warmup", tok, tokens, out, console=Console(stderr=True), on_mismatch="restart")
    assert tr.run() == 0
    stale = [p for p in tmp_path.iterdir() if p.name.startswith("w.stale-")]
    assert len(stale) == 1 and (stale[0] / "model.bin").read_bytes() == old
    assert {p.name for p in stale[0].iterdir()} == {"model.bin", "model.state.json", "model.loss.json",
                                                     "model.samples.json", "model.perf.jsonl"}  # its timings too
    st = json.loads((out / "model.state.json").read_text())
    assert st["step"] == 4 and st["config"]["bandit"]["coverage_bonus"] == 1.5
    # a run of the same config is resumed (here: already complete), never moved
    assert Trainer(cfg2, "warmup", tok, tokens, out, console=Console(stderr=True), on_mismatch="restart").run() == 0
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("w.stale-")]) == 1


def test_grad_accumulation_in_the_loop(data, tmp_path):
    """train.grad_accum microbatches per step: each is observed by the curriculum, one update per step."""
    cfg = micro_cfg(6, 12, **{"train.grad_accum": 3})
    tr = _trainer(cfg, "warmup", data, tmp_path / "w")
    drawn = []
    orig = tr.engine.micro_step

    def micro_step(x, y):
        drawn.append(tr.step)
        return orig(x, y)

    tr.engine.micro_step = micro_step
    assert tr.run() == 0
    assert drawn == [s for s in range(6) for _ in range(3)]
    loss = json.loads((tmp_path / "w" / "model.loss.json").read_text())
    assert [r["step"] for r in loss["train"]] == list(range(6))


def test_resume_with_another_thread_count_says_the_bits_will_differ(data, tmp_path, monkeypatch):
    """The state records how many batch slices (CPU threads) the steps used; a resume with
    another count goes on, and says it is no longer bit-identical to a straight run."""
    import io

    from andrea.engine.backend import NumpyBackend

    cfg, out = micro_cfg(4, 8), tmp_path / "w"
    monkeypatch.setattr(NumpyBackend, "row_slots", staticmethod(lambda B: [(0, B)]))
    assert _trainer(cfg, "warmup", data, out).run() == 0
    assert json.loads((out / "model.state.json").read_text())["batch_slices"] == 1
    tok, tokens = data
    for slots, noted in (([(0, 4)], False), ([(0, 2), (2, 4)], True)):
        monkeypatch.setattr(NumpyBackend, "row_slots", staticmethod(lambda B, s=slots: list(s)))
        text = io.StringIO()
        tr = Trainer(cfg, "warmup", tok, tokens, out, console=Console(file=text, width=400))
        tr.run()
        assert ("not bit-identical" in text.getvalue()) == noted, text.getvalue()
        assert any(e["kind"] == "threads" for e in tr.hist.events) == noted


def test_the_coherence_check_waits_for_the_engines_queued_update_before_it_samples(monkeypatch):
    """The check samples from the training weights themselves (engine.w); GpuEngine's update may still run
    beside the next step (OVERLAP_UPDATE), so the hook settles the engine first."""
    from types import SimpleNamespace

    import andrea.coherence as co
    import andrea.generate as gen
    from andrea.train import coherence_hook

    order = []

    class Monitor:
        every = 5

        def __init__(self, settings):
            pass

        def sample_check(self, step, model, tok, seed):
            order.append(("sample", step, model))
            return {"samples": [], "degenerate": False, "streak": 0, "halt": None}

        state_dict = load_state_dict = observe_loss = None

    monkeypatch.setattr(co, "CoherenceMonitor", Monitor)
    monkeypatch.setattr(gen, "InferenceModel", lambda mc, w, be, slots: "model over engine.w")
    engine = SimpleNamespace(w="w", be="be", settle=lambda: order.append("settle"))
    trainer = SimpleNamespace(settings=SimpleNamespace(coherence=None), mc=None, engine=engine, tok=None, seed=0,
                              hist=SimpleNamespace(samples=[], events=[]))
    hook = coherence_hook(trainer)
    assert hook.fn(trainer, 5) is None
    assert order == ["settle", ("sample", 5, "model over engine.w")]
