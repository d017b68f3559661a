"""The fast CPU ops (andrea/engine/ops_cpu.py, NumpyBackend.ops) against the reference
(andrea/engine/ops_numpy.py), op by op, in float32 and float64: outputs prefilled with NaN
(each must be written), gradient accumulators prefilled with values (each must be added to).
Stated tolerance, elementwise: |fast - ref| <= TOL * max|ref| + EPS * |ref|, the first term
relative to the output's largest magnitude (a GEMM's output entries carry errors of the size of
their largest terms, not of themselves).

    pytest tests/test_ops_cpu.py
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from andrea.engine import ops_cpu as fast
from andrea.engine import ops_numpy as ref

# fp32: the kernels reassociate reductions and use their own exp (rel. error < 2e-7)
TOL = {np.float32: (1e-6, 1e-5), np.float64: (1e-14, 1e-12)}
DTYPES = [np.float32, np.float64]
SHAPES = [(64, 32), (37, 24), (1, 8)]     # (N, C): C = 24 and 8 leave a ragged vector tail


def _close(got, want, dt, what):
    tol, eps = TOL[dt]
    err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    bound = tol * np.abs(np.asarray(want, np.float64)).max(initial=0.0) + eps * np.abs(np.asarray(want, np.float64))
    assert np.isfinite(got).all(), f"{what}: not finite (an output left unwritten?)"
    worst = int(np.argmax(err - bound))
    assert (err <= bound).all(), f"{what}: |fast-ref| {err.flat[worst]:.3e} > {bound.flat[worst]:.3e}"


def _nan(shape, dt):
    return np.full(shape, np.nan, dt)


def _work(N, C, dt, V=50, T=8):
    return np.full(ref.work_elems(max(1, N // T), T, C, 2, V) + 8 * N * C, np.nan, dt)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("N,C", SHAPES)
def test_layernorm_forward_and_residual_form(dt, N, C):
    rng = np.random.default_rng(N + C)
    a, b = (rng.normal(0.5, 2.0, (N, C)).astype(dt) for _ in range(2))
    g, beta = rng.normal(1, 0.3, C).astype(dt), rng.normal(0, 0.3, C).astype(dt)
    outs = {}
    for ops in (ref, fast):
        out, mean, rstd = _nan((N, C), dt), _nan(N, dt), _nan(N, dt)
        ops.layernorm_forward(out, mean, rstd, a, g, beta)
        xo, out2, mean2, rstd2 = _nan((N, C), dt), _nan((N, C), dt), _nan(N, dt), _nan(N, dt)
        ops.residual_layernorm_forward(xo, out2, mean2, rstd2, a, b, g, beta)
        outs[ops] = (out, mean, rstd, xo, out2, mean2, rstd2)
    for i, (f, r) in enumerate(zip(outs[fast], outs[ref])):
        _close(f, r, dt, f"layernorm output {i}")
    assert np.array_equal(outs[fast][3], a + b)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("N,C", SHAPES)
@pytest.mark.parametrize("form", ["plain", "residual", "residual_inplace"])
def test_layernorm_backward(dt, N, C, form):
    rng = np.random.default_rng(N * C)
    x = rng.normal(0.5, 2.0, (N, C)).astype(dt)
    g = rng.normal(1, 0.3, C).astype(dt)
    dout = rng.normal(size=(N, C)).astype(dt)
    mean, rstd = np.empty(N, dt), np.empty(N, dt)
    ref.layernorm_forward(np.empty((N, C), dt), mean, rstd, x, g, np.zeros(C, dt))
    dx0, dg0, db0 = rng.normal(size=(N, C)).astype(dt), rng.normal(size=C).astype(dt), rng.normal(size=C).astype(dt)
    res = {}
    for ops in (ref, fast):
        dx, dg, db = dx0.copy(), dg0.copy(), db0.copy()
        if form == "plain":
            ops.layernorm_backward(dx, dg, db, dout, x, mean, rstd, g, _work(N, C, dt))
            res[ops] = (dx, dg, db)
        else:
            dbr = dx if form == "residual_inplace" else _nan((N, C), dt)
            ops.layernorm_residual_backward(dx, dbr, dg, db, dout, x, mean, rstd, g, _work(N, C, dt))
            res[ops] = (dx, dg, db, dbr)
    for i, (f, r) in enumerate(zip(res[fast], res[ref])):
        _close(f, r, dt, f"layernorm backward output {i}")


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("N,C", SHAPES)
@pytest.mark.parametrize("row_block", [1024, 16])    # 16: several row blocks, the last one ragged
def test_gelu_and_mlp_forward_backward(monkeypatch, dt, N, C, row_block):
    monkeypatch.setattr(fast, "ROW_BLOCK", row_block)
    rng = np.random.default_rng(3 * N + C)
    F = 4 * C
    x = rng.normal(0, 1.0, (N, C)).astype(dt)
    w_fc = rng.normal(0, 1.5, (C, F)).astype(dt)       # wide pre-activations: both exp tails
    w_proj = rng.normal(0, 0.2, (F, C)).astype(dt)
    dout = rng.normal(size=(N, C)).astype(dt)
    dwf0, dwp0 = rng.normal(size=(C, F)).astype(dt), rng.normal(size=(F, C)).astype(dt)
    res = {}
    for ops in (ref, fast):
        out, hp, ha = _nan((N, C), dt), _nan((N, F), dt), _nan((N, F), dt)
        ops.mlp_forward(out, hp, ha, x, w_fc, w_proj)
        g = _nan((N, F), dt)
        ops.gelu_forward(g, hp)
        dx, dwf, dwp = _nan((N, C), dt), dwf0.copy(), dwp0.copy()
        ops.mlp_backward(dx, dwf, dwp, dout, x, hp, ha, w_fc, w_proj, _work(N, C, dt))
        res[ops] = (out, hp, ha, g, dx, dwf, dwp)
    for i, (f, r) in enumerate(zip(res[fast], res[ref])):
        _close(f, r, dt, f"mlp output {i}")


@pytest.mark.parametrize("dt", DTYPES)
def test_gelu_at_the_extremes(dt):
    x = np.array([[-1e4, -200.0, -20.0, -9.5, -5.0, -1e-30, 0.0, 1e-30, 3.0, 20.0, 200.0, 1e4]], dt)
    got, want = _nan(x.shape, dt), _nan(x.shape, dt)
    fast.gelu_forward(got, x)
    ref.gelu_forward(want, x)
    _close(got, want, dt, "gelu extremes")
    y = np.array([[np.nan, np.inf]], dt)
    got = _nan(y.shape, dt)
    fast.gelu_forward(got, y)
    assert np.isnan(got[0, 0]) and got[0, 1] == np.inf


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("N,C,V", [(40, 16, 67), (9, 8, 17), (1, 8, 1)])
@pytest.mark.parametrize("row_block", [1024, 16])
def test_loss_forward_backward(monkeypatch, dt, N, C, V, row_block):
    monkeypatch.setattr(fast, "ROW_BLOCK", row_block)
    rng = np.random.default_rng(N + V)
    x = rng.normal(size=(N, C)).astype(dt)
    wte = rng.normal(0, 3.0, (V, C)).astype(dt)         # large logits: the exp's lower range
    targets = rng.integers(0, V, N).astype(np.int32)
    dwte0 = rng.normal(size=(V, C)).astype(dt)
    res = {}
    for ops in (ref, fast):
        losses, logits, probs = _nan(N, dt), _nan((N, V), dt), _nan((N, V), dt)
        ops.loss_forward(losses, logits, probs, x, wte, targets, _work(N, C, dt, V))
        fwd = (losses, logits, probs.copy())
        dx, dwte = _nan((N, C), dt), dwte0.copy()
        ops.loss_backward(dx, dwte, logits, probs, x, wte, targets, 1.0 / N, _work(N, C, dt, V))
        res[ops] = (*fwd, probs, dx, dwte)
    for i, (f, r) in enumerate(zip(res[fast], res[ref])):
        _close(f, r, dt, f"loss output {i}")
    # the dlogits step is the reference's own arithmetic: the same bits from the same probs
    p = res[ref][2].copy()
    want = p.copy()
    ref.loss_backward(_nan((N, C), dt), np.zeros((V, C), dt), None, want, x, wte, targets, 0.25, _work(N, C, dt, V))
    fast.loss_backward(_nan((N, C), dt), np.zeros((V, C), dt), None, p, x, wte, targets, 0.25, _work(N, C, dt, V))
    assert np.array_equal(p, want)


@pytest.mark.parametrize("dt", DTYPES)
def test_embed_backward_same_bits(dt):
    rng = np.random.default_rng(5)
    B, T, C, V = 3, 7, 8, 11
    idx = rng.integers(0, V, (B, T)).astype(np.int32)
    dout = rng.normal(size=(B, T, C)).astype(dt)
    dwte0, dwpe0 = rng.normal(size=(V, C)).astype(dt), rng.normal(size=(T + 2, C)).astype(dt)
    a = (dwte0.copy(), dwpe0.copy())
    b = (dwte0.copy(), dwpe0.copy())
    ref.embed_backward(*a, dout, idx)
    fast.embed_backward(*b, dout, idx)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("wd", [0.1, 0.0])
def test_adamw(dt, wd):
    rng = np.random.default_rng(6)
    n = 1001
    w0, g0 = rng.normal(size=n).astype(dt), rng.normal(size=n).astype(dt)
    m0, v0 = rng.normal(size=n).astype(dt), rng.random(n).astype(dt)
    res = {}
    for ops in (ref, fast):
        w, m, v = w0.copy(), m0.copy(), v0.copy()
        ops.adamw(w, g0.copy(), m, v, 700, 3, 1e-2, 0.9, 0.95, 1e-8, wd)
        res[ops] = (w, m, v)
    for i, (f, r) in enumerate(zip(res[fast], res[ref])):
        _close(f, r, dt, f"adamw output {i}")


def test_non_contiguous_inputs_go_to_the_reference():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(16, 12)).astype(np.float32)[:, :8]     # strided rows
    g, b = np.ones(8, np.float32), np.zeros(8, np.float32)
    got, want = _nan((16, 8), np.float32), _nan((16, 8), np.float32)
    fast.layernorm_forward(got, np.empty(16, np.float32), np.empty(16, np.float32), x, g, b)
    ref.layernorm_forward(want, np.empty(16, np.float32), np.empty(16, np.float32), x, g, b)
    assert np.array_equal(got, want)


def test_bad_shapes_and_targets_are_one_line_value_errors():
    f32 = np.float32
    x = np.zeros((4, 8), f32)
    with pytest.raises(ValueError, match=r"^layernorm_forward: g has shape \(7,\), expected \(8,\)$"):
        fast.layernorm_forward(np.zeros((4, 8), f32), np.zeros(4, f32), np.zeros(4, f32), x, np.ones(7, f32),
                               np.zeros(8, f32))
    with pytest.raises(ValueError, match=r"^mlp_backward: dw_proj has shape"):
        fast.mlp_backward(x.copy(), np.zeros((8, 32), f32), np.zeros((31, 8), f32), x, x, np.zeros((4, 32), f32),
                          np.zeros((4, 32), f32), np.zeros((8, 32), f32), np.zeros((32, 8), f32), np.zeros(4096, f32))
    with pytest.raises(ValueError, match=r"^loss_forward: targets outside \[0, 5\)$"):
        fast.loss_forward(np.zeros(4, f32), np.zeros((4, 5), f32), np.zeros((4, 5), f32), x, np.zeros((5, 8), f32),
                          np.array([0, 1, 5, 2], np.int32), np.zeros(256, f32))
    with pytest.raises(ValueError, match=r"^embed_backward: idx outside"):
        fast.embed_backward(np.zeros((5, 8), f32), np.zeros((4, 8), f32), np.zeros((1, 4, 8), f32),
                            np.array([[0, 1, 2, -1]], np.int32))


def test_every_reference_op_is_here_with_the_same_arguments():
    """ops_cpu is the whole contract: each public function of ops_numpy, sped up or re-exported."""
    for name, fn in inspect.getmembers(ref, inspect.isfunction):
        if name.startswith("_") or fn.__module__ != ref.__name__:
            continue
        mine = getattr(fast, name, None)
        assert callable(mine), f"ops_cpu has no {name}"
        assert list(inspect.signature(mine).parameters) == list(inspect.signature(fn).parameters), name


@pytest.mark.parametrize("dt", DTYPES)
def test_fused_pairs_have_the_bits_of_the_two_ops_in_turn(dt):
    """The contract's fused pairs, and gelu_forward (the recompute) against mlp_forward's h_act."""
    rng = np.random.default_rng(8)
    N, C = 33, 40
    a, b, dout = (rng.normal(size=(N, C)).astype(dt) for _ in range(3))
    g, beta = rng.normal(1, 0.3, C).astype(dt), rng.normal(0, 0.3, C).astype(dt)
    xo, o1, m1, r1 = _nan((N, C), dt), _nan((N, C), dt), _nan(N, dt), _nan(N, dt)
    fast.residual_layernorm_forward(xo, o1, m1, r1, a, b, g, beta)
    x2, o2, m2, r2 = _nan((N, C), dt), _nan((N, C), dt), _nan(N, dt), _nan(N, dt)
    fast.residual_add_forward(x2, a, b)
    fast.layernorm_forward(o2, m2, r2, x2, g, beta)
    assert all(np.array_equal(p, q) for p, q in ((xo, x2), (o1, o2), (m1, m2), (r1, r2)))

    dx1, dx2 = a.copy(), a.copy()
    dg1, dg2, db1, db2 = np.zeros(C, dt), np.zeros(C, dt), np.zeros(C, dt), np.zeros(C, dt)
    dbr = _nan((N, C), dt)
    fast.layernorm_residual_backward(dx1, dbr, dg1, db1, dout, xo, m1, r1, g, _work(N, C, dt))
    fast.layernorm_backward(dx2, dg2, db2, dout, xo, m1, r1, g, _work(N, C, dt))
    fast.residual_add_backward(dbr_ := _nan((N, C), dt), dx2)
    assert all(np.array_equal(p, q) for p, q in ((dx1, dx2), (dbr, dbr_), (dg1, dg2), (db1, db2)))

    F = 4 * C
    hp, ha, out = _nan((N, F), dt), _nan((N, F), dt), _nan((N, C), dt)
    fast.mlp_forward(out, hp, ha, a, rng.normal(size=(C, F)).astype(dt), rng.normal(size=(F, C)).astype(dt))
    again = _nan((N, F), dt)
    fast.gelu_forward(again, hp)
    assert np.array_equal(again, ha)


@pytest.mark.parametrize("op", ["layernorm", "gelu", "softmax"])
def test_a_row_has_the_same_bits_alone_or_with_others(op):
    """Rows are independent: one row's bits do not depend on the rows it is computed with (so
    neither on the thread split nor on a one-row inference call). The loss's softmax is called
    on given logits (a one-row GEMM itself may round differently: BLAS, not these kernels)."""
    rng = np.random.default_rng(9)
    N, C, V = 12, 24, 37
    x = rng.normal(size=(N, C)).astype(np.float32)
    g, beta = np.ones(C, np.float32), np.zeros(C, np.float32)
    logits = rng.normal(0, 5, (N, V)).astype(np.float32)
    t = rng.integers(0, V, N).astype(np.int32)

    def run(r0, r1):
        n = r1 - r0
        if op == "layernorm":
            out = _nan((n, C), np.float32)
            fast.layernorm_forward(out, _nan(n, np.float32), _nan(n, np.float32), x[r0:r1], g, beta)
        elif op == "gelu":
            out = _nan((n, C), np.float32)
            fast.gelu_forward(out, x[r0:r1] * 3)
        else:
            out, losses = _nan((n, V), np.float32), logits[r0:r1].max(axis=1)
            fast._softmax_xent_rows(losses, out, logits[r0:r1], t[r0:r1])
            out = np.concatenate([out, losses[:, None]], axis=1)
        return out
    whole = run(0, N)
    assert all(np.array_equal(run(i, i + 1)[0], whole[i]) for i in range(N))


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("B,T,H,D,block", [(3, 16, 2, 4, 64), (2, 13, 3, 8, 5), (2, 8, 1, 4, 1), (2, 37, 2, 4, 32),
                                            (2, 20, 2, 2, 8)])
def test_attention_forward_backward(monkeypatch, dt, B, T, H, D, block):
    """Causal blocks of ``block`` queries (5 < T: ragged, the blocks above the diagonal skipped);
    T = 37 crosses the softmax kernels' 16-query runs (ops_cpu._QALIGN) with a ragged last run;
    D = 2 leaves too little scratch for attn_backward's padded dP rows (ops_cpu._ATT_PAD): unpadded."""
    monkeypatch.setattr(ref, "ATT_BLOCK", block)
    rng = np.random.default_rng(B * T + H)
    C = H * D
    qkv = rng.normal(0, 1.5, (B, T, 3 * C)).astype(dt)
    dout = rng.normal(size=(B, T, C)).astype(dt)
    mask = np.triu(np.full((T, T), -np.inf, dt), k=1)
    work = np.full(ref.work_elems(B, T, C, H, 7), np.nan, dt)
    res = {}
    for ops in (ref, fast):
        out, att = _nan((B, T, C), dt), _nan(ref.att_shape(B, H, T), dt)
        ops.attn_forward(out, att, qkv, mask, H, work)
        dqkv = _nan((B, T, 3 * C), dt)
        ops.attn_backward(dqkv, dout, qkv, att, out, H, work)
        res[ops] = (out, att, dqkv)
    for i, (f, r) in enumerate(zip(res[fast], res[ref])):
        _close(f, r, dt, f"attention output {i}")
    att = res[fast][1]                                   # P: exact zeros for keys after the query
    assert (att.transpose(0, 2, 3, 1)[..., np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] == 0).all()


_BITS_SCRIPT = r"""
import sys
import numpy as np
from andrea.engine import ops_cpu as f, ops_numpy as ref
rng = np.random.default_rng(0)
f32 = np.float32
N, C, V, B, T, H = 64, 128, 1281, 2, 32, 4
x, dout = rng.normal(size=(N, C)).astype(f32), rng.normal(size=(N, C)).astype(f32)
g, b = rng.normal(1, .3, C).astype(f32), rng.normal(0, .3, C).astype(f32)
w_fc, w_proj = rng.normal(0, 1, (C, 4 * C)).astype(f32), rng.normal(0, .1, (4 * C, C)).astype(f32)
wte, t = rng.normal(0, 0.27, (V, C)).astype(f32), rng.integers(0, V, N).astype(np.int32)   # logits ~ N(0, 3)
qkv, dy = rng.normal(size=(B, T, 3 * C)).astype(f32), rng.normal(size=(B, T, C)).astype(f32)
w, gr, mm, vv = (rng.random(1000).astype(f32) for _ in range(4))
work = np.zeros(1 << 20, f32)
out = {}


def ln():
    o, m, r = np.empty((N, C), f32), np.empty(N, f32), np.empty(N, f32)
    f.residual_layernorm_forward(np.empty((N, C), f32), o, m, r, x, dout, g, b)
    dx, dg, db = np.zeros((N, C), f32), np.zeros(C, f32), np.zeros(C, f32)
    f.layernorm_backward(dx, dg, db, dout, x, m, r, g, work)
    out.update(ln=o, mean=m, rstd=r, dx=dx, dg=dg, db=db)


def mlp():
    hp, ha, y = np.empty((N, 4 * C), f32), np.empty((N, 4 * C), f32), np.empty((N, C), f32)
    f.mlp_forward(y, hp, ha, x, w_fc, w_proj)
    dxm, dwf, dwp = np.empty((N, C), f32), np.zeros((C, 4 * C), f32), np.zeros((4 * C, C), f32)
    f.mlp_backward(dxm, dwf, dwp, dout, x, hp, ha, w_fc, w_proj, work)
    out.update(ha=ha, y=y, dxm=dxm, dwf=dwf, dwp=dwp)


def loss():
    ls, lg, pr = np.empty(N, f32), np.empty((N, V), f32), np.empty((N, V), f32)
    f.loss_forward(ls, lg, pr, x, wte, t, work)
    out.update(losses=ls, probs=pr.copy())


def attn():
    ao, att = np.empty((B, T, C), f32), np.empty(ref.att_shape(B, H, T), f32)
    f.attn_forward(ao, att, qkv, np.triu(np.full((T, T), -np.inf, f32), 1), H, work)
    dq = np.empty((B, T, 3 * C), f32)
    f.attn_backward(dq, dy, qkv, att, ao, H, work)
    out.update(attn=ao, att=att, dqkv=dq)


def adamw():
    f.adamw(w, gr, mm, vv, 600, 3, 1e-3, .9, .95, 1e-8, .1)
    out.update(w=w, m=mm, v=vv)


for name in sys.argv[2].split(","):     # the first call of each op compiles it (or loads it)
    globals()[name]()
np.savez(sys.argv[1], **out)
"""


def test_compiled_in_process_or_loaded_from_the_cache_and_in_any_order_the_same_bits(tmp_path):
    """Each kernel is compiled in the first process that calls it (an empty Numba cache) in the
    order the ops are first called, or loaded from the cache: the same bits every way. (With a
    reassociation flag they were not: the loss softmax compiled first rounded one ulp apart.)"""
    import os
    import subprocess
    import sys

    script = tmp_path / "bits.py"
    script.write_text(_BITS_SCRIPT)
    runs = {"loss_first": ("a", "loss,ln,mlp,attn,adamw"), "cached": ("a", "ln,mlp,attn,adamw,loss"),
            "ln_first": ("b", "ln,mlp,attn,adamw,loss")}
    for name, (cache, order) in runs.items():
        env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / cache), OPENBLAS_NUM_THREADS="1")
        subprocess.run([sys.executable, str(script), str(tmp_path / name), order], env=env, check=True)
    first = np.load(tmp_path / "loss_first.npz")
    for name in ("cached", "ln_first"):
        other = np.load(tmp_path / f"{name}.npz")
        assert sorted(first.files) == sorted(other.files)
        differ = [k for k in first.files if not np.array_equal(first[k], other[k])]
        assert not differ, f"{name}: the bits of {differ} differ from a fresh compile with the loss first"
