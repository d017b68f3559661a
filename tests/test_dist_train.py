"""The trainer at world size N on the CPU: N Trainers in one process (a thread each) over the
in-process communicator of tests/test_dist.py and a NumPy stand-in for the ZeRO-1 GPU engine
(the GpuEngine's sharded surface: padded w and g, m and v one shard, ``andrea.dist.zero1_update``
over NumPy twin kernels, losses gathered per microbatch, ``state_host`` gathering m and v).
What it checks is the trainer's side: rank 0 alone writes the folder, the bandit stays one,
a signal to one rank checkpoints the job once, SIGTERM then resume at the same N is bit-exact,
resume at another N works and says it is not bit-exact. Run: pytest tests/test_dist_train.py"""

from __future__ import annotations

import io
import json
import math
import signal
import threading

import numpy as np
import pytest

from andrea import dist
from andrea.engine.backend import NumpyBackend
from andrea.engine.engine import Engine, StepResult
from dist_helpers import FakeGroup, NumpyZero1, on_threads
from train_helpers import make_data, micro_cfg


class ShardedNumpyEngine(Engine):
    """One rank's engine: the NumPy engine's forward/backward, the GpuEngine's ZeRO-1 bookkeeping."""

    def __init__(self, mc, batch_size, backend, comm, recompute="auto"):
        super().__init__(mc, batch_size, backend, recompute=recompute)
        self.comm, n = comm, self.n_params
        self.shard = dist.shard_size(n, comm.size)
        self.wp = np.zeros(comm.size * self.shard, np.float32)
        self.gp = np.zeros(comm.size * self.shard, np.float32)
        self.m, self.v = np.zeros(self.shard, np.float32), np.zeros(self.shard, np.float32)

    def _mine(self, full):
        off, length = dist.shard_range(self.n_params, self.comm.size, self.comm.rank)
        out = np.zeros(self.shard, np.float32)
        out[:length] = np.asarray(full, np.float32)[off:off + length]
        return out

    def load_state(self, w, m, v):
        self.w[...] = w
        self.m[...], self.v[...] = self._mine(m), self._mine(v)

    def init_weights(self, seed):
        super().init_weights(seed)
        self.m, self.v = np.zeros(self.shard, np.float32), np.zeros(self.shard, np.float32)

    def micro_step(self, x, y):
        loss = super().micro_step(x, y)
        both = np.zeros(self.comm.size, np.float64)
        self.comm.all_gather(np.array([loss], np.float64), both)
        return dist.global_mean(both)

    def apply_update(self, n_micro, loss, lr, t, hp):
        if not math.isfinite(loss):
            return StepResult(loss, float("nan"), False)
        n = self.n_params
        self.gp[:n], self.wp[:n] = self.g, self.w
        k = NumpyZero1(self.wp, self.gp, self.m, self.v, self.comm.size, hp.grad_clip,
                       1.0 / (n_micro * self.comm.size), t=t, lr=lr, hp=hp)
        dist.zero1_update(self.comm, k, n, self.layout.n_decay)
        self.w[...] = self.wp[:n]
        norm, _, ok = k.gstate
        return StepResult(loss, norm if ok else float("nan"), ok)

    eval_rows: dict = {}                         # rank -> held-out rows it scored (class-wide, for the test)

    def eval_batch(self, x, y):
        ShardedNumpyEngine.eval_rows[self.comm.rank] = ShardedNumpyEngine.eval_rows.get(self.comm.rank, 0) + x.shape[0]
        return super().eval_batch(x, y)

    def state_host(self):
        out = [self.w.copy()]
        for x in (self.m, self.v):
            full = np.zeros(self.comm.size * self.shard, np.float32)
            self.comm.all_gather(x, full)
            out.append(full[:self.n_params])
        return tuple(out)


class ShardedBackend(NumpyBackend):
    def __init__(self, comms):
        super().__init__()
        self.comms = comms

    def make_engine(self, mc, batch_size, precision, comm=None, recompute="auto", attention="auto", grad_accum=None):
        assert attention == "auto"                  # train.attention reaches the engine (a NumPy one ignores it)
        assert grad_accum == 2                      # so does train.grad_accum (_cfg; the GPU engine's ACTS_IN_GRADS)
        return ShardedNumpyEngine(mc, batch_size, self, comm, recompute)


class Poke:
    """A hook that hands rank ``rank`` a signal after step ``step`` (as if it came to that process)."""

    def __init__(self, rank, step, sig):
        self.rank, self.step, self.sig = rank, step, sig

    def hook(self):
        from andrea.train import Hook

        def fn(tr, step):
            if tr.rank == self.rank and step == self.step:
                tr._signals.append(self.sig)
        return Hook("poke", 1, fn)


@pytest.fixture()
def world(monkeypatch):
    """run(world, cfg, out, pokes) -> every rank's exit code, the trainers run in threads."""
    import andrea.train as T

    tls = threading.local()
    monkeypatch.setattr(T.dist, "launch_env", lambda env=None: getattr(tls, "launch", None))
    monkeypatch.setattr(T.signal, "signal", lambda s, h: signal.SIG_DFL)     # handlers: main thread only
    state = {}
    monkeypatch.setattr(T.dist.NcclComm, "create", classmethod(lambda cls, launch, rdv: state["group"].comm(launch.rank)))
    monkeypatch.setattr(T, "select_backend", lambda name: (ShardedBackend(None), "test double"))

    def run(n, cfg, out, tok, tokens, pokes=(), phase="warmup"):
        state["group"] = FakeGroup(n)

        def body(r):
            tls.launch = dist.Launch(r, n, r, n, "torchrun", "t")
            tr = T.Trainer(cfg, phase, tok, tokens, out, console=_console())
            tr.hooks += [p.hook() for p in pokes]
            return tr.run()

        return on_threads(n, body, state["group"])

    return run


def _console():
    from rich.console import Console

    return Console(file=io.StringIO(), width=200)


def _cfg(n, **extra):
    return micro_cfg(12, 20, **{"train.gpus": n, "train.grad_accum": 2, "bandit.policy": "ucb1",
                                "train.eval_every": 5, **extra})


def _files(out):
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file() and p.name != "model.perf.jsonl"}


def test_two_ranks_train_one_run_and_rank_0_writes_it(world, tmp_path):
    tok, tokens = make_data(tmp_path)
    ShardedNumpyEngine.eval_rows.clear()
    assert world(2, _cfg(2), tmp_path / "r2", tok, tokens) == [0, 0]
    rows2 = dict(ShardedNumpyEngine.eval_rows)
    ShardedNumpyEngine.eval_rows.clear()
    assert world(1, _cfg(1), tmp_path / "r1", tok, tokens) == [0]
    assert rows2[0] == rows2[1] == ShardedNumpyEngine.eval_rows[0] // 2 > 0     # each rank scores half the rows
    s2 = json.loads((tmp_path / "r2" / "model.state.json").read_text())
    s1 = json.loads((tmp_path / "r1" / "model.state.json").read_text())
    assert s2["world_size"] == 2 and "world_size" not in s1 and s2["step"] == s1["step"] == 12
    assert s2["config_hash"] == s1["config_hash"]                       # train.gpus is not the trajectory
    # the same windows: every pull's source and the coverage are the 1-rank run's; the losses and
    # weights differ only by the rounding of the sums
    l2 = json.loads((tmp_path / "r2" / "model.loss.json").read_text())
    l1 = json.loads((tmp_path / "r1" / "model.loss.json").read_text())
    assert [p["source"] for p in l2["pulls"]] == [p["source"] for p in l1["pulls"]]
    assert s2["curriculum"]["sources"] == s1["curriculum"]["sources"]
    np.testing.assert_allclose([r["loss"] for r in l2["train"]], [r["loss"] for r in l1["train"]], rtol=1e-4)
    assert [v["step"] for v in l2["val"]] == [v["step"] for v in l1["val"]] == [5, 10, 12]
    for v2, v1 in zip(l2["val"], l1["val"]):                             # each rank scored half the rows
        assert v2["per_source"] == pytest.approx(v1["per_source"], rel=1e-4)
        assert v2["unigram_per_source"] == pytest.approx(v1["unigram_per_source"], rel=1e-12)
    from andrea.engine.checkpoint import read_checkpoint

    (_, w2, m2, v2), (_, w1, m1, v1) = (read_checkpoint(tmp_path / d / "model.bin", None) for d in ("r2", "r1"))
    np.testing.assert_allclose(w2, w1, rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(m2, m1, rtol=1e-2, atol=1e-6)             # the moments, gathered whole
    assert np.count_nonzero(v2) > 0.9 * v2.size
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".r")]    # nothing else written


def test_a_signal_to_one_rank_checkpoints_the_job_once_and_resume_is_bit_exact(world, tmp_path):
    tok, tokens = make_data(tmp_path)
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert world(2, _cfg(2), straight, tok, tokens, [Poke(1, 4, signal.SIGUSR1)]) == [0, 0]
    ev = json.loads((straight / "model.loss.json").read_text())["events"]
    assert [e["step"] for e in ev if e["detail"] == "SIGUSR1"] == [4]   # rank 1's signal, one checkpoint
    assert world(2, _cfg(2), cut, tok, tokens, [Poke(0, 4, signal.SIGUSR1), Poke(1, 7, signal.SIGTERM)]) == [143, 143]
    assert json.loads((cut / "model.state.json").read_text())["step"] == 7
    assert world(2, _cfg(2), cut, tok, tokens) == [0, 0]
    a, b = _files(straight), _files(cut)
    assert a["model.bin"] == b["model.bin"]
    la, lb = (json.loads(x["model.loss.json"]) for x in (a, b))
    assert la["train"] == lb["train"] and la["pulls"] == lb["pulls"] and la["val"] == lb["val"]
    sa, sb = (json.loads(x["model.state.json"]) for x in (a, b))
    assert sa["curriculum"] == sb["curriculum"]


def test_resume_at_another_world_size_works_and_says_it_is_not_bit_exact(world, tmp_path):
    tok, tokens = make_data(tmp_path)
    out = tmp_path / "run"
    assert world(2, _cfg(2), out, tok, tokens, [Poke(1, 6, signal.SIGTERM)]) == [143, 143]
    assert world(4, _cfg(4), out, tok, tokens) == [0, 0, 0, 0]
    ev = json.loads((out / "model.loss.json").read_text())["events"]
    notes = [e for e in ev if e["kind"] == "world_size"]
    assert len(notes) == 1 and notes[0]["step"] == 6 and "on 2 GPU(s), this start on 4" in notes[0]["detail"]
    st = json.loads((out / "model.state.json").read_text())
    assert st["step"] == 12 and st["world_size"] == 4
