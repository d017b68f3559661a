"""The engine allocates every buffer once: what is allocated equals the printed plan, and
training steps allocate nothing the size of a planned buffer (tracemalloc sees NumPy's
data allocations), nor move any buffer.

    pytest tests/test_engine_alloc.py
"""

from __future__ import annotations

import math
import tracemalloc

import numpy as np

from andrea.engine import ops_numpy
from andrea.engine.backend import NumpyBackend
from andrea.engine.engine import Engine, Hyper
from andrea.engine.model import ModelConfig

MC = ModelConfig(vocab_size=300, d_model=128, n_head=4, n_layer=2, context=64)
# The engine runs one batch slice per pool thread; 8 rows per slice, so one slice's (rows, C)
# fp32 activation is 256 KiB whatever the machine.
S = ops_numpy.n_threads()
B = 8 * S
# NumPy's ufuncs use fixed iteration buffers (8192 elements each, whatever the array size) for
# strided or broadcast operands, one set per thread running an op; anything activation-sized
# is >= one (N, C) fp32 = 256 KiB x S here.
TRANSIENT = (96 << 10) * S


def _batch(rng):
    x = rng.integers(0, MC.vocab_size, (B, MC.context)).astype(np.int32)
    return x, np.roll(x, -1, axis=1)


def _peak_during(fn) -> int:
    """Bytes allocated above the starting level at the peak while ``fn`` runs."""
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    fn()
    return tracemalloc.get_traced_memory()[1] - base


def test_planned_bytes_are_the_allocated_bytes():
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        eng = Engine(MC, B, NumpyBackend())
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert eng.allocated_bytes == eng.planned_bytes
    # construction holds the plan plus small bookkeeping (views, dicts): within 2% + 256 KiB
    assert eng.planned_bytes <= grown <= eng.planned_bytes * 1.02 + (256 << 10), (grown, eng.planned_bytes)
    assert str(f"{eng.planned_bytes:,}") in eng.describe()


def test_the_step_loop_allocates_nothing_big_and_moves_no_buffer():
    eng = Engine(MC, B, NumpyBackend())
    eng.init_weights(0)
    rng = np.random.default_rng(0)
    hp = Hyper()
    batches = [_batch(rng) for _ in range(6)]
    for i in range(2):                               # warm up: first-call caches, lazy imports
        eng.train_step([batches[i]], 1e-3, i + 1, hp)
    addrs = {k: (a.ctypes.data, a.nbytes) for k, a in eng.buffers().items()}
    smallest_big = MC.context * B * MC.d_model * 4   # one (N, C) fp32 activation
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        peak = _peak_during(lambda: [eng.train_step([b], 1e-3, 3 + i, hp) for i, b in enumerate(batches[2:5])])
        peak_accum = _peak_during(lambda: eng.train_step(batches[:3], 1e-3, 6, hp))   # grad accumulation
        peak_eval = _peak_during(lambda: eng.eval_batch(*batches[5]))
        after = tracemalloc.get_traced_memory()[0]
        # control: the harness does see an activation-sized allocation
        control = _peak_during(lambda: eng.a["h_pre"][0] * 2.0)
    finally:
        tracemalloc.stop()
    assert control >= 4 * smallest_big, "tracemalloc does not see NumPy allocations: the test would be vacuous"
    for what, p in (("train_step", peak), ("train_step x3 microbatches", peak_accum), ("eval_batch", peak_eval)):
        assert p < TRANSIENT < smallest_big, f"{what}: peak +{p} bytes during the step (an (N, C) buffer is {smallest_big})"
    assert after - base < 16 << 10, f"the step loop leaks {after - base} bytes"
    assert {k: (a.ctypes.data, a.nbytes) for k, a in eng.buffers().items()} == addrs


def test_the_step_draws_and_reports_every_microbatch_even_after_a_nan_one(monkeypatch):
    """THE microbatch loop (Engine.train_step, which the trainer calls): a NaN/inf microbatch
    adds no gradient, but the later ones are still drawn and their losses reported, so the data
    stream and the curriculum do not depend on a bad step; the update is skipped."""
    mc = ModelConfig(vocab_size=11, d_model=8, n_head=2, n_layer=1, context=4)
    eng = Engine(mc, 2, NumpyBackend())
    eng.init_weights(0)
    w0 = eng.w.copy()
    real = eng.micro_step
    losses = iter([float("nan"), None, None])
    monkeypatch.setattr(eng, "micro_step", lambda x, y: next(losses) or real(x, y))
    drawn, seen = [], []

    def batches():
        for i in range(3):
            drawn.append(i)
            yield np.full((2, 4), i, np.int32), np.full((2, 4), i + 1, np.int32)

    res = eng.train_step(batches(), 1e-2, 1, Hyper(), n_micro=3, on_loss=seen.append)
    assert drawn == [0, 1, 2] and len(seen) == 3
    assert math.isnan(seen[0]) and all(math.isfinite(v) for v in seen[1:])
    assert not res.ok and math.isnan(res.loss)
    assert np.array_equal(eng.w, w0)


def test_recompute_gelu_keeps_one_gelu_buffer_and_the_same_bytes():
    # train.recompute=gelu on the NumPy engine: h_act is one buffer refilled by the backward
    # (ops.gelu_forward, the function mlp_forward applies), so the plan is smaller by the other
    # layers' (N, 4C) and three steps give the same weights, bit for bit
    runs = {}
    for rc in ("auto", "gelu"):
        eng = Engine(MC, B, NumpyBackend(), recompute=rc)
        eng.init_weights(0)
        rng = np.random.default_rng(3)
        for t in range(3):
            eng.train_step([_batch(rng)], 1e-3, t + 1, Hyper(0.9, 0.95, 1e-8, 0.1, 1.0))
        runs[rc] = (eng, eng.state_host()[0].tobytes())
    (keep, w_keep), (gelu, w_gelu) = runs["auto"], runs["gelu"]
    assert keep.policy.recompute == frozenset() and gelu.policy.recompute == frozenset({"gelu"})
    N, F = B * MC.context, 4 * MC.d_model
    assert keep.planned_bytes - gelu.planned_bytes == (MC.n_layer - 1) * N * F * 4
    assert w_keep == w_gelu
