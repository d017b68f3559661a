"""Fast CPU op pairs: the ops of ``ops_numpy.py`` whose element-wise and per-row work is
compiled by Numba into one pass over each row, the rest re-exported from it unchanged. This
module is ``NumpyBackend.ops``; ``ops_numpy`` stays the readable reference it is tested against.

    from andrea.engine import ops_cpu as ops      # same names, arguments and =/+= contract
    pytest tests/test_ops_cpu.py                   # every op here against ops_numpy, fp32 + fp64

Why: at the tiny shapes (C = 128) NumPy runs every element-wise step as its own pass over the
activations (a LayerNorm is ~12 passes, a broadcast costs 3-5 plain ones), and in the engine
every pass streams from L3. Here each row is read once into L1 and every step happens there.

Conventions beyond the ops_numpy contract:
- The kernels are compiled on first use, per dtype, and cached on disk (``cache=True``: the
  ``__pycache__`` beside this file, else Numba's user cache), so a new process loads them.
- fp32 ``exp`` is this module's own (``_exp_parts``: a range reduction and a degree-7 polynomial,
  2^n built in an int32 scratch row, relative error < 2e-7) because LLVM vectorizes it and the
  libm call it would otherwise make is scalar; fp64 calls ``np.exp`` (the gradient checks).
- Fast-math is only FMA contraction (and no signed-zero care): no reassociation, so every sum
  has the order its source spells (row sums in 8 explicit lanes, ``_sum8``); the bits differ
  from ops_numpy's within the tests' stated tolerances; NaN and inf propagate. Same inputs ->
  same bits on every run, compiled in the process or loaded from the cache (on one machine:
  like OpenBLAS's, the code follows the CPU's vector ISA); a row's result does not depend on which rows
  it is computed with, so the thread split changes nothing; column sums over rows (LayerNorm
  dg/db) run in row order on one thread. Each fused pair runs the plain op's compiled loop, so
  it has the two ops' bits as the contract asks.
- The attention keeps ops_numpy's causal blocks and BLAS products but reads q, k, v as strided
  views of qkv and writes its outputs straight into their heads; only q^T (forward) and dy^T
  (backward) are copied, contiguous, for the key-major score products (k q^T, v dy^T): as strided
  transposed views OpenBLAS ran those ~1.7x slower. Its softmax kernels skip the masked half.
- Inputs the kernels do not take (a non-contiguous or read-only view, mixed dtypes) go to the
  ops_numpy op itself. Shapes are checked before any kernel runs: a mismatch is a one-line ValueError.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from andrea.engine import ops_numpy as ref
from andrea.engine.ops_numpy import (  # noqa: F401 - re-exported: the ops this module does not speed up
    GELU_A, GELU_K, LN_EPS, MAX_THREADS, att_shape, attn_out_backward,
    attn_out_forward, attn_qkv_backward, attn_qkv_forward, embed_forward, grad_norm_final,
    grad_norm_partial, grad_scale, n_threads, residual_add_backward, residual_add_forward, row_ranges,
    run_parallel, split_batch, work_elems)

# contract: FMAs; nsz: no signed-zero care. No reassoc (nor arcp/afn): a reassociation flag lets
# LLVM's backend reorder sums by its scheduling model, and the code compiled in-process and the
# code loaded from the cache then rounded differently (the loss softmax did: one ulp); the row
# sums run as 8 independent chains instead (_sum8, _dot8). No nnan/ninf.
_JIT = dict(nogil=True, cache=True, error_model="numpy", fastmath={"contract", "nsz"})
# Rows per GEMM -> kernel -> GEMM chain in the MLP and the loss. 1024 = a whole tiny batch slice:
# 256-row blocks (the chain's intermediates in L2) measured 2.8% slower per step (paired, 30
# repeats, 1 thread): smaller GEMMs that re-pack the weights per block.
ROW_BLOCK = 1024
# attn_backward's dP scratch pads each head's run of queries in a key row by _ATT_PAD floats: rows
# H T floats apart (2 KiB at the tiny shapes) fall into a few cache sets (a few % of the op)
_ATT_PAD = 16

LOG2E = 1.4426950408889634
LN2_HI = 0.693359375            # ln 2 split so n * LN2_HI is exact for |n| < 2^11
LN2_LO = -2.12194440054690583e-4
# An index at a run offset, i + j0, is cast to this unsigned type: Numba wraps a signed index
# that may be negative (a select per access), which keeps LLVM from vectorizing the loop.
_U = np.uint64


def _fast(*arrays) -> bool:
    """The kernels take writeable C-contiguous arrays of one float dtype (fp32 or fp64): one
    compiled signature per dtype, so each op has one set of bits."""
    dt = arrays[0].dtype
    return dt in (np.float32, np.float64) and all(
        a.dtype == dt and a.flags.c_contiguous and a.flags.writeable for a in arrays)


def _shape(op: str, name: str, a: np.ndarray, want: tuple) -> None:
    if a.shape != tuple(want):
        raise ValueError(f"{op}: {name} has shape {a.shape}, expected {tuple(want)}")


# ------------------------------------------------------------------------ kernels
@numba.njit(**_JIT)
def _exp_parts(t):
    """exp(t) of an fp32 t as (p, bits) with exp(t) = p * 2^n and bits the fp32 bit pattern of
    2^n: n = round(t log2 e), p = a degree-7 polynomial in t - n ln 2; t is clamped to [-87, 88]
    first, so 2^n stays a normal float (exp(-87) ~ 1.6e-38, exp(88) ~ 1.7e38)."""
    t = t if t > np.float32(-87.0) else np.float32(-87.0)
    t = t if t < np.float32(88.0) else np.float32(88.0)
    n = np.floor(t * np.float32(LOG2E) + np.float32(0.5))
    f = t - n * np.float32(LN2_HI) - n * np.float32(LN2_LO)
    p = np.float32(1.9875691500e-4)
    p = p * f + np.float32(1.3981999507e-3)
    p = p * f + np.float32(8.3334519073e-3)
    p = p * f + np.float32(4.1665795894e-2)
    p = p * f + np.float32(1.6666665459e-1)
    p = p * f + np.float32(5.0000001201e-1)
    return p * f * f + f + np.float32(1.0), (np.int32(n) + np.int32(127)) << 23


@numba.njit(**_JIT)
def _exp_row_parts(v, scr):
    """exp(v[j]) = v[j] * scr[j] on return, for the 1-D v and a scratch row scr of v's dtype,
    >= len(v): fp32 writes the polynomial into v and 2^n into scr (the caller's own loop then
    takes the product: one pass fewer); fp64 writes np.exp into v and 1 into scr."""
    F = v.shape[0]
    if v.itemsize != 4:
        for j in range(F):
            v[j] = np.exp(v[j])
            scr[j] = v.dtype.type(1.0)
        return
    si = scr[:F].view(np.int32)
    for j in range(F):
        v[j], si[j] = _exp_parts(v[j])


@numba.njit(**_JIT)
def _exp_shift_sum(dst, src, shift, scr):
    """dst[j] = exp(src[j] - shift) for the 1-D src and a distinct dst (an in-place call would
    fail LLVM's overlap check and run scalar: use _exp_row_parts); returns sum(dst) (_sum8)."""
    F = src.shape[0]
    if src.itemsize != 4:
        for j in range(F):
            dst[j] = np.exp(src[j] - shift)
        return _sum8(dst[:F])
    si = scr[:F].view(np.int32)
    for j in range(F):
        dst[j], si[j] = _exp_parts(src[j] - shift)
    sf = scr[:F]
    for j in range(F):
        dst[j] *= sf[j]
    return _sum8(dst[:F])


@numba.njit(**_JIT)
def _sum8(v):
    """sum(v) of a 1-D v in 8 interleaved partial sums, combined pairwise: one fixed order, and
    8 independent chains the core runs side by side. They stay scalar: Numba leaves LLVM's SLP
    vectorizer off (NUMBA_SLP_VECTORIZE), and with it on the engine's bits were the same and its
    step no faster (docs/bench/s45.md)."""
    F = v.shape[0]
    dt = v.dtype.type
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = dt(0.0)
    j = 0
    while j + 8 <= F:
        s0 += v[j]
        s1 += v[j + 1]
        s2 += v[j + 2]
        s3 += v[j + 3]
        s4 += v[j + 4]
        s5 += v[j + 5]
        s6 += v[j + 6]
        s7 += v[j + 7]
        j += 8
    t = dt(0.0)
    while j < F:
        t += v[j]
        j += 1
    return (((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))) + t


@numba.njit(**_JIT)
def _dot8(u, v):
    """sum(u * v) of two 1-D arrays in the lanes of _sum8."""
    F = v.shape[0]
    dt = v.dtype.type
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = dt(0.0)
    j = 0
    while j + 8 <= F:
        s0 += u[j] * v[j]
        s1 += u[j + 1] * v[j + 1]
        s2 += u[j + 2] * v[j + 2]
        s3 += u[j + 3] * v[j + 3]
        s4 += u[j + 4] * v[j + 4]
        s5 += u[j + 5] * v[j + 5]
        s6 += u[j + 6] * v[j + 6]
        s7 += u[j + 7] * v[j + 7]
        j += 8
    t = dt(0.0)
    while j < F:
        t += u[j] * v[j]
        j += 1
    return (((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))) + t


@numba.njit(**_JIT)
def _ln_fwd_rows(x, out, mean, rstd, a, b, g, beta, add):
    """LayerNorm of each row of x; with add, x = a + b is written first, row by row. Both forms
    run this one compiled loop over x, so the fused op has the plain op's bits."""
    N, C = x.shape
    dt = x.dtype.type
    inv = dt(1.0 / C)
    for r in range(N):
        if add:
            for c in range(C):
                x[r, c] = a[r, c] + b[r, c]
        mu = _sum8(x[r]) * inv
        o = out[r]
        for c in range(C):
            o[c] = x[r, c] - mu
        rs = dt(1.0) / np.sqrt(_dot8(o, o) * inv + dt(LN_EPS))
        for c in range(C):
            o[c] = o[c] * rs * g[c] + beta[c]
        mean[r] = mu
        rstd[r] = rs


@numba.njit(**_JIT)
def _ln_bwd_rows(dx, dbranch, dg, db, dout, x, mean, rstd, g, acc, branch):
    """dx += rstd (dxhat - a - xhat c); dg += sum_rows(dout xhat); db += sum_rows(dout), rows
    in order (acc (2, C) holds the column sums); dbranch = dx when branch."""
    N, C = x.shape
    dt = x.dtype.type
    inv = dt(1.0 / C)
    xh = np.empty(C, x.dtype)
    dxh = np.empty(C, x.dtype)
    for c in range(C):
        acc[0, c] = dt(0.0)
        acc[1, c] = dt(0.0)
    for r in range(N):
        mu, rs = mean[r], rstd[r]
        for c in range(C):
            xh[c] = (x[r, c] - mu) * rs
            do = dout[r, c]
            dxh[c] = do * g[c]
            acc[0, c] += do * xh[c]
            acc[1, c] += do
        ka = _sum8(dxh) * rs * inv          # rstd * mean(dxhat)
        kc = _dot8(dxh, xh) * rs * inv     # rstd * mean(dxhat * xhat)
        for c in range(C):
            dx[r, c] += dxh[c] * rs - xh[c] * kc - ka
        if branch:                          # a copy after the loop: the plain op's bits
            for c in range(C):
                dbranch[r, c] = dx[r, c]
    for c in range(C):
        dg[c] += acc[0, c]
        db[c] += acc[1, c]


@numba.njit(**_JIT)
def _gelu_rows(out, x):
    """out = x / (1 + exp(-2 k (x + a x^3))) = gelu_tanh(x), row by row."""
    N, F = x.shape
    dt = x.dtype.type
    scr = np.empty(F, x.dtype)
    c1 = dt(-2.0 * GELU_K)
    c3 = dt(-2.0 * GELU_K * GELU_A)
    for r in range(N):
        o = out[r]
        for j in range(F):
            u = x[r, j]
            o[j] = u * (c1 + c3 * u * u)
        _exp_row_parts(o, scr)
        for j in range(F):
            o[j] = x[r, j] / (dt(1.0) + o[j] * scr[j])


@numba.njit(**_JIT)
def _gelu_bwd_rows(dh, h_pre, h_act, tiny):
    """dh *= gelu'(u), u = h_pre, with s = h_act / u = sigmoid(2v) (1/2 where |u| < tiny) and
    r = u (2k + 6ka u^2): gelu'(u) = s (1 + r (1 - s))."""
    N, F = dh.shape
    dt = dh.dtype.type
    k1 = dt(2.0 * GELU_K)
    k3 = dt(6.0 * GELU_K * GELU_A)
    for r in range(N):
        for j in range(F):
            u = h_pre[r, j]
            s = h_act[r, j] / u if abs(u) >= tiny else dt(0.5)
            rr = u * (k1 + k3 * u * u)
            dh[r, j] *= s * (dt(1.0) + rr * (dt(1.0) - s))


@numba.njit(**_JIT)
def _softmax_xent_rows(losses, probs, logits, targets):
    """probs = softmax(logits) row by row; losses holds each row's max on entry (NumPy's SIMD
    max: LLVM does not vectorize a max reduction that must keep NaNs) and max + log(sum) -
    logit[target] on return."""
    N, V = logits.shape
    dt = logits.dtype.type
    scr = np.empty(V, logits.dtype)
    for r in range(N):
        m = losses[r]
        s = _exp_shift_sum(probs[r], logits[r], m, scr)
        inv = dt(1.0) / s
        pr = probs[r]
        for j in range(V):
            pr[j] *= inv
        losses[r] = m + np.log(s) - logits[r, targets[r]]


@numba.njit(**_JIT)
def _xent_grad_rows(probs, targets, dloss):
    """probs <- (probs - onehot(targets)) * dloss, row by row."""
    N, V = probs.shape
    for r in range(N):
        t = targets[r]
        pt = probs[r, t]
        for j in range(V):
            probs[r, j] *= dloss
        probs[r, t] = (pt - probs.dtype.type(1.0)) * dloss


# The attention softmax kernels skip the masked half: along one key row k and head, the queries
# q < q0 = k rounded down to a multiple of _QALIGN are never read (P and dS there are written as
# zeros), and the run q0 <= q < T is whole vectors, its entries q < k selected away as the plain
# loop over every query did (same bits: a skipped entry only ever added an exact zero or -inf).
# Their arrays are key rows (n, T, H * S): head h's T queries at columns [h S, h S + T), S >= T
# (S > T: padded rows, _ATT_PAD).
_QALIGN = 16


@numba.njit(**_JIT)
def _attn_softmax(a3, mt, H, scale):
    """a3 (n, T, H * S) key-major products s[b, k, h S + q] = k . q -> P = softmax over keys k <= q
    of scale s + mask, with mt (T, H * Sm) the mask key-major per head (mt[k, h Sm + q] = mask[q, k]);
    P = 0 exactly for k > q, whatever a3 held there (the block products leave it unwritten).
    Each loop runs along the queries of one key row and head (``_QALIGN``), so the reductions
    over keys are element-wise, in key order."""
    n, T, W = a3.shape
    S, Sm = W // H, mt.shape[1] // H
    dt = a3.dtype.type
    ninf = dt(-np.inf)
    mx = np.empty(W, a3.dtype)
    sm = np.empty(W, a3.dtype)
    scr = np.empty(T, a3.dtype)
    si = scr.view(np.int32)
    for b in range(n):
        for j in range(W):
            mx[j] = ninf
            sm[j] = dt(0.0)
        for k in range(T):                           # per query, the max over its keys
            row, mk = a3[b, k], mt[k]
            q0 = k - k % _QALIGN
            F, lo = _U(T - q0), _U(k - q0)           # the run's length and its first q >= k
            for h in range(H):
                j0, jm = _U(h * S + q0), _U(h * Sm + q0)
                for j in range(F):
                    v = row[j0 + j] * scale + mk[jm + j] if j >= lo else ninf
                    mx[j0 + j] = v if v > mx[j0 + j] else mx[j0 + j]
        for k in range(T):                           # exp and the key sums
            row, mk = a3[b, k], mt[k]
            q0 = k - k % _QALIGN
            F, lo = _U(T - q0), _U(k - q0)
            for h in range(H):
                jz, j0, jm = _U(h * S), _U(h * S + q0), _U(h * Sm + q0)
                for j in range(_U(q0)):
                    row[jz + j] = dt(0.0)
                for j in range(F):
                    row[j0 + j] = row[j0 + j] * scale + mk[jm + j] - mx[j0 + j]
                if a3.itemsize != 4:                 # exp: as _exp_row_parts, inline (a call runs slower)
                    for j in range(F):
                        row[j0 + j] = np.exp(row[j0 + j])
                        scr[j] = dt(1.0)
                else:
                    for j in range(F):
                        row[j0 + j], si[j] = _exp_parts(row[j0 + j])
                for j in range(F):
                    p = row[j0 + j] * scr[j] if j >= lo else dt(0.0)
                    row[j0 + j] = p
                    sm[j0 + j] += p
        for h in range(H):
            j0 = _U(h * S)
            for j in range(_U(T)):
                sm[j0 + j] = dt(1.0) / sm[j0 + j]
        for k in range(T):
            row = a3[b, k]
            q0 = k - k % _QALIGN
            F = _U(T - q0)
            for h in range(H):
                j0 = _U(h * S + q0)
                for j in range(F):
                    row[j0 + j] *= sm[j0 + j]


@numba.njit(**_JIT)
def _attn_softmax_bwd(d3, p3, H, scale):
    """d3 (n, T, H * Sd) key-major dL/dP -> dS * scale, dS = P (dP - sum_keys(dP P)), with p3
    (n, T, H * Sp) the saved P, for keys k <= q and 0 for k > q (whatever d3 held there), along
    the queries of each key row and head as _attn_softmax."""
    n, T, Wd = d3.shape
    Sd, Sp = Wd // H, p3.shape[2] // H
    dt = p3.dtype.type
    rd = np.empty(H * T, p3.dtype)
    for b in range(n):
        for j in range(H * T):
            rd[j] = dt(0.0)
        for k in range(T):
            d, p = d3[b, k], p3[b, k]
            q0 = k - k % _QALIGN
            F, lo = _U(T - q0), _U(k - q0)
            for h in range(H):
                jd, jp, jr = _U(h * Sd + q0), _U(h * Sp + q0), _U(h * T + q0)
                for j in range(F):
                    rd[jr + j] += d[jd + j] * p[jp + j] if j >= lo else dt(0.0)
        for k in range(T):
            d, p = d3[b, k], p3[b, k]
            q0 = k - k % _QALIGN
            F, lo = _U(T - q0), _U(k - q0)
            for h in range(H):
                jz, jd, jp, jr = _U(h * Sd), _U(h * Sd + q0), _U(h * Sp + q0), _U(h * T + q0)
                for j in range(_U(q0)):
                    d[jz + j] = dt(0.0)
                for j in range(F):
                    d[jd + j] = p[jp + j] * (d[jd + j] - rd[jr + j]) * scale if j >= lo else dt(0.0)


@numba.njit(**_JIT)
def _adamw_range(w, g, m, v, i0, i1, n_decay, decay, b1, b2, c1, c2, sbc2, eps, step):
    """AdamW on elements [i0, i1): w *= decay below n_decay; m = b1 m + c1 g;
    v = b2 v + c2 g^2; w -= step * m / (sqrt(v) * sbc2 + eps)."""
    wd = w[i0:max(i0, min(i1, n_decay))]         # local views, loops from 0: these vectorize
    for i in range(wd.shape[0]):
        wd[i] *= decay
    w, g, m, v = w[i0:i1], g[i0:i1], m[i0:i1], v[i0:i1]
    for i in range(w.shape[0]):
        gi = g[i]
        mi = b1 * m[i] + c1 * gi
        vi = b2 * v[i] + c2 * gi * gi
        m[i] = mi
        v[i] = vi
        w[i] -= step * mi / (np.sqrt(vi) * sbc2 + eps)


@numba.njit(**_JIT)
def _embed_bwd(dwte, dwpe, dout, idx):
    """dwte[idx[b, t]] += dout[b, t]; dwpe[t] += dout[b, t]; b then t in order."""
    B, T, C = dout.shape
    for b in range(B):
        for t in range(T):
            i = idx[b, t]
            for c in range(C):
                dwte[i, c] += dout[b, t, c]
    for b in range(B):
        for t in range(T):
            for c in range(C):
                dwpe[t, c] += dout[b, t, c]


# ------------------------------------------------------------------------ the ops
def _rows2(op: str, C: int, **arrays) -> None:
    """Each named array must be (N, C) with the first one's N."""
    N = next(iter(arrays.values())).shape[0]
    for name, a in arrays.items():
        _shape(op, name, a, (N, C))


def layernorm_forward(out: np.ndarray, mean: np.ndarray, rstd: np.ndarray,
                      x: np.ndarray, g: np.ndarray, b: np.ndarray) -> None:
    """ops_numpy.layernorm_forward: out (N, C) = (x - mean) * rstd * g + b; writes mean, rstd (N,)."""
    if x.ndim != 2 or not _fast(out, mean, rstd, x, g, b):
        return ref.layernorm_forward(out, mean, rstd, x, g, b)
    N, C = x.shape
    _rows2("layernorm_forward", C, x=x, out=out)
    for name, a, want in (("mean", mean, (N,)), ("rstd", rstd, (N,)), ("g", g, (C,)), ("b", b, (C,))):
        _shape("layernorm_forward", name, a, want)
    split_batch(lambda r0, r1: _ln_fwd_rows(x[r0:r1], out[r0:r1], mean[r0:r1], rstd[r0:r1], x[r0:r1], x[r0:r1],
                                            g, b, False), N)


def residual_layernorm_forward(xo: np.ndarray, out: np.ndarray, mean: np.ndarray, rstd: np.ndarray,
                               a: np.ndarray, b: np.ndarray, g: np.ndarray, beta: np.ndarray) -> None:
    """ops_numpy.residual_layernorm_forward: xo (N, C) = a + b; out, mean, rstd = LayerNorm of xo,
    one pass per row."""
    if a.ndim != 2 or not _fast(xo, out, mean, rstd, a, b, g, beta):
        return ref.residual_layernorm_forward(xo, out, mean, rstd, a, b, g, beta)
    N, C = a.shape
    _rows2("residual_layernorm_forward", C, a=a, b=b, xo=xo, out=out)
    for name, v, want in (("mean", mean, (N,)), ("rstd", rstd, (N,)), ("g", g, (C,)), ("beta", beta, (C,))):
        _shape("residual_layernorm_forward", name, v, want)
    split_batch(lambda r0, r1: _ln_fwd_rows(xo[r0:r1], out[r0:r1], mean[r0:r1], rstd[r0:r1], a[r0:r1],
                                            b[r0:r1], g, beta, True), N)


def _ln_backward(op, dx, dbranch, dg, db, dout, x, mean, rstd, g, work) -> bool:
    """The fused LayerNorm backward on one thread, rows in order (the dg/db column sums are
    then the same whatever the thread count). False: not for the kernel, the caller falls back."""
    if x.ndim != 2 or not _fast(dx, dbranch, dg, db, dout, x, mean, rstd, g, work):
        return False
    N, C = x.shape
    _rows2(op, C, x=x, dx=dx, dout=dout, dbranch=dbranch)
    for name, v, want in (("mean", mean, (N,)), ("rstd", rstd, (N,)), ("g", g, (C,)), ("dg", dg, (C,)),
                          ("db", db, (C,))):
        _shape(op, name, v, want)
    (acc,) = ref._carve(work, (2, C))
    _ln_bwd_rows(dx, dbranch, dg, db, dout, x, mean, rstd, g, acc, dbranch is not dx)
    return True


def layernorm_backward(dx: np.ndarray, dg: np.ndarray, db: np.ndarray, dout: np.ndarray,
                       x: np.ndarray, mean: np.ndarray, rstd: np.ndarray, g: np.ndarray,
                       work: np.ndarray) -> None:
    """ops_numpy.layernorm_backward: dx (N, C) += ...; dg, db (C,) += ..., one pass per row."""
    if not _ln_backward("layernorm_backward", dx, dx, dg, db, dout, x, mean, rstd, g, work):
        ref.layernorm_backward(dx, dg, db, dout, x, mean, rstd, g, work)


def layernorm_residual_backward(dx: np.ndarray, dbranch: np.ndarray, dg: np.ndarray, db: np.ndarray,
                                dout: np.ndarray, x: np.ndarray, mean: np.ndarray, rstd: np.ndarray,
                                g: np.ndarray, work: np.ndarray) -> None:
    """ops_numpy.layernorm_residual_backward: layernorm_backward, then dbranch = dx, in the same pass."""
    if not _ln_backward("layernorm_residual_backward", dx, dbranch, dg, db, dout, x, mean, rstd, g, work):
        ref.layernorm_residual_backward(dx, dbranch, dg, db, dout, x, mean, rstd, g, work)


def gelu_forward(out: np.ndarray, x: np.ndarray) -> None:
    """ops_numpy.gelu_forward: out (N, 4C) = gelu(x)."""
    if x.ndim != 2 or not _fast(out, x):
        return ref.gelu_forward(out, x)
    _rows2("gelu_forward", x.shape[1], x=x, out=out)
    split_batch(lambda r0, r1: _gelu_rows(out[r0:r1], x[r0:r1]), x.shape[0])


def mlp_forward(out: np.ndarray, h_pre: np.ndarray, h_act: np.ndarray, x: np.ndarray,
                 w_fc: np.ndarray, w_proj: np.ndarray) -> None:
    """ops_numpy.mlp_forward: out (N, C) = gelu(x @ w_fc) @ w_proj; saves h_pre, h_act (N, 4C).
    The matmuls run on the arrays as given (a stacked (n, 1, C) view stays n one-row products)."""
    if not _fast(out, h_pre, h_act, x):
        return ref.mlp_forward(out, h_pre, h_act, x, w_fc, w_proj)
    C = x.shape[-1]
    F = w_fc.shape[1]
    lead = x.shape[:-1]
    for name, v, want in (("w_fc", w_fc, (C, F)), ("w_proj", w_proj, (F, C)), ("h_pre", h_pre, (*lead, F)),
                          ("h_act", h_act, (*lead, F)), ("out", out, x.shape)):
        _shape("mlp_forward", name, v, want)

    def part(r0: int, r1: int) -> None:
        for i0 in range(r0, r1, ROW_BLOCK):
            i1 = min(i0 + ROW_BLOCK, r1)
            np.matmul(x[i0:i1], w_fc, out=h_pre[i0:i1])
            _gelu_rows(h_act[i0:i1].reshape(-1, F), h_pre[i0:i1].reshape(-1, F))
            np.matmul(h_act[i0:i1], w_proj, out=out[i0:i1])

    split_batch(part, x.shape[0])


def mlp_backward(dx: np.ndarray, dw_fc: np.ndarray, dw_proj: np.ndarray, dout: np.ndarray,
                 x: np.ndarray, h_pre: np.ndarray, h_act: np.ndarray,
                 w_fc: np.ndarray, w_proj: np.ndarray, work: np.ndarray) -> None:
    """ops_numpy.mlp_backward: dx (N, C) = ...; dw_fc, dw_proj += ...; gelu' in one pass per row."""
    if x.ndim != 2 or not _fast(dx, dout, x, h_pre, h_act, work):
        return ref.mlp_backward(dx, dw_fc, dw_proj, dout, x, h_pre, h_act, w_fc, w_proj, work)
    N, C = x.shape
    F = w_fc.shape[1]
    for name, v, want in (("w_fc", w_fc, (C, F)), ("w_proj", w_proj, (F, C)), ("dw_fc", dw_fc, (C, F)),
                          ("dw_proj", dw_proj, (F, C))):
        _shape("mlp_backward", name, v, want)
    _rows2("mlp_backward", F, h_pre=h_pre, h_act=h_act)
    _rows2("mlp_backward", C, x=x, dx=dx, dout=dout)
    DH, TW = ref._carve(work, (N, F), (F, C))
    tiny = work.dtype.type(np.finfo(work.dtype).tiny)

    def rows(r0: int, r1: int) -> None:
        for i0 in range(r0, r1, ROW_BLOCK):
            i1 = min(i0 + ROW_BLOCK, r1)
            dh = DH[i0:i1]
            np.matmul(dout[i0:i1], w_proj.T, out=dh)       # dL/dh_act
            _gelu_bwd_rows(dh, h_pre[i0:i1], h_act[i0:i1], tiny)
            np.matmul(dh, w_fc.T, out=dx[i0:i1])

    split_batch(rows, N)
    ref._mm_acc(dw_proj, h_act.T, dout, TW)
    ref._mm_acc(dw_fc, x.T, DH, TW.reshape(C, F))


def _targets_ok(op: str, targets: np.ndarray, N: int, V: int) -> np.ndarray:
    t = targets.reshape(-1)
    if t.shape[0] != N:
        raise ValueError(f"{op}: targets has {t.shape[0]} entries, expected N = {N}")
    if N and (int(t.min()) < 0 or int(t.max()) >= V):
        raise ValueError(f"{op}: targets outside [0, {V})")
    return t


def loss_forward(losses: np.ndarray, logits: np.ndarray, probs: np.ndarray, x: np.ndarray,
                 wte: np.ndarray, targets: np.ndarray | None, work: np.ndarray) -> None:
    """ops_numpy.loss_forward: logits = x @ wte.T; probs = softmax(logits); losses = cross-entropy,
    the softmax and the loss in one pass per row."""
    if targets is None or not _fast(losses, logits, probs, x):
        return ref.loss_forward(losses, logits, probs, x, wte, targets, work)
    N, V = logits.shape
    C = x.shape[1]
    _shape("loss_forward", "wte", wte, (V, C))
    _shape("loss_forward", "probs", probs, (N, V))
    _shape("loss_forward", "x", x, (N, C))
    _shape("loss_forward", "losses", losses, (N,))
    t = _targets_ok("loss_forward", targets, N, V)

    def part(r0: int, r1: int) -> None:
        for i0 in range(r0, r1, ROW_BLOCK):
            i1 = min(i0 + ROW_BLOCK, r1)
            np.matmul(x[i0:i1], wte.T, out=logits[i0:i1])
            np.max(logits[i0:i1], axis=1, out=losses[i0:i1])
            _softmax_xent_rows(losses[i0:i1], probs[i0:i1], logits[i0:i1], t[i0:i1])

    split_batch(part, N)


def loss_backward(dx: np.ndarray, dwte: np.ndarray, logits: np.ndarray, probs: np.ndarray, x: np.ndarray,
                  wte: np.ndarray, targets: np.ndarray, dloss: float, work: np.ndarray) -> None:
    """ops_numpy.loss_backward: probs <- dlogits = (probs - onehot) * dloss (same bits as the
    reference), dx = dlogits @ wte, dwte += dlogits.T @ x."""
    if not _fast(dx, probs, x, work):
        return ref.loss_backward(dx, dwte, logits, probs, x, wte, targets, dloss, work)
    N, V = probs.shape
    C = x.shape[1]
    _shape("loss_backward", "wte", wte, (V, C))
    _shape("loss_backward", "dwte", dwte, (V, C))
    _shape("loss_backward", "x", x, (N, C))
    _shape("loss_backward", "dx", dx, (N, C))
    t = _targets_ok("loss_backward", targets, N, V)
    _, tw = ref._carve(work, (N, C), (V, C))
    dl = probs.dtype.type(dloss)

    def rows(r0: int, r1: int) -> None:
        for i0 in range(r0, r1, ROW_BLOCK):
            i1 = min(i0 + ROW_BLOCK, r1)
            _xent_grad_rows(probs[i0:i1], t[i0:i1], dl)
            np.matmul(probs[i0:i1], wte, out=dx[i0:i1])

    split_batch(rows, N)
    ref._mm_acc(dwte, probs.T, x, tw)


def embed_backward(dwte: np.ndarray, dwpe: np.ndarray, dout: np.ndarray, idx: np.ndarray) -> None:
    """ops_numpy.embed_backward: dwte[idx] += dout; dwpe[:T] += sum_b dout[b], in the reference's
    order (rows in index order), so the same bits; one thread."""
    if dout.ndim != 3 or not _fast(dwte, dwpe, dout):
        return ref.embed_backward(dwte, dwpe, dout, idx)
    B, T, C = dout.shape
    _shape("embed_backward", "idx", idx, (B, T))
    if dwte.ndim != 2 or dwte.shape[1] != C or dwpe.ndim != 2 or dwpe.shape[1] != C or dwpe.shape[0] < T:
        raise ValueError(f"embed_backward: dwte {dwte.shape} / dwpe {dwpe.shape} do not match dout {dout.shape}")
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= dwte.shape[0]):
        raise ValueError(f"embed_backward: idx outside [0, {dwte.shape[0]})")
    _embed_bwd(dwte, dwpe, dout, idx)


def adamw(w: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, n_decay: int, t: int,
          lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """ops_numpy.adamw in one pass per element (g is left as it was, which the contract allows)."""
    if w.ndim != 1 or not _fast(w, g, m, v):
        return ref.adamw(w, g, m, v, n_decay, t, lr, beta1, beta2, eps, weight_decay)
    n = w.shape[0]
    for name, a in (("g", g), ("m", m), ("v", v)):
        _shape("adamw", name, a, (n,))
    dt = w.dtype.type
    bc1, bc2 = 1.0 - beta1 ** t, 1.0 - beta2 ** t
    nd = int(n_decay) if weight_decay else 0
    args = (nd, dt(1.0 - lr * weight_decay), dt(beta1), dt(beta2), dt(1.0 - beta1), dt(1.0 - beta2),
            dt(1.0 / math.sqrt(bc2)), dt(eps), dt(lr / bc1))
    split_batch(lambda i0, i1: _adamw_range(w, g, m, v, i0, i1, *args), n)



def _attn_dims(op: str, x: np.ndarray, att: np.ndarray, qkv: np.ndarray, n_head: int) -> tuple:
    """(B, T, C, H, D) of an attention op whose (B, T, C) tensor is ``x``; att and qkv checked against them."""
    B, T, C = x.shape
    H = n_head
    if att.shape != att_shape(B, H, T):
        raise ValueError(f"{op}: att has shape {att.shape}, expected att_shape(B, H, T) = {att_shape(B, H, T)}")
    _shape(op, "qkv", qkv, (B, T, 3 * C))
    return B, T, C, H, C // H


def attn_forward(out: np.ndarray, att: np.ndarray, qkv: np.ndarray, mask: np.ndarray,
                 n_head: int, work: np.ndarray) -> None:
    """ops_numpy.attn_forward with the same causal blocks, but the block products read k, v as
    strided views of qkv (q^T as a contiguous copy) and write y straight into out's heads, and the
    softmax kernel takes the scale: P = softmax(scale (k . q) + mask).
    mask must be the causal one ops_numpy documents: it is added for keys k <= q, and P = 0
    exactly for k > q."""
    if out.ndim != 3 or not _fast(out, att, qkv, mask, work):
        return ref.attn_forward(out, att, qkv, mask, n_head, work)
    B, T, C, H, D = _attn_dims("attn_forward", out, att, qkv, n_head)
    if mask.ndim != 2 or mask.shape[0] < T or mask.shape[1] < T:
        raise ValueError(f"attn_forward: mask has shape {mask.shape}, expected at least ({T}, {T})")
    MT, QT = ref._carve(work, (T, H, T), (B, H, D, T))
    np.copyto(MT, mask[:T, :T].T[:, None, :])          # the mask key-major, once per head
    blocks = ref._causal_blocks(T)
    scale = out.dtype.type(1.0 / math.sqrt(D))

    def part(b0: int, b1: int) -> None:
        n = b1 - b0
        q, k, v = ref._heads(qkv[b0:b1], n, T, H)      # (n, H, T, D) views
        qt = QT[b0:b1]                                 # q^T (n, H, D, T), contiguous (the NN product is ~2x faster)
        np.copyto(qt, q.swapaxes(-1, -2))
        y = out[b0:b1].reshape(n, T, H, D).transpose(0, 2, 1, 3)
        a4 = att[b0:b1]                                # (n, keys, H, queries)
        s4 = a4.transpose(0, 2, 1, 3)                  # (n, H, keys, queries)
        for i0, i1 in blocks:                          # queries [i0, i1) see keys [0, i1)
            np.matmul(k[:, :, :i1], qt[:, :, :, i0:i1], out=s4[:, :, :i1, i0:i1])
        _attn_softmax(a4.reshape(n, T, H * T), MT.reshape(T, H * T), H, scale)
        p4 = a4.transpose(0, 2, 3, 1)                  # (n, H, queries, keys)
        for i0, i1 in blocks:
            np.matmul(p4[:, :, i0:i1, :i1], v[:, :, :i1], out=y[:, :, i0:i1])

    split_batch(part, B)


def attn_backward(dqkv: np.ndarray, dout: np.ndarray, qkv: np.ndarray, att: np.ndarray, y: np.ndarray,
                  n_head: int, work: np.ndarray) -> None:
    """ops_numpy.attn_backward with the same causal blocks; the products read q, k, v, dout as
    strided views (dout^T as a contiguous copy) and write dq, dk, dv straight into dqkv's heads;
    the softmax backward kernel writes ds * scale, the factor both dq = ds k scale and dk = ds^T q scale need."""
    if dout.ndim != 3 or not _fast(dqkv, dout, qkv, att, work):
        return ref.attn_backward(dqkv, dout, qkv, att, y, n_head, work)
    B, T, C, H, D = _attn_dims("attn_backward", dout, att, qkv, n_head)
    _shape("attn_backward", "dqkv", dqkv, (B, T, 3 * C))
    # dP rows padded (_ATT_PAD) where the scratch allows
    pad = _ATT_PAD if work.size >= B * T * H * (T + _ATT_PAD) + B * H * D * T else 0
    DATTP, DYT = ref._carve(work, (B, T, H, T + pad), (B, H, D, T))
    DATT = DATTP[..., :T]
    blocks = ref._causal_blocks(T)
    scale = dout.dtype.type(1.0 / math.sqrt(D))

    def part(b0: int, b1: int) -> None:
        n = b1 - b0
        q, k, v = ref._heads(qkv[b0:b1], n, T, H)      # (n, H, T, D) views
        dq, dk, dv = ref._heads(dqkv[b0:b1], n, T, H)
        dy = dout[b0:b1].reshape(n, T, H, D).transpose(0, 2, 1, 3)
        dyt = DYT[b0:b1]                               # dy^T (n, H, D, T), contiguous as q^T forward
        np.copyto(dyt, dy.swapaxes(-1, -2))
        d4, p4 = DATT[b0:b1], att[b0:b1]                                # (n, keys, H, queries)
        pkq, dkq = p4.transpose(0, 2, 1, 3), d4.transpose(0, 2, 1, 3)   # (n, H, keys, queries)
        dqk = d4.transpose(0, 2, 3, 1)                                  # (n, H, queries, keys)
        for i0, i1 in blocks:                          # datt^T = v dy^T, keys [0, i1)
            np.matmul(v[:, :, :i1], dyt[:, :, :, i0:i1], out=dkq[:, :, :i1, i0:i1])
        for j0, j1 in blocks:                          # dv = P^T dy, queries [j0, T)
            np.matmul(pkq[:, :, j0:j1, j0:], dy[:, :, j0:], out=dv[:, :, j0:j1])
        _attn_softmax_bwd(DATTP[b0:b1].reshape(n, T, -1), p4.reshape(n, T, H * T), H, scale)  # d4 = ds^T scale
        for i0, i1 in blocks:                          # dq = ds k scale, keys [0, i1)
            np.matmul(dqk[:, :, i0:i1, :i1], k[:, :, :i1], out=dq[:, :, i0:i1])
        for j0, j1 in blocks:                          # dk = ds^T q scale, queries [j0, T)
            np.matmul(dkq[:, :, j0:j1, j0:], q[:, :, j0:], out=dk[:, :, j0:j1])

    split_batch(part, B)
