"""Engine gradients against float64 central finite differences, for every parameter tensor,
and the +=/= contract of every backward op.

    pytest tests/test_engine_grad.py
"""

from __future__ import annotations

import numpy as np
import pytest

from andrea.engine import ops_numpy as ops
from andrea.engine.backend import NumpyBackend
from andrea.engine.engine import Engine
from andrea.engine.model import ModelConfig, param_layout

MICRO = ModelConfig(vocab_size=11, d_model=8, n_head=2, n_layer=2, context=5)
B = 2


def _engine64(seed=0):
    eng = Engine(MICRO, B, NumpyBackend(), dtype="float64")
    eng.init_weights(seed)
    rng = np.random.default_rng(seed + 1)
    # larger, non-trivial weights (incl. LayerNorm g/b) so every term of every gradient matters
    eng.w[:] = rng.normal(0.0, 0.3, eng.n_params)
    for t in eng.layout.tensors:
        if t.name.endswith(".g"):
            eng.W[t.name][:] += 1.0
    x = rng.integers(0, MICRO.vocab_size, (B, MICRO.context)).astype(np.int32)
    y = rng.integers(0, MICRO.vocab_size, (B, MICRO.context)).astype(np.int32)
    return eng, x, y


def test_layout_offsets_cover_the_flat_buffer_and_decay_prefix():
    lay = param_layout(MICRO)
    off = 0
    for t in lay.tensors:
        assert t.offset == off
        off += t.size
    assert off == lay.n_params
    assert all(t.decay == (t.offset < lay.n_decay) for t in lay.tensors)
    assert {t.name for t in lay.tensors if not t.decay} == {
        *(f"h.{l}.{k}" for l in range(2) for k in ("ln1.g", "ln1.b", "ln2.g", "ln2.b")), "lnf.g", "lnf.b"}
    # 12M recipe: the seeds quote 12.8M parameters
    assert round(param_layout(ModelConfig(4353, 384, 12, 6, 1024)).n_params / 1e6, 1) == 12.7


@pytest.mark.parametrize("att_block", [64, 2])   # 2 < context: ragged causal blocks, the upper one skipped
def test_every_parameter_gradient_matches_central_differences(monkeypatch, att_block):
    monkeypatch.setattr(ops, "ATT_BLOCK", att_block)
    eng, x, y = _engine64()
    eng.zero_grads()
    eng.forward(x, y)
    eng.backward(1.0 / eng.N)
    analytic = eng.g.copy()
    h = 1e-6
    numeric = np.zeros_like(analytic)
    for i in range(eng.n_params):
        old = eng.w[i]
        eng.w[i] = old + h
        lp = eng.forward(x, y)
        eng.w[i] = old - h
        lm = eng.forward(x, y)
        eng.w[i] = old
        numeric[i] = (lp - lm) / (2 * h)
    for t in eng.layout.tensors:
        a = analytic[t.offset:t.offset + t.size]
        n = numeric[t.offset:t.offset + t.size]
        assert np.abs(a).max() > 1e-6, f"{t.name}: gradient vanishes, the check would be vacuous"
        # tolerance: tol + |ref| * eps, with ref the finite difference
        bad = np.abs(a - n) > 1e-7 + 1e-5 * np.abs(n)
        assert not bad.any(), f"{t.name}: max abs err {np.abs(a - n).max():.3e}"


def _rand(rng, *shape):
    return rng.normal(size=shape)


@pytest.mark.parametrize("block", [1, 3, 4])
def test_causal_blocks_skip_only_exact_zeros(monkeypatch, block):
    """Attention in causal blocks (the all-masked blocks never multiplied) gives the full
    products' results: outputs, saved probabilities (exact zeros above the diagonal) and input
    gradients, with every written buffer and the scratch prefilled with NaN."""
    rng = np.random.default_rng(5)
    Bb, T, C, H = 2, 7, 8, 2
    qkv, dout = _rand(rng, Bb, T, 3 * C), _rand(rng, Bb, T, C)
    mask = np.triu(np.full((T, T), -np.inf), 1)

    def run(att_block):
        monkeypatch.setattr(ops, "ATT_BLOCK", att_block)
        work = np.full(ops.work_elems(Bb, T, C, H, 3), np.nan)
        y, att, dqkv = np.full((Bb, T, C), np.nan), np.full(ops.att_shape(Bb, H, T), np.nan), np.full_like(qkv, np.nan)
        ops.attn_forward(y, att, qkv, mask, H, work)
        ops.attn_backward(dqkv, dout, qkv, att, y, H, work)
        return y, att, dqkv

    full = run(T)
    got = run(block)
    assert len(ops._causal_blocks(T)) == -(-T // block)
    P = got[1].transpose(0, 2, 3, 1)                     # (B, H, queries, keys)
    assert (P[..., np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] == 0).all()
    for name, a, b in zip(("y", "att", "dqkv"), got, full):
        assert np.isfinite(a).all(), name
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-15, err_msg=name)


def test_every_backward_op_adds_into_parameter_and_stream_gradients_and_writes_the_rest():
    """The op contract: parameter gradients and layernorm_backward's dx (the residual stream)
    are added into (+=); every other input gradient is written (=): prefilled with NaN, it
    comes back the same as from zeros."""
    rng = np.random.default_rng(3)
    Bb, T, C, H, V = 2, 4, 8, 2, 7
    N = Bb * T
    work = np.zeros(ops.work_elems(Bb, T, C, H, V))
    x = _rand(rng, N, C)
    g, b = _rand(rng, C), _rand(rng, C)
    mean, rstd = np.zeros(N), np.zeros(N)
    ops.layernorm_forward(np.zeros((N, C)), mean, rstd, x, g, b)
    qkv = _rand(rng, Bb, T, 3 * C)
    att = np.zeros(ops.att_shape(Bb, H, T))
    mask = np.triu(np.full((T, T), -np.inf), 1)
    y = np.zeros((Bb, T, C))
    ops.attn_forward(y, att, qkv, mask, H, work)
    w_fc, w_proj = _rand(rng, C, 4 * C), _rand(rng, 4 * C, C)
    h_pre, h_act = np.zeros((N, 4 * C)), np.zeros((N, 4 * C))
    ops.mlp_forward(np.zeros((N, C)), h_pre, h_act, x, w_fc, w_proj)
    wte = _rand(rng, V, C)
    targets = rng.integers(0, V, N).astype(np.int32)
    idx = targets.reshape(Bb, T)
    logits, probs = np.zeros((N, V)), np.zeros((N, V))

    def fresh_probs():
        ops.loss_forward(np.zeros(N), logits, probs, x, wte, targets, work)
        return probs

    dres = _rand(rng, N, C)
    A, W_ = "add", "write"
    cases = {   # name: (run, [(shape, add | write) per gradient argument])
        "embed": (lambda gs: ops.embed_backward(*gs, _rand(np.random.default_rng(0), Bb, T, C), idx),
                  [((V, C), A), ((T, C), A)]),
        "layernorm": (lambda gs: ops.layernorm_backward(*gs, np.ones((N, C)), x, mean, rstd, g, work),
                      [((N, C), A), ((C,), A), ((C,), A)]),
        "attn_qkv": (lambda gs: ops.attn_qkv_backward(*gs, np.ones((N, 3 * C)), x, np.ones((C, 3 * C)), work),
                     [((N, C), W_), ((C, 3 * C), A)]),
        "attn": (lambda gs: ops.attn_backward(*gs, np.ones((Bb, T, C)), qkv, att, y, H, work), [((Bb, T, 3 * C), W_)]),
        "attn_out": (lambda gs: ops.attn_out_backward(*gs, np.ones((N, C)), x, np.ones((C, C)), work),
                     [((N, C), W_), ((C, C), A)]),
        "mlp": (lambda gs: ops.mlp_backward(*gs, np.ones((N, C)), x, h_pre, h_act, w_fc, w_proj, work),
                [((N, C), W_), ((C, 4 * C), A), ((4 * C, C), A)]),
        "residual_add": (lambda gs: ops.residual_add_backward(*gs, dres), [((N, C), W_)]),
        "loss": (lambda gs: ops.loss_backward(gs[0], gs[1], logits, fresh_probs(), x, wte, targets, 1.0 / N, work),
                 [((N, C), W_), ((V, C), A)]),
    }
    for name, (run, spec) in cases.items():
        zeros = [np.zeros(s_) for s_, _ in spec]
        run(zeros)
        assert all(np.abs(z).max() > 0 for z in zeros), f"{name}: a gradient stayed zero"
        base = [_rand(rng, *s_) if how == A else np.full(s_, np.nan) for s_, how in spec]
        acc = [b_.copy() for b_ in base]
        run(acc)
        for k, (z, b_, a, (_, how)) in enumerate(zip(zeros, base, acc, spec)):
            want = b_ + z if how == A else z
            np.testing.assert_allclose(a, want, rtol=1e-12, atol=1e-12, err_msg=f"{name} grad {k} ({how})")
    same = np.zeros((N, C))
    ops.residual_add_backward(dres, dres)                  # the branch gradient may be dres itself: no-op
    ops.residual_add_backward(same, dres)
    assert np.array_equal(same, dres)


def test_grad_norm_scale_and_adamw_ops():
    rng = np.random.default_rng(5)
    gr = rng.normal(size=1001).astype(np.float32)
    parts = np.zeros(7)
    ops.grad_norm_partial(parts, gr)
    assert ops.grad_norm_final(parts) == pytest.approx(float(np.linalg.norm(gr.astype(np.float64))), rel=1e-6)
    gr[500] = np.inf
    ops.grad_norm_partial(parts, gr)
    assert not np.isfinite(ops.grad_norm_final(parts))
    ops.grad_scale(gr[:10], 0.5)
    # AdamW, one step from zero moments in float64, against the closed form
    w, g = rng.normal(size=6), rng.normal(size=6)
    w0, g0 = w.copy(), g.copy()
    m, v = np.zeros(6), np.zeros(6)
    ops.adamw(w, g, m, v, n_decay=4, t=1, lr=0.1, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.5)
    decayed = w0 * np.r_[np.full(4, 1 - 0.1 * 0.5), np.ones(2)]
    expect = decayed - 0.1 * g0 / (np.abs(g0) + 1e-8)
    np.testing.assert_allclose(w, expect, rtol=1e-10)
    np.testing.assert_allclose(m, 0.1 * g0, rtol=1e-12)
    np.testing.assert_allclose(v, 0.05 * g0 * g0, rtol=1e-12)


@pytest.mark.parametrize("slots", [[(0, 5)], [(0, 2), (2, 5)], [(0, 1), (1, 3), (3, 5)]])
def test_batch_slices_give_the_one_slice_loss_logits_and_gradients(monkeypatch, slots):
    """The engine runs its batch as slices (one per pool thread), each with its own gradient
    buffer summed after the backward: any slicing gives the same loss, logits and gradients
    (float64, to rounding), twice over the same bits, and accumulates over microbatches."""
    rng = np.random.default_rng(3)
    batches = [(rng.integers(0, MICRO.vocab_size, (5, MICRO.context)).astype(np.int32),
                rng.integers(0, MICRO.vocab_size, (5, MICRO.context)).astype(np.int32)) for _ in range(2)]

    def run(row_slots):
        monkeypatch.setattr(NumpyBackend, "row_slots", staticmethod(lambda B: list(row_slots)))
        eng = Engine(MICRO, 5, NumpyBackend(), dtype="float64")
        eng.init_weights(0)
        eng.w[:] = np.random.default_rng(1).normal(0.0, 0.3, eng.n_params)
        assert len(eng.slices) == len(row_slots)
        eng.zero_grads()
        losses = []
        for x, y in batches:                            # two microbatches: += across them
            losses.append(eng.forward(x, y))
            eng.backward(1.0 / eng.N)
        eng.forward(batches[0][0])
        return np.array(losses), eng.a["logits"].copy(), eng.g.copy()

    ref = run([(0, 5)])
    got = run(slots)
    again = run(slots)
    for r, g, a, what in zip(ref, got, again, ("losses", "logits", "grads")):
        np.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-14, err_msg=what)
        assert np.array_equal(g, a), f"{what}: two runs with the same slices differ"
    assert np.abs(ref[2]).max() > 1e-3, "vacuous: no gradient"


def test_two_threads_stepping_two_engines_at_once_get_their_own_results():
    """The pool serves one caller at a time; a second thread's engine runs its slices in
    turn on its own thread instead of waiting or mixing tasks: same results as alone."""
    import threading

    def make(seed):
        eng, x, y = _engine64(seed)
        return eng, x, y

    def grads(eng, x, y, out, key):
        for _ in range(3):
            eng.zero_grads()
            loss = eng.forward(x, y)
            eng.backward(1.0 / eng.N)
        out[key] = (loss, eng.g.copy())

    alone, both = {}, {}
    for seed in (0, 1):
        grads(*make(seed), alone, seed)
    pairs = [make(seed) for seed in (0, 1)]
    threads = [threading.Thread(target=grads, args=(*pairs[s], both, s)) for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "deadlock"
    for s in (0, 1):
        assert both[s][0] == pytest.approx(alone[s][0], rel=1e-12)
        np.testing.assert_allclose(both[s][1], alone[s][1], rtol=1e-10, atol=1e-14)
