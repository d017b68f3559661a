"""The CUDA engine end to end against the NumPy engine: logits, loss and every gradient; 10 AdamW
steps; two runs byte-identical; bit-exact resume, also across a SIGTERM sent to a real child.

    PYTHONPATH=. python3 -m pytest -m gpu tests/test_cuda_engine.py      # on a machine with a GPU

Skipped cleanly where CuPy cannot be imported or finds no CUDA device. Tolerances: fp32
``1e-5 + 1e-3 |ref|`` for logits/loss, gradients relative to each tensor's largest entry (2e-3
fp32, 6e-2 bf16/fp16, the MLP's GELU fused into the cuBLASLt epilogues or not); losses over 10 steps within 1e-3 (fp32) and 3e-2 (bf16) of the NumPy run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from andrea.cuda.loader import cupy_or_none
from andrea.engine.backend import NumpyBackend
from andrea.engine.engine import Engine, Hyper
from andrea.engine.model import ModelConfig
from andrea.errors import AndreaError

cp = cupy_or_none()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason="CuPy cannot be imported or finds no CUDA device")]

MC = ModelConfig(vocab_size=97, d_model=64, n_head=2, n_layer=2, context=128)   # D = 32: the tensor-core path in bf16


def attn_kernels(monkeypatch, which):
    """Run the engine with these tensor-core attention kernels ({"fwd": .., "bwd": ..}: "mma" | "wg" | "wgds")
    on a compute capability 9.0 device; None keeps kernels.ATTN_HOPPER. Skips where wgmma is absent."""
    if which is None:
        return
    from andrea.cuda import kernels as K

    if {"wg", "wgds"} & set(which.values()) and not K.hopper():
        pytest.skip("the wgmma attention kernels need a compute capability 9.0 device")
    monkeypatch.setattr(K, "ATTN_HOPPER", dict(which))


# besides the engine default (None: kernels.ATTN_HOPPER, wgmma in both passes on an H100/H200), the
# mma.sync forward feeding the wgmma backward and mma.sync in both passes
MMA_WG = {"fwd": "mma", "bwd": "wg"}
ALL_MMA = {"fwd": "mma", "bwd": "mma"}
WG_DS = {"fwd": "wg", "bwd": "wgds"}     # dQ from the stored dS tiles (the default at D = 64; MC's D is 32)
B = 2
HP = Hyper(grad_clip=1.0)


def batch(seed, mc=MC, b=B):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, mc.vocab_size, (b, mc.context)).astype(np.int32)
    y = np.roll(x, -1, axis=1)
    return x, y


def numpy_engine(seed=0):
    eng = Engine(MC, B, NumpyBackend())
    eng.init_weights(seed)
    return eng


def grads_close(got, ref, layout, rel):
    for t in layout.tensors:
        a = got[t.offset:t.offset + t.size]
        r = ref[t.offset:t.offset + t.size]
        scale = float(np.abs(r).max()) or 1.0
        err = float(np.abs(a - r).max())
        assert err <= rel * scale, f"grad {t.name}: max err {err:.3g} > {rel} x {scale:.3g}"


def test_op_mirror_runs_the_generic_engine_like_numpy():
    from andrea.cuda.backend import make_backend

    ref, gpu = numpy_engine(), Engine(MC, B, make_backend())
    gpu.init_weights(0)
    x, y = batch(1)
    l_ref = ref.forward(x, y)
    l_gpu = gpu.forward(x, y)
    assert abs(l_gpu - l_ref) <= 1e-5 + 1e-4 * abs(l_ref)
    np.testing.assert_allclose(cp.asnumpy(gpu.a["logits"]), ref.a["logits"], rtol=1e-3, atol=1e-5)
    ref.zero_grads(), gpu.zero_grads()
    ref.backward(1.0 / ref.N), gpu.backward(1.0 / gpu.N)
    grads_close(cp.asnumpy(gpu.g), ref.g, ref.layout, 2e-3)
    # 10 steps through the same Engine code (clip + AdamW ops), losses track the NumPy engine
    for t in range(1, 11):
        xb, yb = batch(100 + t)
        a = ref.train_step([(xb, yb)], 3e-3, t, HP)
        b = gpu.train_step([(xb, yb)], 3e-3, t, HP)
        assert a.ok and b.ok
        assert abs(a.loss - b.loss) <= 1e-3 * abs(a.loss), (t, a.loss, b.loss)


# bf16's MLP: the GELU in the cuBLASLt epilogues (default, h_act kept per layer), the same with h_act
# recomputed in the backward, and the separate k_gelu_fwd / k_gelu_bwd passes (FUSE_GELU off)
@pytest.mark.parametrize("prec,rel,fuse,recompute,attn", [
    ("fp32", 2e-3, True, None, None), ("bf16", 6e-2, True, None, None),
    ("bf16", 6e-2, True, frozenset({"gelu"}), None), ("bf16", 6e-2, False, None, None),
    ("fp16", 6e-2, True, None, None), ("bf16", 6e-2, True, None, MMA_WG), ("fp16", 6e-2, True, None, MMA_WG),
    ("bf16", 6e-2, True, None, ALL_MMA), ("bf16", 6e-2, True, None, WG_DS), ("fp16", 6e-2, True, None, WG_DS)])
def test_gpu_engine_loss_and_every_gradient_match_numpy(prec, rel, fuse, recompute, attn, monkeypatch):
    import andrea.cuda.engine as ce
    from andrea.cuda.backend import make_backend

    attn_kernels(monkeypatch, attn)
    monkeypatch.setattr(ce, "FUSE_GELU", fuse)
    if recompute is not None:
        monkeypatch.setattr(ce, "RECOMPUTE_FUSED", recompute)
    ref = numpy_engine()
    gpu = make_backend().make_engine(MC, B, precision=prec)
    assert gpu.ops.fused == (fuse and prec in ("bf16", "fp16"))
    assert gpu.a["h_act"].shape[0] == (MC.n_layer if gpu.ops.fused and recompute is None else 1)
    gpu.init_weights(0)
    assert gpu.state_host()[0].tobytes() == ref.w.tobytes()     # same init, same flat layout
    x, y = batch(2)
    ref.zero_grads()
    l_ref = ref.forward(x, y)
    tol = 1e-3 if prec == "fp32" else 5e-2
    assert abs(gpu.forward(x, y) - l_ref) <= (1e-5 if prec == "fp32" else 2e-2) * max(1.0, abs(l_ref))
    np.testing.assert_allclose(gpu.logits_host(), ref.a["logits"], rtol=tol, atol=tol * 0.1)
    ref.backward(1.0 / ref.N)
    l_gpu = gpu.compute_grads(x, y)            # the backward turns the logits buffer into dlogits
    assert abs(l_gpu - l_ref) <= (1e-5 if prec == "fp32" else 2e-2) * max(1.0, abs(l_ref))
    grads_close(gpu.grads_host() / gpu.loss_scale, ref.g, ref.layout, rel)   # fp16: g is times the loss scale


@pytest.mark.parametrize("prec,tol", [("fp32", 1e-3), ("bf16", 3e-2)])
def test_ten_steps_track_numpy(prec, tol):
    from andrea.cuda.backend import make_backend

    ref = numpy_engine()
    gpu = make_backend().make_engine(MC, B, precision=prec)
    gpu.init_weights(0)
    for t in range(1, 11):
        x, y = batch(200 + t)
        a = ref.train_step([(x, y)], 3e-3, t, HP)
        b = gpu.train_step([(x, y)], 3e-3, t, HP)
        assert a.ok and b.ok
        assert abs(a.loss - b.loss) <= tol * abs(a.loss), (t, a.loss, b.loss)
        assert abs(a.grad_norm - b.grad_norm) <= 10 * tol * a.grad_norm
    assert b.loss < 4.6 - 0.05 or b.loss < a.loss + tol      # it learns (ln 97 = 4.57 at init)


def _run(prec, steps, start=None, graph=True, accum=1, grad_accum=None, results=None):
    """``accum`` microbatches a step; ``grad_accum`` what the engine is planned for (GpuEngine's); each
    step's StepResult appended to ``results`` where given."""
    from andrea.cuda.backend import make_backend

    eng = make_backend().make_engine(MC, B, precision=prec, cuda_graph=graph, grad_accum=grad_accum)
    t0 = 0
    if start is None:
        eng.init_weights(0)
    else:
        t0, w, m, v = start
        eng.load_state(w, m, v)
    for t in range(t0 + 1, t0 + steps + 1):
        r = eng.train_step([batch(300 + 7 * t + k) for k in range(accum)], 3e-3, t, HP)
        if results is not None:
            results.append(r)
    return (t0 + steps, *eng.state_host())


@pytest.mark.parametrize("prec,attn", [("fp32", None), ("bf16", None), ("bf16", MMA_WG), ("bf16", ALL_MMA),
                                       ("bf16", WG_DS)])
def test_two_runs_are_byte_identical_and_resume_is_bit_exact(prec, attn, monkeypatch):
    attn_kernels(monkeypatch, attn)
    a = _run(prec, 6)
    b = _run(prec, 6)
    for x, y in zip(a[1:], b[1:]):
        assert x.tobytes() == y.tobytes()
    half = _run(prec, 3)
    resumed = _run(prec, 3, start=half)
    for x, y in zip(a[1:], resumed[1:]):
        assert x.tobytes() == y.tobytes()
    eager = _run(prec, 6, graph=False)        # the CUDA graph replays exactly the eager launches
    for x, y in zip(a[1:], eager[1:]):
        assert x.tobytes() == y.tobytes()


def test_own_dgelu_gemm_keeps_every_gradient_and_the_bytes(monkeypatch):
    """OWN_DGELU: the proj dgrad's DGELU through mm_dgelu.cu (kernels.MmDgelu) in every layer; the loss and
    every gradient against NumPy as the cuBLASLt path is held, two runs and a resume byte-identical, the
    graph the eager launches' bytes."""
    import andrea.cuda.engine as ce
    from andrea.cuda import kernels as K
    from andrea.cuda.backend import make_backend

    if not K.hopper():
        pytest.skip("k_mm_dgelu needs a compute capability 9.0 device")
    monkeypatch.setattr(ce, "OWN_DGELU", True)
    seen = []
    real = K.MmDgelu.__call__
    monkeypatch.setattr(K.MmDgelu, "__call__", lambda self, d, *a, **k: seen.append(d.shape) or real(self, d, *a, **k))
    ref = numpy_engine()
    gpu = make_backend().make_engine(MC, B, precision="bf16")
    assert gpu.ops.dgelu is not None and gpu.a["dgelu_maps"].shape == (MC.n_layer, 512)
    assert "mm_dgelu.cu" in gpu.describe()
    gpu.init_weights(0)
    x, y = batch(2)
    ref.zero_grads()
    l_ref = ref.forward(x, y)
    ref.backward(1.0 / ref.N)
    l_gpu = gpu.compute_grads(x, y)
    assert seen and set(seen) == {(B * MC.context, 4 * MC.d_model)} and len(seen) >= MC.n_layer
    assert abs(l_gpu - l_ref) <= 2e-2 * max(1.0, abs(l_ref))
    grads_close(gpu.grads_host(), ref.g, ref.layout, 6e-2)
    a = _run("bf16", 6)
    b = _run("bf16", 6)
    resumed = _run("bf16", 3, start=_run("bf16", 3))
    eager = _run("bf16", 6, graph=False)
    for other in (b, resumed, eager):
        for u, v in zip(a[1:], other[1:]):
            assert u.tobytes() == v.tobytes()


@pytest.mark.parametrize("prec,graph,accum", [("bf16", True, 1), ("bf16", True, None), ("bf16", False, None),
                                              ("fp32", True, None), ("fp16", False, None)])
def test_the_update_beside_the_next_forward_keeps_every_byte(prec, graph, accum, monkeypatch):
    """OVERLAP_UPDATE: AdamW on its own stream in pieces, the next forward waiting for each piece before it
    reads it. Against the single launch: the same StepResults over six steps, the same loss of an evaluation
    forward queued right after a step, the same w, m, v bytes read right after it; and a run resumed from a
    state read right after its third step ends on the six-step run's bytes. accum=1 (the benches' engine):
    the next forward also writes block l+1's activations into block l's gradient rows (ACTS_IN_GRADS)."""
    import andrea.cuda.engine as ce
    from andrea.cuda.backend import make_backend

    def run(flag):
        monkeypatch.setattr(ce, "OVERLAP_UPDATE", flag)
        eng = make_backend().make_engine(MC, B, precision=prec, cuda_graph=graph, grad_accum=accum)
        assert (eng._upd is not None) == flag == ("OVERLAP_UPDATE" in eng.describe())
        assert bool(eng.acts_in_grads) == (accum == 1 and prec == "bf16")
        eng.init_weights(0)
        res = [eng.train_step([batch(300 + t)], 3e-3, t, HP) for t in range(1, 7)]
        loss = eng.forward(*batch(999))
        return repr([(r.loss, r.grad_norm, r.ok) for r in res]), loss, [x.tobytes() for x in eng.state_host()]

    def steps(flag, n, start=None):
        monkeypatch.setattr(ce, "OVERLAP_UPDATE", flag)
        return _run(prec, n, start=start, graph=graph, grad_accum=accum)

    assert run(True) == run(False)
    resumed, whole = steps(True, 3, start=steps(True, 3)), steps(False, 6)
    assert all(x.tobytes() == y.tobytes() for x, y in zip(whole[1:], resumed[1:]))


@pytest.mark.parametrize("per_block,graph", [(2, True), (4, True), (4, False)])
def test_the_update_in_finer_pieces_keeps_every_byte(per_block, graph, monkeypatch):
    """UPDATE_BLOCK_PIECES as two pieces a block (the MLP's weights waited for at ln2) or one a matrix (the
    attention-out and proj weights waited for at their GEMMs, through the bf16 copies they read): six steps and
    an evaluation forward queued right after them give the same StepResults, loss and w, m, v bytes as the
    update in one launch after the backward."""
    import andrea.cuda.engine as ce
    from andrea.cuda.backend import make_backend
    from test_cuda_overlap_plan import HALVES, QUARTERS

    def run(overlap, pieces):
        monkeypatch.setattr(ce, "OVERLAP_UPDATE", overlap)
        monkeypatch.setattr(ce, "UPDATE_BLOCK_PIECES", pieces)
        eng = make_backend().make_engine(MC, B, precision="bf16", cuda_graph=graph, grad_accum=1)
        if overlap:
            assert len(eng._upd.pieces) == 2 + per_block * MC.n_layer
            assert f"AdamW in {2 + per_block * MC.n_layer} pieces" in eng.describe()
        eng.init_weights(0)
        res = [eng.train_step([batch(300 + t)], 3e-3, t, HP) for t in range(1, 7)]
        loss = eng.forward(*batch(999))
        return repr([(r.loss, r.grad_norm, r.ok) for r in res]), loss, [x.tobytes() for x in eng.state_host()]

    committed = ce.UPDATE_BLOCK_PIECES
    assert run(True, HALVES if per_block == 2 else QUARTERS) == run(False, committed)


@pytest.mark.parametrize("graph", [True, False])
def test_the_engine_stream_at_high_priority_keeps_every_byte(graph, monkeypatch):
    """STREAM_PRIORITY: the engine's stream (the graphs launch into it) at the device's greatest priority, the
    update's side stream at the default. The stream got a greater priority (a lower number) than the side
    stream, describe() says so, and six steps give the same StepResults and w, m, v bytes as without it."""
    import andrea.cuda.engine as ce
    from andrea.cuda.backend import make_backend

    def run(flag):
        monkeypatch.setattr(ce, "STREAM_PRIORITY", flag)
        eng = make_backend().make_engine(MC, B, precision="bf16", cuda_graph=graph, grad_accum=1)
        if flag:
            assert eng.stream.priority < eng._upd.stream.priority
            assert f"engine stream priority {eng.stream.priority}" in eng.describe()
        eng.init_weights(0)
        res = [eng.train_step([batch(300 + t)], 3e-3, t, HP) for t in range(1, 7)]
        return repr([(r.loss, r.grad_norm, r.ok) for r in res]), [x.tobytes() for x in eng.state_host()]

    assert run(True) == run(False)


@pytest.mark.parametrize("prec,graph,accum,micro", [("bf16", True, 1, 1), ("bf16", False, None, 1),
                                                    ("bf16", True, None, 3), ("fp32", True, None, 1)])
def test_the_norm_beside_the_backward_is_the_norm_in_its_own_order(prec, graph, accum, micro, monkeypatch):
    """OVERLAP_NORM: the norm's partial sums piece by piece on their own stream during the backward. Against
    the single pass: each step's norm within fp32 summation error (1e-5 relative; the slots sum in another
    order) and the weights after six steps within 1e-4 relative of the largest; with it, CUDA graph and eager
    the same bytes, two runs the same bytes and a run resumed after three steps on the six-step run's bytes.
    micro=3: every microbatch's backward sums the pieces, the last one's sums stand."""
    import andrea.cuda.engine as ce
    from andrea.cuda.backend import make_backend

    def run(flag, g=graph, start=None, n=6):
        monkeypatch.setattr(ce, "OVERLAP_NORM", flag)
        res = []
        state = _run(prec, n, start=start, graph=g, accum=micro, grad_accum=accum, results=res)
        return [r.grad_norm for r in res], state

    for flag in (True, False):
        monkeypatch.setattr(ce, "OVERLAP_NORM", flag)
        eng = make_backend().make_engine(MC, B, precision=prec, cuda_graph=graph, grad_accum=accum)
        assert (eng._norm is not None) == flag == ("OVERLAP_NORM" in eng.describe())
    on, off = run(True), run(False)
    np.testing.assert_allclose(on[0], off[0], rtol=1e-5)
    for x, y in zip(on[1][1:], off[1][1:]):
        assert np.abs(x - y).max() <= 1e-4 * np.abs(y).max()
    for other in (run(True, not graph), run(True)):
        assert other[0] == on[0] and all(x.tobytes() == y.tobytes() for x, y in zip(on[1][1:], other[1][1:]))
    resumed = run(True, start=run(True, n=3)[1], n=3)
    assert all(x.tobytes() == y.tobytes() for x, y in zip(on[1][1:], resumed[1][1:]))


@pytest.mark.parametrize("prec", ["bf16", "fp8"])
def test_first_microbatch_writing_the_weight_gradients_keeps_the_bytes(prec, monkeypatch):
    """engine.WGRAD_WRITES (the default): a step's first microbatch writes the block weights' gradients (beta
    0) over rows zero_grads left as they were, and the later ones add. Against WGRAD_WRITES off (g zeroed
    whole, every microbatch adding): g after compute_grads (the rows of a previous batch's gradient beneath)
    and w, m, v after 4 steps of 1 and of 3 microbatches, CUDA graph and eager, byte-identical; fp8 with
    delayed scaling (its first step eager, then the graphs). fp32 keeps the zeroed buffer (its cuBLAS may
    pick another kernel for beta 0)."""
    import andrea.cuda.engine as ce
    from andrea.cuda.backend import make_backend

    if prec == "fp8" and int(cp.cuda.Device().compute_capability) < 89:
        pytest.skip("fp8 needs an sm_89+ GPU")
    kw = {"fp8_scaling": "delayed"} if prec == "fp8" else {}

    def run(graph, accum):
        eng = make_backend().make_engine(MC, B, precision=prec, cuda_graph=graph, **kw)
        eng.init_weights(0)
        eng.compute_grads(*batch(5))
        g1 = eng.grads_host()
        eng.compute_grads(*batch(6))                       # over g1's rows: written, not added
        out = [g1, eng.grads_host()]
        for t in range(1, 5):
            eng.train_step([batch(300 + 7 * t + k) for k in range(accum)], 3e-3, t, HP)
        return eng, out + list(eng.state_host())

    for graph in (True, False):
        for accum in (1, 3):
            monkeypatch.setattr(ce, "WGRAD_WRITES", True)
            eng, on = run(graph, accum)
            assert eng._wgrad_span is not None and (not graph or set(eng.graph) == {0.0, 1.0})
            monkeypatch.setattr(ce, "WGRAD_WRITES", False)
            eng, off = run(graph, accum)
            assert eng._wgrad_span is None
            for x, y in zip(on, off):
                assert x.tobytes() == y.tobytes(), (graph, accum)
    assert np.abs(on[1]).max() > 0 and on[0].tobytes() != on[1].tobytes()
    fp32 = make_backend().make_engine(MC, B, precision="fp32")
    assert fp32._wgrad_span is None


@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_the_head_weight_gradient_over_the_padded_vocabulary(prec, monkeypatch):
    """engine.PAD_HEAD_WGRAD (the default): dwte's GEMM runs over the padded vocabulary (V = 97 -> 128 rows),
    its last 31 rows landing on wpe's gradient with + 0, the pad columns of dlogits being zero. Against it
    off, over two microbatches (the second adding onto the first's wpe rows): every gradient but wte's
    byte-identical, wte's within the rounding of another GEMM kernel."""
    import andrea.cuda.engine as ce
    from andrea.cuda.backend import make_backend

    def grads(pad):
        monkeypatch.setattr(ce, "PAD_HEAD_WGRAD", pad)
        eng = make_backend().make_engine(MC, B, precision=prec, cuda_graph=False)
        eng.init_weights(0)
        eng.zero_grads()
        for k in range(2):
            eng.micro_step(*batch(40 + k))
        eng.stream.synchronize()
        full = eng.a["logits"].get()
        assert full.shape[1] == 128 and not full[:, MC.vocab_size:].any()    # dlogits' pad columns: zero
        return eng.grads_host() / eng.loss_scale

    on, off = grads(True), grads(False)
    n_wte = MC.vocab_size * MC.d_model
    assert np.abs(on[n_wte:n_wte + 31 * MC.d_model]).max() > 0              # wpe's rows under the pad
    assert on[n_wte:].tobytes() == off[n_wte:].tobytes()
    np.testing.assert_allclose(on[:n_wte], off[:n_wte], rtol=0, atol=1e-6 + 1e-3 * np.abs(off[:n_wte]).max())


@pytest.mark.parametrize("prec,rel", [("bf16", 6e-2), ("fp32", 2e-3)])
def test_dh_in_the_logits_bytes_keeps_the_gradients_and_the_bytes(prec, rel, monkeypatch):
    """engine.DH_IN_LOGITS at a vocabulary where dL/dh fits in the logits (V = 300, Vp = 320 >= 4C = 256; MC's
    97 is too small): dh is a view of the logits' first bytes, every gradient matches NumPy's, and w, m, v
    after 4 steps (CUDA graph) are byte-identical to dh in its own bytes."""
    import andrea.cuda.engine as ce
    from andrea.cuda.backend import make_backend

    mc = ModelConfig(vocab_size=300, d_model=64, n_head=2, n_layer=2, context=128)

    def run(on):
        monkeypatch.setattr(ce, "DH_IN_LOGITS", on)
        eng = make_backend().make_engine(mc, B, precision=prec)
        assert (eng.a["dh"].data.ptr == eng.a["logits"].data.ptr) == on
        eng.init_weights(0)
        for t in range(1, 5):
            eng.train_step([batch(700 + t, mc)], 3e-3, t, HP)
        return eng, [x.tobytes() for x in eng.state_host()]

    eng, on = run(True)
    assert on == run(False)[1]
    ref = Engine(mc, B, NumpyBackend())
    ref.init_weights(0)
    gpu = make_backend().make_engine(mc, B, precision=prec)
    gpu.init_weights(0)
    x, y = batch(9, mc)
    ref.zero_grads()
    ref.forward(x, y)
    ref.backward(1.0 / ref.N)
    gpu.compute_grads(x, y)
    grads_close(gpu.grads_host(), ref.g, ref.layout, rel)


def test_attention_backward_falls_back_where_the_logits_cannot_hold_ds(monkeypatch):
    # "wgds" keeps dS in the logits' bytes: at T = 1024 one head needs 1.1 MB of tiles, a 97-token
    # vocabulary's logits (B = 1) hold 256 KiB, so the engine runs "wg" there: the same bytes as "wg" forced
    from andrea.cuda import kernels as K
    from andrea.cuda.backend import make_backend

    mc = ModelConfig(vocab_size=97, d_model=64, n_head=2, n_layer=1, context=1024)
    attn_kernels(monkeypatch, WG_DS)
    got = []
    for which in (WG_DS, {"fwd": "wg", "bwd": "wg"}):
        monkeypatch.setattr(K, "ATTN_HOPPER", dict(which))
        eng = make_backend().make_engine(mc, 1, precision="bf16", cuda_graph=False)
        assert eng.a["logits"].nbytes < K.attn_ds_bytes(mc.context)
        eng.init_weights(0)
        assert eng.train_step([batch(5, mc, 1)], 3e-3, 1, HP).ok
        got.append(eng.state_host()[0].tobytes())
    assert got[0] == got[1]


def test_attention_ds_tiles_over_logits_or_the_free_run_keep_the_bytes(monkeypatch):
    # "wgds" where the logits hold fewer heads' dS tiles than the batch has: the heads they cannot hold
    # go into the run of free bytes from the layer's h_pre on (FastOps._spare_run). With the arena's
    # AFTER_H_PRE order that run contains the logits and holds every head (one launch pair); in the plan's
    # order the tiles go to the logits and the h_pre run; with no run, launches over the logits alone.
    # The same bytes every way.
    import cupy as cp

    from andrea.cuda import engine as ce
    from andrea.cuda import kernels as K
    from andrea.cuda.backend import make_backend

    mc = ModelConfig(vocab_size=1500, d_model=256, n_head=4, n_layer=2, context=1024)    # D = 64
    attn_kernels(monkeypatch, WG_DS)
    per, heads = K.attn_ds_bytes(mc.context), 2 * mc.n_head
    got = []
    for mode in ("run", "pair", "logits"):
        if mode == "pair":
            monkeypatch.setattr(ce, "AFTER_H_PRE", ())
        if mode == "logits":
            monkeypatch.setattr(ce.FastOps, "_spare_run", lambda self, l: self.a["h_pre"][l][:0].view(cp.uint8))
        eng = make_backend().make_engine(mc, 2, precision="bf16", cuda_graph=False, attention="kernels")
        lg, run = eng.a["logits"], eng.ops._runs[eng.a["qkv"][1].data.ptr]
        assert 1 <= lg.nbytes // per < heads
        inside = run.data.ptr <= lg.data.ptr < run.data.ptr + run.nbytes
        assert (inside, run.nbytes // per >= heads) == {"run": (True, True), "pair": (False, False),
                                                         "logits": (False, False)}[mode]
        eng.init_weights(0)
        assert eng.train_step([batch(6, mc, 2)], 3e-3, 1, HP).ok
        got.append(eng.state_host()[0].tobytes())
    assert got[0] == got[1] == got[2]


def test_fp16_resume_with_extra_state_is_bit_exact():
    """fp16's dynamic loss scale is engine state: N steps, save w, m, v and extra_state, restore
    into a fresh engine, M more steps == N + M straight steps, bit for bit. The run starts at a
    loss scale that overflows, so the scale moves (skipped steps halve it) and the test would
    fail if the scale were not carried over."""
    from andrea.cuda.backend import make_backend

    def fresh():
        eng = make_backend().make_engine(MC, B, precision="fp16")
        eng.init_weights(0)
        eng.load_extra_state({"loss_scale": 2.0 ** 24, "good_steps": 0})
        return eng

    def steps(eng, t0, t1):
        return [eng.train_step([batch(500 + t)], 3e-3, t, HP).ok for t in range(t0, t1)]

    straight = fresh()
    oks = steps(straight, 1, 21)
    assert not all(oks) and any(oks), oks                  # the scale overflowed, then recovered
    first = fresh()
    steps(first, 1, 11)
    saved, extra = first.state_host(), first.extra_state()
    assert extra != {"loss_scale": 2.0 ** 24, "good_steps": 0} and extra["loss_scale"] < 2.0 ** 24
    resumed = make_backend().make_engine(MC, B, precision="fp16")
    resumed.load_state(*saved)
    resumed.load_extra_state(extra)
    steps(resumed, 11, 21)
    assert resumed.extra_state() == straight.extra_state()
    for x, y in zip(straight.state_host(), resumed.state_host()):
        assert x.tobytes() == y.tobytes()
    with pytest.raises(AndreaError, match="expected keys"):
        resumed.load_extra_state({"loss_scale": 1.0})
    assert make_backend().make_engine(MC, B, precision="bf16").extra_state() == {}


def test_grad_accumulation_and_fp16_loss_scaling_run():
    acc = _run("bf16", 2, accum=2)
    assert all(np.isfinite(x).all() for x in acc[1:])
    f16 = _run("fp16", 3)
    assert all(np.isfinite(x).all() for x in f16[1:])


@pytest.mark.parametrize("graph", [True, False])
def test_reading_the_last_loss_after_the_update_keeps_the_bytes(graph, monkeypatch):
    """engine.READ_LOSS_LAST (the default): train_step reads the last microbatch's loss back after the update
    is queued. Against Engine.train_step's loop (off): the same StepResults, the same on_loss calls and the
    same w, m, v bytes over steps of 1 and 3 microbatches, with the loss of one microbatch made NaN on the
    device (finite gradients: only the loss says skip) as the last of its step, then as the first."""
    import andrea.cuda.engine as ce
    from andrea.cuda.backend import make_backend

    real = ce.GpuEngine._queue_micro

    def run(on, poison):
        monkeypatch.setattr(ce, "READ_LOSS_LAST", on)
        calls = [0]

        def queue(self, x, y):
            real(self, x, y)
            calls[0] += 1
            if calls[0] == poison:
                self.a["loss_out"][:1].fill(np.nan)          # on the engine's stream (queue runs inside it)

        monkeypatch.setattr(ce.GpuEngine, "_queue_micro", queue)
        eng = make_backend().make_engine(MC, B, precision="bf16", cuda_graph=graph)
        eng.init_weights(0)
        seen, results = [], []
        for t, accum in enumerate((1, 3, 3, 1), start=1):
            r = eng.train_step([batch(500 + 5 * t + k) for k in range(accum)], 3e-3, t, HP, on_loss=seen.append)
            results.append((r.loss, r.grad_norm, r.ok))
        return repr(results), repr(seen), [x.tobytes() for x in eng.state_host()]

    for poison in (4, 5):                      # the 4th microbatch ends step 2, the 5th starts step 3
        on, off = run(True, poison), run(False, poison)
        assert on == off
        assert "nan" in on[0] and on[0].count("False") == 1


@pytest.mark.parametrize("graph", [True, False])
def test_clearing_the_gradients_after_the_update_keeps_the_bytes(graph, monkeypatch):
    """engine.CLEAR_AFTER_UPDATE (the default): the update clears g outside the block weights' rows, so the
    next zero_grads queues nothing. Against off: the same StepResults and w, m, v bytes over steps of 1 and 3
    microbatches, one skipped (a NaN loss last in it), with a microbatch queued between an update and the
    next step's zero_grads (which then clears again); on, that part of g is zero after every update."""
    import andrea.cuda.engine as ce
    from andrea.cuda.backend import make_backend

    real = ce.GpuEngine._queue_micro

    def run(on):
        monkeypatch.setattr(ce, "CLEAR_AFTER_UPDATE", on)
        calls = [0]

        def queue(self, x, y):
            real(self, x, y)
            calls[0] += 1
            if calls[0] == 4:                             # the last microbatch of step 2
                self.a["loss_out"][:1].fill(np.nan)

        monkeypatch.setattr(ce.GpuEngine, "_queue_micro", queue)
        eng = make_backend().make_engine(MC, B, precision="bf16", cuda_graph=graph)
        eng.init_weights(0)
        results, cleared = [], []
        for t, accum in enumerate((1, 3, 1, 3), start=1):
            if t == 3:
                eng.micro_step(*batch(77))                 # outside a step: adds into every part of g
            r = eng.train_step([batch(600 + 5 * t + k) for k in range(accum)], 3e-3, t, HP)
            results.append((r.loss, r.grad_norm, r.ok))
            lo, hi = eng._wgrad_span
            cleared.append(not np.any(np.concatenate([eng.g[:lo].get(), eng.g[hi:].get()])))
        return repr(results), [x.tobytes() for x in eng.state_host()], cleared

    on, off = run(True), run(False)
    assert on[:2] == off[:2] and "nan" in on[0] and on[0].count("False") == 1
    assert on[2] == [True] * 4 and off[2] == [False] * 4


@pytest.mark.parametrize("prec,graph", [("bf16", True), ("bf16", False), ("fp16", False)])
def test_activations_in_the_gradients_bytes_keep_the_bytes(prec, graph):
    """engine.ACTS_IN_GRADS (grad_accum=1): layers 1.. of the moved activations lie in the gradient rows of the
    layer below. Against the engine planned for any number of microbatches: the same StepResults and w, m, v
    bytes over four steps, then the same gradients of compute_grads, byte for byte; a step's second
    microbatch is refused in one line."""
    from andrea.cuda.backend import make_backend

    mc = ModelConfig(vocab_size=97, d_model=64, n_head=2, n_layer=3, context=128)

    def run(accum):
        eng = make_backend().make_engine(mc, B, precision=prec, cuda_graph=graph, grad_accum=accum)
        eng.init_weights(0)
        res = [eng.train_step([batch(700 + t, mc)], 3e-3, t, HP) for t in range(1, 5)]
        eng.compute_grads(*batch(800, mc))
        return eng, repr([(r.loss, r.grad_norm, r.ok) for r in res]), [x.tobytes() for x in eng.state_host()], \
            eng.grads_host().tobytes()

    one, any_ = run(1), run(None)
    eng = one[0]
    assert eng.acts_in_grads and not any_[0].acts_in_grads
    assert one[1:] == any_[1:]
    g0, g1 = eng.g.data.ptr, eng.g.data.ptr + eng.g.nbytes
    for name in eng.acts_in_grads:
        assert len(eng.a[name]) == mc.n_layer and not g0 <= eng.a[name][0].data.ptr < g1
        assert all(g0 <= v.data.ptr and v.data.ptr + v.nbytes <= g1 for v in eng.a[name][1:])
    eng.zero_grads()
    eng.micro_step(*batch(900, mc))
    with pytest.raises(AndreaError, match=r"a second microbatch in one step.*train\.grad_accum\)$"):
        eng.micro_step(*batch(901, mc))


def test_a_nan_step_never_reaches_the_weights():
    from andrea.cuda.backend import make_backend

    eng = make_backend().make_engine(MC, B, precision="bf16")
    eng.init_weights(0)
    before = eng.state_host()
    eng.zero_grads()
    x, y = batch(9)
    loss = eng.micro_step(x, y)
    eng.g[5] = np.nan                            # a poisoned gradient
    res = eng.apply_update(1, loss, 3e-3, 1, HP)
    assert not res.ok
    for p, q in zip(before, eng.state_host()):
        assert p.tobytes() == q.tobytes()


CHILD = textwrap.dedent("""
    import signal, struct, sys, time
    import numpy as np
    sys.path.insert(0, {root!r})
    from andrea.cuda.backend import make_backend
    from andrea.engine.engine import Hyper
    from andrea.engine.model import ModelConfig
    from andrea.fsutil import atomic_write_bytes
    mc = ModelConfig(97, 64, 2, 2, 128)
    out, n_steps, resume, slow = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
    eng = make_backend().make_engine(mc, 2, precision="bf16")
    step = 0
    if resume:
        raw = open(out, "rb").read()
        step, n = struct.unpack("<ii", raw[:8])
        arr = np.frombuffer(raw[8:], dtype="<f4").reshape(3, n)
        eng.load_state(arr[0], arr[1], arr[2])
    else:
        eng.init_weights(0)
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    def save():
        w, m, v = eng.state_host()
        atomic_write_bytes(out, struct.pack("<ii", step, eng.n_params) + np.concatenate([w, m, v]).astype("<f4").tobytes())
    print("ready", flush=True)
    while step < n_steps:
        rng = np.random.default_rng(1000 + step)
        x = rng.integers(0, 97, (2, 128)).astype(np.int32)
        eng.train_step([(x, np.roll(x, -1, 1))], 3e-3, step + 1, Hyper())
        step += 1
        if stop:
            save(); sys.exit(0)
        if slow:
            time.sleep(0.05)
    save()
""")


def test_sigterm_checkpoint_then_resume_is_bit_exact(tmp_path: Path):
    root = str(Path(__file__).resolve().parents[1])
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=root))
    straight, stopped = tmp_path / "straight.bin", tmp_path / "stopped.bin"
    subprocess.run([sys.executable, str(script), str(straight), "40", "0", "0"], check=True, timeout=300)
    p = subprocess.Popen([sys.executable, str(script), str(stopped), "40", "0", "1"], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.6)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=120) == 0
    k = int(np.frombuffer(stopped.read_bytes()[:4], "<i4")[0])
    assert 0 < k < 40, k
    subprocess.run([sys.executable, str(script), str(stopped), "40", "1", "0"], check=True, timeout=300)
    assert stopped.read_bytes() == straight.read_bytes()
    assert os.path.getsize(straight) == 8 + 3 * 4 * int(np.frombuffer(straight.read_bytes()[4:8], "<i4")[0])


def test_the_bench_frees_each_engine_before_the_next_one():
    """bench/engine_gpu.bench_ours, twice: the first engine's arena is back in the pool before the second is
    built. An engine holds reference cycles, so ``del`` alone left it alive until the collector happened to
    run; engine_ab's arms then piled up 21 GB engines until an 80 GB H100 refused the sixth (session 38)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from script_helpers import load_script

    eg = load_script("bench/engine_gpu.py")
    s = dict(eg.variant_shapes("andrea-12m"), T=128)
    eg.release_pool()
    pool = cp.get_default_memory_pool()
    before = pool.used_bytes()
    first = eg.bench_ours(s, 2, 2, 1, "bf16")
    second = eg.bench_ours(s, 2, 2, 1, "bf16")
    assert first["planned_bytes"] == second["planned_bytes"] > 0
    assert second["peak_bytes"] == first["peak_bytes"] >= before + first["planned_bytes"]   # not one more arena
    assert pool.used_bytes() == before
    assert isinstance(first["device"], str) and first["device"].startswith("NVIDIA")    # gpu_targets' card
