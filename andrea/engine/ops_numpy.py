"""NumPy op pairs: the reference implementation of every forward/backward op of the engine.

    from andrea.engine import ops_numpy as ops
    ops.layernorm_forward(out, mean, rstd, x, g, b)        # writes out, mean, rstd
    ops.layernorm_backward(dx, dg, db, dout, x, mean, rstd, g, work)   # dx += ..., dg += ..., db += ...
    ops.layernorm_residual_backward(dx, dbranch, dg, db, dout, x, mean, rstd, g, work)   # ... then dbranch = dx

This module is the contract the CuPy backends (``andrea/cuda``) mirror name for name and
argument for argument; the model (``andrea/engine/recipe.py``) calls only these functions,
so the model is written once and each backend supplies the ops.

Conventions (every op):
- Shapes: B batch, T context, C d_model, H heads, D = C // H head size, V vocab,
  N = B * T rows. Activations are row-major ``(N, C)`` (the same memory as ``(B, T, C)``).
  Weight matrices are stored ``(C_in, C_out)`` so a linear layer is ``y = x @ W``.
- Forward functions write (``=``) into preallocated outputs; they never allocate
  anything the size of an activation.
- Backward functions ADD (``+=``) into parameter gradients (the caller zeroes them,
  ``Engine.zero_grads``) and into the residual stream's gradient (``layernorm_backward``'s
  ``dx``); every other input gradient they WRITE (``=``), so no activation-gradient buffer
  needs zeroing (``residual_add_backward`` copies the stream's gradient to the branch).
- ``work`` is a flat scratch buffer of the activations' dtype owned by the caller, at
  least ``work_elems(B, T, C, H, V)`` long; ops carve views from it and leave garbage in
  it. ``adamw`` takes no work buffer: it consumes its ``g`` as scratch.
- Every op is dtype-generic (float32 in training, float64 in the gradient checks).
- Determinism: no op depends on anything but its arguments: same inputs -> same bits, whatever
  the thread count (element-wise splits give the same bits; reductions keep a fixed order;
  tests/test_thread_bits.py trains at 1, 2 and 3 threads).
- Fused pairs: ``residual_layernorm_forward`` is ``residual_add_forward`` then ``layernorm_forward``
  of its sum, and ``layernorm_residual_backward`` is ``layernorm_backward`` then
  ``residual_add_backward`` of the updated stream gradient: the same bits as the two ops in turn
  (a backend may run each as one kernel, reading the rows once).

(Over 500 lines on purpose: the op pairs are one contract, read and mirrored as a whole; the
thread pool they split rows on is ``andrea/engine/pool.py``.)
"""

from __future__ import annotations

import math

import numpy as np

from andrea.engine.pool import MAX_THREADS, n_threads, row_ranges, run_parallel, split_batch  # noqa: F401

GELU_K = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715
LN_EPS = 1e-5


def _carve(work: np.ndarray, *shapes: tuple[int, ...]) -> list[np.ndarray]:
    """Consecutive views of ``work`` with the given shapes (no copy)."""
    views, off = [], 0
    for shape in shapes:
        n = math.prod(shape)
        if off + n > work.size:
            raise ValueError(f"work buffer too small: need {off + n} elements, have {work.size}")
        views.append(work[off:off + n].reshape(shape))
        off += n
    return views


def work_elems(B: int, T: int, C: int, H: int, V: int) -> int:
    """Scratch elements the largest op needs (the engine allocates ``work`` once with this size)."""
    N = B * T
    return max(
        2 * N * C + 2 * N + 2 * MAX_THREADS * C,  # layernorm_backward: xhat, dxhat, two row stats, partials
        N * 4 * C + 4 * C * C,                 # linear backward (attn_qkv: 3C, mlp in/out: 4C)
        4 * N * C + B * H * T + H * T * T,     # attn_forward: q, k, v, y (B, H, T, D), stat (B, H*T), mask (T, H*T)
        5 * N * C + B * H * T * T + B * H * T,  # attn_backward: q, k, v, dy, tmp, datt, row dot
        3 * N * 4 * C + N * C + 1,             # mlp_backward: dh, s, r, a bool mask
        N * 4 * C + 4 * C * C,                 # mlp_backward: dh, then a weight-grad tmp over s and r
        N * C + V * C + N,                     # loss_backward: dx tmp, dwte tmp, row index
        N,                                     # loss_forward: row sums
    )


# --------------------------------------------------------------------------- embed
def embed_forward(out: np.ndarray, idx: np.ndarray, wte: np.ndarray, wpe: np.ndarray) -> None:
    """out (B, T, C) = wte[idx] + wpe[:T].  idx int32 (B, T) in [0, V); wte (V, C); wpe (context, C).

    (mode="clip": NumPy's default "raise" mode buffers the whole output; ids are range-checked
    where shards are written and loaded.)"""
    B, T = idx.shape
    np.take(wte, idx, axis=0, out=out, mode="clip")
    out += wpe[:T]


def embed_backward(dwte: np.ndarray, dwpe: np.ndarray, dout: np.ndarray, idx: np.ndarray) -> None:
    """dwte[idx] += dout; dwpe[:T] += sum_b dout[b].  dout (B, T, C).

    Column by column: np.add.at on 1-D operands takes NumPy's fast path (2.3x faster than
    one 2-D call at C = 128); each column adds its rows in index order, so the bits are fixed."""
    B, T = idx.shape
    flat, rows = idx.reshape(-1), dout.reshape(B * T, -1)
    for c in range(dwte.shape[1]):
        np.add.at(dwte[:, c], flat, rows[:, c])
    for b in range(B):
        dwpe[:T] += dout[b]


# ----------------------------------------------------------------------- layernorm
_ONES: dict = {}


def _ones(n: int, dtype) -> np.ndarray:
    """A read-only vector of n ones: row sums and column sums as one BLAS gemv each (NumPy's
    own reductions pay a fixed cost per row, which dominates for C = 128). Cached per dtype,
    grown to the largest n asked for, so a step allocates nothing once warm."""
    dtype = np.dtype(dtype)
    have = _ONES.get(dtype)
    if have is None or have.size < n:
        have = np.ones(max(n, 1024), dtype)
        have.flags.writeable = False
        if _ONES.get(dtype) is None or _ONES[dtype].size < have.size:   # two threads may race here
            _ONES[dtype] = have
    return have[:n]


def layernorm_forward(out: np.ndarray, mean: np.ndarray, rstd: np.ndarray,
                      x: np.ndarray, g: np.ndarray, b: np.ndarray) -> None:
    """out (N, C) = (x - mean) * rstd * g + b; saves mean (N,), rstd (N,) for the backward.

    Biased variance, eps = 1e-5 (as torch.nn.LayerNorm).
    """
    C = x.shape[-1]
    ones = _ones(C, x.dtype)

    def part(r0: int, r1: int) -> None:                # rows are independent
        o, mu, rs = out[r0:r1], mean[r0:r1], rstd[r0:r1]
        np.matmul(x[r0:r1], ones, out=mu)
        mu *= 1.0 / C
        np.subtract(x[r0:r1], mu[:, None], out=o)
        np.einsum("ij,ij->i", o, o, out=rs)            # sum of squares
        rs *= 1.0 / C
        rs += LN_EPS
        np.sqrt(rs, out=rs)
        np.reciprocal(rs, out=rs)
        o *= rs[:, None]
        o *= g
        o += b

    split_batch(part, x.shape[0])


def layernorm_backward(dx: np.ndarray, dg: np.ndarray, db: np.ndarray, dout: np.ndarray,
                       x: np.ndarray, mean: np.ndarray, rstd: np.ndarray, g: np.ndarray,
                       work: np.ndarray) -> None:
    """dx (N, C) += ...; dg (C,) += sum(dout * xhat); db (C,) += sum(dout).

    With xhat = (x - mean) * rstd, dxhat = dout * g, a = mean(dxhat), c = mean(dxhat * xhat)
    (row means): dx = rstd * (dxhat - a - xhat * c).
    """
    N, C = x.shape
    ranges = row_ranges(N)
    XHAT, TMP, A, CC, PART = _carve(work, (N, C), (N, C), (N,), (N,), (len(ranges), 2, C))
    ones = _ones(max(N, C), x.dtype)
    slot = {r0: i for i, (r0, _) in enumerate(ranges)}

    def part(r0: int, r1: int) -> None:
        xhat, tmp, a, c, do, rs = XHAT[r0:r1], TMP[r0:r1], A[r0:r1], CC[r0:r1], dout[r0:r1], rstd[r0:r1]
        dgb = PART[slot[r0]]
        np.subtract(x[r0:r1], mean[r0:r1, None], out=xhat)
        xhat *= rs[:, None]
        np.multiply(do, xhat, out=tmp)
        np.matmul(ones[:r1 - r0], tmp, out=dgb[0])     # this range's dg and db (column sums)
        np.matmul(ones[:r1 - r0], do, out=dgb[1])
        np.multiply(do, g, out=tmp)                    # tmp = dxhat
        np.matmul(tmp, ones[:C], out=a)                # row sums
        np.einsum("ij,ij->i", tmp, xhat, out=c)
        a *= rs                                        # a <- rstd * mean(dxhat)
        a *= 1.0 / C
        c *= rs                                        # c <- rstd * mean(dxhat * xhat)
        c *= 1.0 / C
        tmp *= rs[:, None]
        xhat *= c[:, None]
        tmp -= xhat
        tmp -= a[:, None]
        dx[r0:r1] += tmp

    split_batch(part, N)
    for i in range(len(ranges)):                       # fixed order: same bits every run
        dg += PART[i, 0]
        db += PART[i, 1]


# -------------------------------------------------------------------------- linear
def _linear_backward(dx: np.ndarray, dw: np.ndarray, dout: np.ndarray, x: np.ndarray,
                     w: np.ndarray, work: np.ndarray) -> None:
    """y = x @ w with x (N, Cin), w (Cin, Cout): dx = dout @ w.T; dw += x.T @ dout."""
    N, Cin = x.shape
    Cout = w.shape[1]
    _, tw = _carve(work, (N, Cin), (Cin, Cout))
    _mm(dx, dout, w.T)
    _mm_acc(dw, x.T, dout, tw)


# ------------------------------------------------------------------------ attn_qkv
def attn_qkv_forward(qkv: np.ndarray, x: np.ndarray, w_qkv: np.ndarray) -> None:
    """qkv (N, 3C) = x (N, C) @ w_qkv (C, 3C); columns are [q | k | v], each head-major (H, D)."""
    _mm(qkv, x, w_qkv)


def attn_qkv_backward(dx: np.ndarray, dw_qkv: np.ndarray, dqkv: np.ndarray, x: np.ndarray,
                      w_qkv: np.ndarray, work: np.ndarray) -> None:
    """dx (N, C) = dqkv @ w_qkv.T; dw_qkv (C, 3C) += x.T @ dqkv."""
    _linear_backward(dx, dw_qkv, dqkv, x, w_qkv, work)


# ---------------------------------------------------------------------------- attn
def _heads(qkv: np.ndarray, B: int, T: int, H: int) -> np.ndarray:
    """View qkv (B*T, 3C) as (3, B, H, T, D): q, k, v per head (strided, no copy)."""
    C = qkv.shape[-1] // 3
    return qkv.reshape(B, T, 3, H, C // H).transpose(2, 0, 3, 1, 4)


def _heads_contig(work_views, qkv: np.ndarray, B: int, T: int, H: int, scale: float):
    """Copy q (times ``scale``), k, v out of qkv into contiguous (B, H, T, D) buffers: batched
    matmuls on contiguous heads run ~3x faster than on the strided views."""
    qh, kh, vh = work_views
    q, k, v = _heads(qkv, B, T, H)
    np.multiply(q, scale, out=qh)
    np.copyto(kh, k)
    np.copyto(vh, v)
    return qh, kh, vh


def _mm(out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """out (M, K) = a (M, J) @ b (J, K), split over fixed row ranges of a and out (a may be a
    transposed view: its row ranges are column ranges of the stored array, no copy)."""
    split_batch(lambda r0, r1: np.matmul(a[r0:r1], b, out=out[r0:r1]), a.shape[0])


def _mm_acc(acc: np.ndarray, a: np.ndarray, b: np.ndarray, tmp: np.ndarray) -> None:
    """acc (M, K) += a (M, J) @ b (J, K) through the scratch tmp (M, K), split as ``_mm``."""
    def part(r0: int, r1: int) -> None:
        np.matmul(a[r0:r1], b, out=tmp[r0:r1])
        acc[r0:r1] += tmp[r0:r1]

    split_batch(part, a.shape[0])


def att_shape(B: int, H: int, T: int) -> tuple[int, int, int, int]:
    """What attn_forward saves per layer: the probabilities key-major, att[b, j, h, i] =
    P[b, h, i, j] (query i, key j). The softmax then reduces over keys down the columns of a
    (T, H*T) block per batch row, with NumPy's inner loop along H*T contiguous values instead
    of one short row at a time: max, sum and scale cost ~3x less than on (B, H, T, T)."""
    return (B, T, H, T)


# Causal attention in query blocks of ATT_BLOCK positions: the queries [i0, i1) see only the
# keys [0, i1), so the scores, P v and every backward matmul run on those blocks alone and the
# all-masked block above them is never multiplied (at T = 128: 3 of 4 blocks, 25% fewer attention
# FLOPs). The skipped probabilities are exact zeros (written, not computed), so the results are
# those of the full product; the skipped terms only ever added exact zeros.
ATT_BLOCK = 32


def _causal_blocks(T: int) -> list[tuple[int, int]]:
    """The query (= key) blocks [i0, i1) of ``ATT_BLOCK`` positions covering [0, T)."""
    return [(i0, min(i0 + ATT_BLOCK, T)) for i0 in range(0, T, ATT_BLOCK)]


def attn_forward(out: np.ndarray, att: np.ndarray, qkv: np.ndarray, mask: np.ndarray,
                 n_head: int, work: np.ndarray) -> None:
    """Causal scaled dot-product attention.

    qkv (B, T, 3C) -> out (B, T, C) = concat_h softmax(q k^T / sqrt(D) + mask) v.
    att (B, T, H, T) = ``att_shape``: saves the softmax probabilities (key-major) for the backward.
    mask (T, T): 0 on and below the diagonal, -inf above (a constant the engine owns; the
    blocks above the diagonal, ``_causal_blocks``, are -inf whatever it holds there).
    """
    B, T = out.shape[0], out.shape[1]
    H = n_head
    C = out.shape[-1]
    D = C // H
    if att.shape != att_shape(B, H, T):
        raise ValueError(f"attn_forward: att has shape {att.shape}, expected att_shape(B, H, T) = {att_shape(B, H, T)}")
    QH, KH, VH, Y, STAT, MT = _carve(work, (B, H, T, D), (B, H, T, D), (B, H, T, D), (B, H, T, D),
                                     (B, 1, H * T), (T, H * T))
    np.copyto(MT.reshape(T, H, T), mask.T[:, None, :])  # the mask key-major, once per head
    ones = _ones(T, out.dtype)
    blocks = _causal_blocks(T)

    def part(b0: int, b1: int) -> None:
        n = b1 - b0
        qh, kh, vh, y, st = QH[b0:b1], KH[b0:b1], VH[b0:b1], Y[b0:b1], STAT[b0:b1]
        a4, a3 = att[b0:b1], att[b0:b1].reshape(n, T, H * T)
        s4 = a4.transpose(0, 2, 1, 3)                  # (n, H, keys, queries): scores^T per (b, h)
        _heads_contig((qh, kh, vh), qkv[b0:b1], n, T, H, 1.0 / math.sqrt(D))
        for i0, i1 in blocks:                          # queries [i0, i1) see keys [0, i1)
            np.matmul(kh[:, :, :i1], qh[:, :, i0:i1].swapaxes(-1, -2), out=s4[:, :, :i1, i0:i1])
            s4[:, :, i1:, i0:i1] = -np.inf
        a3 += MT
        np.max(a3, axis=1, keepdims=True, out=st)      # (n, 1, H*T): per query, over keys
        a3 -= st
        np.exp(a3, out=a3)
        np.matmul(ones, a3, out=st[:, 0])              # key sums as one gemv per batch row
        np.reciprocal(st, out=st)                      # one divide per query, a multiply per entry
        a3 *= st
        p4 = a4.transpose(0, 2, 3, 1)                  # (n, H, queries, keys)
        for i0, i1 in blocks:                          # y = P v per (b, h), keys [0, i1)
            np.matmul(p4[:, :, i0:i1, :i1], vh[:, :, :i1], out=y[:, :, i0:i1])
        np.copyto(out[b0:b1].reshape(n, T, H, D), y.transpose(0, 2, 1, 3))

    split_batch(part, B)


def attn_backward(dqkv: np.ndarray, dout: np.ndarray, qkv: np.ndarray, att: np.ndarray, y: np.ndarray,
                  n_head: int, work: np.ndarray) -> None:
    """dqkv (B, T, 3C) = d/dqkv of attn_forward, given dout (B, T, C), the saved att (``att_shape``)
    and the forward's output y (B, T, C) (unused here: a fused backend that saved less needs it).
    Causal blocks as the forward: query block [i0, i1) reads keys [0, i1); key block [j0, j1)
    is read by queries [j0, T)."""
    B, T = dout.shape[0], dout.shape[1]
    H = n_head
    C = dout.shape[-1]
    D = C // H
    scale = 1.0 / math.sqrt(D)
    if att.shape != att_shape(B, H, T):
        raise ValueError(f"attn_backward: att has shape {att.shape}, expected att_shape(B, H, T) = {att_shape(B, H, T)}")
    QH, KH, VH, DY, TMP, DATT, ROWDOT = _carve(work, (B, H, T, D), (B, H, T, D), (B, H, T, D), (B, H, T, D),
                                               (B, H, T, D), (B, T, H, T), (B, 1, H * T))
    blocks = _causal_blocks(T)

    def part(b0: int, b1: int) -> None:
        n = b1 - b0
        qh, kh, vh, dy, tmp, rowdot = QH[b0:b1], KH[b0:b1], VH[b0:b1], DY[b0:b1], TMP[b0:b1], ROWDOT[b0:b1]
        d4, d3 = DATT[b0:b1], DATT[b0:b1].reshape(n, T, H * T)
        p4, p3 = att[b0:b1], att[b0:b1].reshape(n, T, H * T)
        pkq, dkq = p4.transpose(0, 2, 1, 3), d4.transpose(0, 2, 1, 3)   # (n, H, keys, queries)
        dqk = d4.transpose(0, 2, 3, 1)                                  # (n, H, queries, keys)
        _heads_contig((qh, kh, vh), qkv[b0:b1], n, T, H, scale)        # qh = q * scale
        np.copyto(dy, dout[b0:b1].reshape(n, T, H, D).transpose(0, 2, 1, 3))
        for i0, i1 in blocks:                          # datt^T = v dy^T (zero where P is)
            np.matmul(vh[:, :, :i1], dy[:, :, i0:i1].swapaxes(-1, -2), out=dkq[:, :, :i1, i0:i1])
            dkq[:, :, i1:, i0:i1] = 0.0
        for j0, j1 in blocks:                          # vh = dv = P^T dy, queries [j0, T)
            np.matmul(pkq[:, :, j0:j1, j0:], dy[:, :, j0:], out=vh[:, :, j0:j1])
        # softmax backward: ds = P * (datt - sum_keys(datt * P)) is dL/d(scaled scores)
        np.einsum("bjk,bjk->bk", d3, p3, out=rowdot[:, 0])
        d3 -= rowdot
        d3 *= p3                                       # d4 = ds^T
        for i0, i1 in blocks:                          # dy = dq = ds k * scale, keys [0, i1)
            np.matmul(dqk[:, :, i0:i1, :i1], kh[:, :, :i1], out=dy[:, :, i0:i1])
        dy *= scale
        for j0, j1 in blocks:                          # tmp = dk = ds^T (q * scale), queries [j0, T)
            np.matmul(dkq[:, :, j0:j1, j0:], qh[:, :, j0:], out=tmp[:, :, j0:j1])
        dq, dk, dv = _heads(dqkv[b0:b1], n, T, H)
        np.copyto(dq, dy)
        np.copyto(dk, tmp)
        np.copyto(dv, vh)

    split_batch(part, B)


# ------------------------------------------------------------------------ attn_out
def attn_out_forward(out: np.ndarray, y: np.ndarray, w_o: np.ndarray) -> None:
    """out (N, C) = y (N, C) @ w_o (C, C): the output projection of the attention heads."""
    _mm(out, y, w_o)


def attn_out_backward(dy: np.ndarray, dw_o: np.ndarray, dout: np.ndarray, y: np.ndarray,
                      w_o: np.ndarray, work: np.ndarray) -> None:
    """dy (N, C) = dout @ w_o.T; dw_o (C, C) += y.T @ dout."""
    _linear_backward(dy, dw_o, dout, y, w_o, work)


# ----------------------------------------------------------------------------- mlp
def _neg2u_exp(out: np.ndarray, x: np.ndarray) -> None:
    """out = exp(-2v) with v = k (x + a x^3), so 1 / (1 + out) = sigmoid(2v) = (1 + tanh v) / 2.

    The sigmoid form needs one exp instead of a tanh (about half the cost in NumPy). For
    x < ~-9 the exp overflows to inf (the caller silences that warning) and x / (1 + inf)
    is the correct -0."""
    np.multiply(x, x, out=out)
    out *= -2.0 * GELU_K * GELU_A
    out -= 2.0 * GELU_K
    out *= x
    np.exp(out, out=out)


def _gelu(out: np.ndarray, x: np.ndarray) -> None:
    with np.errstate(over="ignore"):                   # thread-local: set in every worker
        _neg2u_exp(out, x)
    out += 1.0
    np.divide(x, out, out=out)


def gelu_forward(out: np.ndarray, x: np.ndarray) -> None:
    """out (N, 4C) = gelu(x), the activation of ``mlp_forward`` alone (a backend that does not
    keep h_act per layer re-runs it in the backward)."""
    split_batch(lambda r0, r1: _gelu(out[r0:r1], x[r0:r1]), x.shape[0])


def mlp_forward(out: np.ndarray, h_pre: np.ndarray, h_act: np.ndarray, x: np.ndarray,
                w_fc: np.ndarray, w_proj: np.ndarray) -> None:
    """out (N, C) = gelu(x @ w_fc) @ w_proj; w_fc (C, 4C), w_proj (4C, C).

    gelu is the tanh form, 0.5 u (1 + tanh(k (u + a u^3))) (as torch approximate="tanh"),
    evaluated as u / (1 + exp(-2 k (u + a u^3))) = u sigmoid(2v). Saves h_pre = x @ w_fc and
    h_act = gelu(h_pre), both (N, 4C), for the backward.
    """
    def part(r0: int, r1: int) -> None:                # rows are independent
        hp, ha = h_pre[r0:r1], h_act[r0:r1]
        np.matmul(x[r0:r1], w_fc, out=hp)
        _gelu(ha, hp)
        np.matmul(ha, w_proj, out=out[r0:r1])

    split_batch(part, x.shape[0])


def mlp_backward(dx: np.ndarray, dw_fc: np.ndarray, dw_proj: np.ndarray, dout: np.ndarray,
                 x: np.ndarray, h_pre: np.ndarray, h_act: np.ndarray,
                 w_fc: np.ndarray, w_proj: np.ndarray, work: np.ndarray) -> None:
    """dx (N, C) = ...; dw_fc (C, 4C) += ...; dw_proj (4C, C) += ... for mlp_forward.

    The forward saved h_act = u s with s = sigmoid(2v), v = k (u + a u^3), so the backward
    reads s = h_act / h_pre back (one divide instead of a second exp; where |u| is zero or
    subnormal, s = sigmoid(0) = 1/2). With r = 2 u dv/du = u (2k + 6ka u^2):
    gelu'(u) = s + r s (1 - s) = s (1 + r (1 - s)).
    """
    N, C = x.shape
    F = w_fc.shape[1]
    DH, S, R, SMALL = _carve(work, (N, F), (N, F), (N, F), (-(-N * F // work.itemsize),))
    SMALL = SMALL.view(np.bool_)[:N * F].reshape(N, F)
    tiny = np.finfo(x.dtype).tiny

    def rows(r0: int, r1: int) -> None:               # dh = dL/dh_pre and dx, row by row
        dh, s, r, hp, small = DH[r0:r1], S[r0:r1], R[r0:r1], h_pre[r0:r1], SMALL[r0:r1]
        np.matmul(dout[r0:r1], w_proj.T, out=dh)       # dL/dh_act
        with np.errstate(invalid="ignore", divide="ignore"):
            np.divide(h_act[r0:r1], hp, out=s)         # s = sigmoid(2v) (nan where u == 0)
        np.abs(hp, out=r)
        np.less(r, tiny, out=small)
        np.copyto(s, 0.5, where=small)
        np.multiply(hp, hp, out=r)                     # r = u (2k + 6ka u^2)
        r *= 6.0 * GELU_K * GELU_A
        r += 2.0 * GELU_K
        r *= hp
        np.subtract(1.0, s, out=s)                     # s <- 1 - s
        r *= s                                         # r (1 - s)
        r += 1.0
        np.subtract(1.0, s, out=s)                     # s again (to within 2^-24 absolute)
        r *= s                                         # gelu'(u)
        dh *= r                                        # dh = dL/dh_pre
        np.matmul(dh, w_fc.T, out=dx[r0:r1])

    split_batch(rows, N)
    (_, TW) = _carve(work, (N, F), (F, C))             # weight-grad tmp: over s and r, not dh
    _mm_acc(dw_proj, h_act.T, dout, TW)
    _mm_acc(dw_fc, x.T, DH, TW.reshape(C, F))


# ---------------------------------------------------------------------- residual
def residual_add_forward(out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """out (N, C) = a + b."""
    np.add(a, b, out=out)


def residual_add_backward(db: np.ndarray, dout: np.ndarray) -> None:
    """db (N, C) = dout: the branch's gradient. The stream's own gradient passes through the add
    unchanged (the recipe keeps it in one buffer, in place); db may be dout itself (no copy)."""
    if db is not dout:
        np.copyto(db, dout)


def residual_layernorm_forward(xo: np.ndarray, out: np.ndarray, mean: np.ndarray, rstd: np.ndarray,
                               a: np.ndarray, b: np.ndarray, g: np.ndarray, beta: np.ndarray) -> None:
    """xo (N, C) = a + b; out, mean, rstd = layernorm_forward of xo with gain g and bias beta."""
    residual_add_forward(xo, a, b)
    layernorm_forward(out, mean, rstd, xo, g, beta)


def layernorm_residual_backward(dx: np.ndarray, dbranch: np.ndarray, dg: np.ndarray, db: np.ndarray,
                                dout: np.ndarray, x: np.ndarray, mean: np.ndarray, rstd: np.ndarray,
                                g: np.ndarray, work: np.ndarray) -> None:
    """layernorm_backward (dx, dg, db +=), then dbranch (N, C) = dx: the gradient of the residual
    branch that produced x (dbranch may be dx itself)."""
    layernorm_backward(dx, dg, db, dout, x, mean, rstd, g, work)
    residual_add_backward(dbranch, dx)


# ---------------------------------------------------------------------------- loss
def loss_forward(losses: np.ndarray, logits: np.ndarray, probs: np.ndarray, x: np.ndarray,
                 wte: np.ndarray, targets: np.ndarray | None, work: np.ndarray) -> None:
    """Tied output projection, softmax and cross-entropy.

    logits (N, V) = x (N, C) @ wte.T (wte is the token embedding (V, C));
    probs (N, V) = softmax(logits) (saved for the backward);
    losses (N,) = -log probs[n, targets[n]] (computed as logsumexp - logit, so it never
    takes the log of an underflowed probability). targets int (N,) or None (logits only).
    """
    N, V = logits.shape
    if targets is None:
        _mm(logits, x, wte.T)
        return
    (ROWSUM,) = _carve(work, (N,))
    ones = _ones(V, logits.dtype)

    def part(r0: int, r1: int) -> None:                # rows are independent
        lg, pr, ls, rowsum = logits[r0:r1], probs[r0:r1], losses[r0:r1], ROWSUM[r0:r1]
        np.matmul(x[r0:r1], wte.T, out=lg)
        np.max(lg, axis=1, out=ls)                     # losses holds the row max for now
        np.subtract(lg, ls[:, None], out=pr)
        np.exp(pr, out=pr)
        np.matmul(pr, ones, out=rowsum)                # row sums as one gemv (0.68 -> 0.22 ms at tiny)
        np.reciprocal(rowsum, out=rowsum)              # one divide per row, a multiply per entry
        pr *= rowsum[:, None]
        np.log(rowsum, out=rowsum)
        ls -= rowsum                                   # logsumexp = max + log(sum) = max - log(1/sum)
        ls -= np.take_along_axis(lg, targets[r0:r1].reshape(r1 - r0, 1), axis=1)[:, 0]

    split_batch(part, N)


def loss_backward(dx: np.ndarray, dwte: np.ndarray, logits: np.ndarray, probs: np.ndarray, x: np.ndarray,
                  wte: np.ndarray, targets: np.ndarray, dloss: float, work: np.ndarray) -> None:
    """dx (N, C) = dlogits @ wte; dwte (V, C) += dlogits.T @ x, with
    dlogits = (probs - onehot(targets)) * dloss, where dloss is dL/dlosses[n] (1/N for a mean).

    probs is consumed: it holds dlogits on return. (logits is unused here: a backend that saves
    only the row log-sum-exp rebuilds dlogits in place in it.)
    """
    N, V = probs.shape
    C = x.shape[1]
    _, tw, flat = _carve(work, (N, C), (V, C), (N,))
    flat_i = flat.view(np.int32) if flat.dtype == np.float32 else flat.view(np.int64)
    np.multiply(np.arange(N, dtype=flat_i.dtype), V, out=flat_i)   # row starts
    flat_i += targets.reshape(N)
    p = probs.reshape(-1)
    p[flat_i] -= 1.0
    def rows(r0: int, r1: int) -> None:
        probs[r0:r1] *= dloss
        np.matmul(probs[r0:r1], wte, out=dx[r0:r1])

    split_batch(rows, N)
    _mm_acc(dwte, probs.T, x, tw)


# ---------------------------------------------------------------- clipping + AdamW
def grad_norm_partial(partials: np.ndarray, grads: np.ndarray) -> None:
    """partials (P,) float64: partials[i] = sum of squares of chunk i of the flat grads (n,),
    chunk = ceil(n / P), each chunk reduced by one BLAS dot in the grads' dtype; the final
    sum over the P partials runs in float64."""
    P = partials.shape[0]
    n = grads.shape[0]
    chunk = -(-n // P)
    for i in range(P):
        seg = grads[i * chunk:(i + 1) * chunk]
        partials[i] = np.dot(seg, seg) if seg.size else 0.0


def grad_norm_final(partials: np.ndarray) -> float:
    """The global L2 norm sqrt(sum(partials)) as a Python float (nan/inf pass through)."""
    return float(math.sqrt(float(np.sum(partials)))) if np.isfinite(partials).all() else float("nan")


def grad_scale(grads: np.ndarray, scale: float) -> None:
    """grads (n,) *= scale, in place (clipping and the 1/n of gradient accumulation)."""
    grads *= grads.dtype.type(scale)


def adamw(w: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, n_decay: int, t: int,
          lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW step over the flat buffers w, g, m, v (n,), as torch.optim.AdamW:

    w[:n_decay] *= 1 - lr * weight_decay           (decoupled decay; the layout puts every
                                                     decayed matrix before the norm params)
    m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
    w -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

    t is the 1-based step count. g is consumed as scratch (garbage on return).
    """
    dt = w.dtype.type
    bc1 = 1.0 - beta1 ** t
    bc2 = 1.0 - beta2 ** t

    def part(i0: int, i1: int) -> None:                # element-wise: any split gives the same bits
        wp, gp, mp, vp = w[i0:i1], g[i0:i1], m[i0:i1], v[i0:i1]
        if weight_decay and n_decay > i0:
            w[i0:min(i1, n_decay)] *= dt(1.0 - lr * weight_decay)
        mp *= dt(beta1)
        vp *= dt(beta2)
        gp *= dt(1.0 - beta1)
        mp += gp
        np.multiply(gp, gp, out=gp)                    # (1 - beta1)^2 g^2
        gp *= dt((1.0 - beta2) / (1.0 - beta1) ** 2)
        vp += gp
        np.sqrt(vp, out=gp)
        gp *= dt(1.0 / math.sqrt(bc2))
        gp += dt(eps)
        np.divide(mp, gp, out=gp)
        gp *= dt(lr / bc1)
        wp -= gp

    split_batch(part, w.shape[0])
