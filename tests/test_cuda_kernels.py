"""Every CUDA kernel of andrea/cuda against its NumPy twin (andrea/engine/ops_numpy.py, in float64).

    PYTHONPATH=. python3 -m pytest -m gpu tests/test_cuda_kernels.py     # on a machine with a GPU

Skipped cleanly where CuPy cannot be imported or finds no CUDA device. Inputs are drawn fresh
(seeded) and, for 16-bit storage, rounded to that type first, so the reference sees exactly what
the kernel sees. Every check is ``|out - ref| <= atol + rtol * |ref|`` elementwise, with the
tolerances per precision stated in TOL; outputs are poisoned (NaN) before each launch so an
unwritten element fails.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from andrea.cuda.kernels import LN_BWD_BUILT
from andrea.cuda.loader import cupy_or_none
from andrea.cuda.mirror import MirrorOps
from andrea.errors import AndreaError
from andrea.engine import ops_numpy as ops
from andrea.engine.fp8_numpy import bf16_to_f32, f32_to_bf16

cp = cupy_or_none()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason="CuPy cannot be imported or finds no CUDA device")]

# (atol, rtol) per storage precision; fp32 arithmetic vs float64, 16-bit storage of outputs
TOL = {"fp32": (2e-5, 2e-4), "bf16": (2e-2, 2e-2), "fp16": (4e-3, 4e-3)}


def close(out, ref, prec, scale=1.0, what=""):
    atol, rtol = TOL[prec]
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all(), f"{what}: non-finite output"
    err = np.abs(out - ref)
    bound = atol * scale + rtol * np.abs(ref)
    worst = float(np.max(err - bound))
    assert worst <= 0, f"{what}: max excess {worst:.3g} (max err {float(err.max()):.3g}, ref scale {scale:.3g})"


def to_dev(x, prec):
    """float array -> device array in storage type (uint16 payload for 16-bit), and the rounded host copy."""
    x = np.asarray(x, np.float32)
    if prec == "fp32":
        return cp.asarray(x), x.astype(np.float64)
    if prec == "bf16":
        bits = f32_to_bf16(x)
        back = bf16_to_f32(bits)
        return cp.asarray(bits), back.astype(np.float64)
    h = x.astype(np.float16)
    return cp.asarray(h.view(np.uint16)), h.astype(np.float64)


def from_dev(a, prec):
    h = cp.asnumpy(a)
    if prec == "fp32" or h.dtype == np.float32:
        return h.astype(np.float64)
    if prec == "bf16":
        return (h.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return h.view(np.float16).astype(np.float64)


def empty(shape, prec):
    if prec == "fp32":
        return cp.full(shape, np.nan, dtype=np.float32)
    return cp.full(shape, 0x7FFF if prec == "bf16" else 0x7E00, dtype=np.uint16)  # NaN payloads


@pytest.fixture()
def be():
    from andrea.cuda import kernels

    return kernels


def _ln_case(prec, N, C, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(0.5, 2.0, (N, C)).astype(np.float32)
    g = rng.normal(1.0, 0.3, C).astype(np.float32)
    b = rng.normal(0.0, 0.3, C).astype(np.float32)
    dy_f = rng.normal(0, 1, (N, C)).astype(np.float32)
    dx0 = rng.normal(0, 1, (N, C)).astype(np.float32)          # backward adds (+=)
    dg0, db0 = rng.normal(0, 1, C).astype(np.float32), rng.normal(0, 1, C).astype(np.float32)
    return x, g, b, dy_f, dx0, dg0, db0


def _ln_backward_check(be, prec, x, g, dy_f, dx0, dg0, db0, mean, rstd, rm, rr, vr=None):
    """One k_layernorm_bwd (with the branch cast dlow where prec is 16-bit) against the NumPy twin;
    returns the device outputs (dx, dg, db, dlow)."""
    N, C = x.shape
    dy, dy64 = to_dev(dy_f, prec)
    dx, dg, db = cp.asarray(dx0), cp.asarray(dg0), cp.asarray(db0)
    part = cp.full(((N + be.LN_ROWS_PER_CHUNK - 1) // be.LN_ROWS_PER_CHUNK) * 2 * C, np.nan, np.float32)
    dlow = None if prec == "fp32" else empty((N, C), prec)
    be.k_layernorm_bwd(prec, dx, dg, db, dy, cp.asarray(x), mean, rstd, cp.asarray(g), part, N, C, dlow=dlow, vr=vr)
    rdx, rdg, rdb = dx0.astype(np.float64), dg0.astype(np.float64), db0.astype(np.float64)
    rbr = np.full((N, C), np.nan)
    ops.layernorm_residual_backward(rdx, rbr, rdg, rdb, dy64, x.astype(np.float64), rm, rr, g.astype(np.float64),
                                    np.zeros(ops.work_elems(1, N, C, 1, 1)))
    what = f"C={C} vr={vr}"
    close(cp.asnumpy(dx), rdx, "fp32", scale=1.0, what=f"dx {what}")
    close(cp.asnumpy(dg), rdg, "fp32", scale=10.0, what=f"dg {what}")
    close(cp.asnumpy(db), rdb, "fp32", scale=10.0, what=f"db {what}")
    if dlow is not None:                  # the branch gradient: exactly dx rounded to the storage type
        close(from_dev(dlow, prec), rbr, prec, what=f"dbranch {what}")
        assert (cp.asnumpy(dlow) == cp.asnumpy(to_dev(cp.asnumpy(dx), prec)[0])).all(), f"dbranch bits {what}"
    return dx, dg, db, dlow


@pytest.mark.parametrize("prec,C", [("fp32", 96), ("bf16", 96), ("fp16", 96), ("fp32", 98), ("bf16", 98),
                                    ("bf16", 384), ("bf16", 768), ("fp16", 768), ("bf16", 1536), ("fp32", 1536),
                                    ("bf16", 3076)])
def test_layernorm_pair(be, prec, C):
    # C % 4 == 0 takes the float4 kernels (one fused backward, R warps a row past C = 384), C = 98 and
    # C = 3076 (past the widest vector backward) the scalar three-kernel backward
    N = 300
    x, g, b, dy_f, dx0, dg0, db0 = _ln_case(prec, N, C)
    y = empty((N, C), prec)
    mean, rstd = cp.full(N, np.nan, np.float32), cp.full(N, np.nan, np.float32)
    be.k_layernorm_fwd(prec, y, mean, rstd, cp.asarray(x), cp.asarray(g), cp.asarray(b), N, C)
    ry, rm, rr = np.zeros((N, C)), np.zeros(N), np.zeros(N)
    ops.layernorm_forward(ry, rm, rr, x.astype(np.float64), g.astype(np.float64), b.astype(np.float64))
    close(from_dev(y, prec), ry, prec, what="layernorm y")
    close(cp.asnumpy(mean), rm, "fp32", what="mean")
    close(cp.asnumpy(rstd), rr, "fp32", what="rstd")
    _ln_backward_check(be, prec, x, g, dy_f, dx0, dg0, db0, mean, rstd, rm, rr)


@pytest.mark.parametrize("V,R", sorted(LN_BWD_BUILT))
def test_every_vector_layernorm_backward_matches_and_repeats_its_bits(be, V, R):
    # the widest C each (V, R) takes, minus 8 columns (the last lanes idle), and a row count that
    # leaves the last chunk part-empty; a second launch gives the same bits
    C, N = 128 * R * V - 8, 70
    x, g, b, dy_f, dx0, dg0, db0 = _ln_case("bf16", N, C, seed=V * 10 + R)
    mean, rstd = cp.full(N, np.nan, np.float32), cp.full(N, np.nan, np.float32)
    be.k_layernorm_fwd("bf16", empty((N, C), "bf16"), mean, rstd, cp.asarray(x), cp.asarray(g), cp.asarray(b), N, C)
    rm, rr = cp.asnumpy(mean).astype(np.float64), cp.asnumpy(rstd).astype(np.float64)
    first = _ln_backward_check(be, "bf16", x, g, dy_f, dx0, dg0, db0, mean, rstd, rm, rr, vr=(V, R))
    again = _ln_backward_check(be, "bf16", x, g, dy_f, dx0, dg0, db0, mean, rstd, rm, rr, vr=(V, R))
    for p, q in zip(first, again):
        assert cp.asnumpy(p).tobytes() == cp.asnumpy(q).tobytes()


def test_layernorm_backward_refuses_a_vector_choice_too_narrow(be):
    N, C = 8, 768
    z = cp.zeros((N, C), np.float32)
    with pytest.raises(AndreaError, match="no kernel with V=3, R=1 for C=768"):
        be.k_layernorm_bwd("fp32", z, cp.zeros(C, np.float32), cp.zeros(C, np.float32), z, z, cp.zeros(N, np.float32),
                           cp.ones(N, np.float32), cp.ones(C, np.float32), cp.zeros(2 * C, np.float32), N, C, vr=(3, 1))


@pytest.mark.parametrize("prec,C", [("fp32", 96), ("bf16", 768), ("fp16", 1536), ("bf16", 98)])
def test_residual_layernorm_forward_matches_and_equals_the_two_kernels(be, prec, C):
    # fused where C % 4 == 0 (C = 98: the two kernels); the same bits as k_residual_add + k_layernorm_fwd
    rng = np.random.default_rng(3)
    N = 300
    a = rng.normal(0.5, 2.0, (N, C)).astype(np.float32)
    br, br64 = to_dev(rng.normal(0, 1.0, (N, C)), prec)
    g = rng.normal(1.0, 0.3, C).astype(np.float32)
    b = rng.normal(0.0, 0.3, C).astype(np.float32)
    outs = []
    for fused in (True, False):
        xo, y = cp.full((N, C), np.nan, np.float32), empty((N, C), prec)
        mean, rstd = cp.full(N, np.nan, np.float32), cp.full(N, np.nan, np.float32)
        if fused:
            be.k_residual_layernorm_fwd(prec, xo, y, mean, rstd, cp.asarray(a), br, cp.asarray(g), cp.asarray(b), N, C)
        else:
            be.k_residual_add(prec, xo, cp.asarray(a), br, N * C)
            be.k_layernorm_fwd(prec, y, mean, rstd, xo, cp.asarray(g), cp.asarray(b), N, C)
        outs.append([cp.asnumpy(t) for t in (xo, y, mean, rstd)])
    for p, q in zip(*outs):
        assert p.tobytes() == q.tobytes()
    rxo, ry, rm, rr = np.full((N, C), np.nan), np.full((N, C), np.nan), np.full(N, np.nan), np.full(N, np.nan)
    ops.residual_layernorm_forward(rxo, ry, rm, rr, a.astype(np.float64), br64, g.astype(np.float64),
                                   b.astype(np.float64))
    xo, y, mean, rstd = outs[0]
    close(xo, rxo, "fp32", what="xo")
    close(from_dev(cp.asarray(y), prec), ry, prec, what="y")
    close(mean, rm, "fp32", what="mean")
    close(rstd, rr, "fp32", what="rstd")


@pytest.mark.parametrize("prec,n", [("fp32", 10_000), ("bf16", 10_000), ("bf16", 10_001), ("fp16", 4_096)])
def test_gelu_pair(be, prec, n):
    # n % 8 == 0 takes the 8-wide kernels, 10_001 the scalar ones
    rng = np.random.default_rng(2)
    x, x64 = to_dev(rng.normal(0, 2, n), prec)
    dy, dy64 = to_dev(rng.normal(0, 1, n), prec)
    y = empty(n, prec)
    be.k_gelu_fwd(prec, y, x, n)
    k, a = ops.GELU_K, ops.GELU_A
    ref = 0.5 * x64 * (1 + np.tanh(k * (x64 + a * x64 ** 3)))      # the tanh form ops_numpy documents
    close(from_dev(y, prec), ref, prec, what="gelu")
    dx = empty(n, prec)
    be.k_gelu_bwd(prec, dx, dy, x, n)
    th = np.tanh(k * (x64 + a * x64 ** 3))
    dref = dy64 * (0.5 * (1 + th) + 0.5 * x64 * (1 - th ** 2) * k * (1 + 3 * a * x64 ** 2))
    close(from_dev(dx, prec), dref, prec, what="gelu'")


def _attn_case(be, prec, B, T, H, D, seed, rows=(None, None), impl=None):
    """One forward + backward against ops_numpy; ``rows``: (fwd rows, (dq rows, dkv rows)) of the mma
    kernels, None for kernels.ATTN_MMA_ROWS; ``impl``: "mma" or "wg" (None: kernels.attn_impl's pick)."""
    rng = np.random.default_rng(seed)
    C = H * D
    N = B * T
    qkv, qkv64 = to_dev(rng.normal(0, 1, (N, 3 * C)), prec)
    dout, dout64 = to_dev(rng.normal(0, 1, (N, C)), prec)
    y = empty((N, C), prec)
    lse = cp.full(B * H * T, np.nan, np.float32)
    be.k_attn_fwd(prec, y, lse, qkv, B, T, C, H, rows=rows[0], impl=impl)
    ry = np.zeros((B, T, C))
    att = np.zeros(ops.att_shape(B, H, T))
    mask = np.triu(np.full((T, T), -np.inf), k=1)
    work = np.zeros(ops.work_elems(B, T, C, H, 1))
    ops.attn_forward(ry, att, qkv64.reshape(B, T, 3 * C), mask, H, work)
    close(from_dev(y, prec), ry.reshape(N, C), prec, what=f"attn y {prec} D={D}")
    dqkv = empty((N, 3 * C), prec)
    dvec = cp.full(B * H * T, np.nan, np.float32)
    be.k_attn_bwd(prec, dqkv, dout, y, lse, dvec, qkv, B, T, C, H, accumulate=False, rows=rows[1], impl=impl)
    rd = np.zeros((B, T, 3 * C))
    ops.attn_backward(rd, dout64.reshape(B, T, C), qkv64.reshape(B, T, 3 * C), att, ry, H, work)
    got = from_dev(dqkv, prec)
    ref = rd.reshape(N, 3 * C)
    scale = float(np.abs(ref).max())
    close(got, ref, prec, scale=scale, what=f"attn dqkv {prec} D={D}")
    return dqkv, y, lse


@pytest.mark.parametrize("prec,D", [("fp32", 8), ("fp32", 32), ("fp32", 64), ("bf16", 32), ("bf16", 64),
                                    ("fp16", 64), ("bf16", 16)])
def test_attention_pair_causal_uneven_T(be, prec, D):
    # T = 200 is not a multiple of the 64-row tiles: the ragged last tile is checked too
    _attn_case(be, prec, B=2, T=200, H=2, D=D, seed=D)


def _need_wg(impl):
    from andrea.cuda.kernels import hopper

    if impl in ("wg", "wgds") and not hopper():
        pytest.skip("the wgmma attention kernels need a compute capability 9.0 device")


TENSOR_IMPLS = [("mma", (64, (64, 64))), ("mma", (128, (128, 128))), ("mma", (128, (64, 128))),
                ("wg", (64, (64, 64))), ("wg", (128, (128, 128))), ("wg", (64, (128, 64))),
                ("wg", (256, (128, 64))),
                ("wgds", (128, (64, 64))), ("wgds", (128, (128, 128))), ("wgds", (128, (128, 64)))]


@pytest.mark.parametrize("impl,rows", TENSOR_IMPLS)
@pytest.mark.parametrize("prec,D,T", [("bf16", 64, 1024), ("bf16", 32, 520), ("fp16", 32, 1024),
                                      ("fp16", 64, 200), ("bf16", 64, 70)])
def test_attention_pair_long_rows(be, prec, D, T, impl, rows):
    # the engine's T: several blocks of 64 or 128 rows, 64-row tiles wholly below the diagonal (the
    # unmasked path), T = 520, 200, 70 ragged against the tile sizes; every row choice of the mma.sync
    # kernels and the wgmma kernels
    _need_wg(impl)
    _attn_case(be, prec, B=1, T=T, H=2, D=D, seed=T + D, rows=rows, impl=impl)


@pytest.mark.parametrize("prec,D", [("bf16", 64), ("fp16", 32)])
def test_attention_wgmma_matches_mma_and_repeats(be, prec, D):
    # the two tensor-core implementations agree to 16-bit rounding (same products, same rounding of P
    # and dS; only the fp32 accumulation order differs), and the wgmma pair repeats its bytes
    _need_wg("wg")
    B, T, H = 2, 384, 3
    a, ya, la = _attn_case(be, prec, B, T, H, D, seed=5, impl="wg")
    b, yb, lb = _attn_case(be, prec, B, T, H, D, seed=5, impl="mma")
    a2, _, _ = _attn_case(be, prec, B, T, H, D, seed=5, impl="wg")
    c, _, _ = _attn_case(be, prec, B, T, H, D, seed=5, impl="wgds")
    c2, _, _ = _attn_case(be, prec, B, T, H, D, seed=5, impl="wgds")
    assert cp.asnumpy(a).tobytes() == cp.asnumpy(a2).tobytes()
    assert cp.asnumpy(c).tobytes() == cp.asnumpy(c2).tobytes()
    ulp = 2.0 ** -8 if prec == "bf16" else 2.0 ** -11
    for got, ref, what in ((ya, yb, "y"), (a, b, "dqkv"), (c, b, "dqkv (dQ from stored dS)")):
        g, r = from_dev(got, prec), from_dev(ref, prec)
        scale = float(np.abs(r).max())
        err = float(np.max(np.abs(g - r) - (4 * ulp * np.abs(r) + 1e-3 * scale)))
        assert err <= 0, f"wgmma vs mma.sync {what}: excess {err:.3g}"
    lsa, lsb = cp.asnumpy(la), cp.asnumpy(lb)
    assert np.max(np.abs(lsa - lsb)) <= 1e-4 * np.abs(lsb).max(), "wgmma vs mma.sync lse2"


def _attn_inputs(be, rng, B, T, H, D, impl):
    """bf16 qkv and dout (B*T rows) from ``rng``, and the forward's y and lse2 by ``impl``'s kernels:
    (C, N, qkv, dout, dout as float64, y, lse2)."""
    C, N = H * D, B * T
    qkv, _ = to_dev(rng.normal(0, 1, (N, 3 * C)), "bf16")
    dout, dout64 = to_dev(rng.normal(0, 1, (N, C)), "bf16")
    y = empty((N, C), "bf16")
    lse = cp.full(B * H * T, np.nan, np.float32)
    be.k_attn_fwd("bf16", y, lse, qkv, B, T, C, H, impl=impl)
    return C, N, qkv, dout, dout64, y, lse


@pytest.mark.parametrize("impl", ["mma", "wg", "wgds"])
def test_attention_mma_writes_dvec_and_accumulates(be, impl):
    _need_wg(impl)
    B, T, H, D = 2, 320, 2, 64
    rng = np.random.default_rng(11)
    C, N, qkv, dout, dout64, y, lse = _attn_inputs(be, rng, B, T, H, D, impl)
    dvec = cp.full(B * H * T, np.nan, np.float32)
    d1 = cp.zeros((N, 3 * C), np.uint16)
    be.k_attn_bwd("bf16", d1, dout, y, lse, dvec, qkv, B, T, C, H, accumulate=True, impl=impl)
    y64 = from_dev(y, "bf16").reshape(B, T, H, D)
    ref = np.einsum("bthd,bthd->bht", dout64.reshape(B, T, H, D), y64).reshape(-1)
    close(cp.asnumpy(dvec), ref, "fp32", scale=float(np.abs(ref).max()), what="dvec")
    base, base64 = to_dev(rng.normal(0, 1, (N, 3 * C)), "bf16")
    d2 = base.copy()
    be.k_attn_bwd("bf16", d2, dout, y, lse, dvec, qkv, B, T, C, H, accumulate=True, impl=impl)
    want = base64 + from_dev(d1, "bf16")
    close(from_dev(d2, "bf16"), want, "bf16", scale=float(np.abs(want).max()), what="bf16 accumulate")


def test_attention_ds_backward_in_head_groups_keeps_the_bytes(be):
    # "wgds" with a dS scratch that holds 2 of 6 heads runs three launches of each kernel: the same
    # bytes as one launch over all heads. So do two scratch buffers (a launch's first heads in the
    # first): 2 + 4 heads (one launch), 1 + 2 (two launches), 4 + less than a head (the first alone,
    # two launches). A scratch below one head is refused in one line.
    from andrea.cuda import kernels as K

    _need_wg("wgds")
    B, T, H, D = 2, 200, 3, 64
    C, N, qkv, dout, _, y, lse = _attn_inputs(be, np.random.default_rng(21), B, T, H, D, "wg")
    scratch = lambda heads: cp.full(K.attn_ds_bytes(T, heads) + 100, 0xFF, np.uint8)  # noqa: E731
    got = []
    for ds in (scratch(B * H), scratch(2), (scratch(2), scratch(4)), (scratch(1), scratch(2)),
               (scratch(4), cp.full(100, 0xFF, np.uint8))):
        d = empty((N, 3 * C), "bf16")
        be.k_attn_bwd("bf16", d, dout, y, lse, cp.full(B * H * T, np.nan, np.float32), qkv, B, T, C, H,
                      accumulate=False, impl="wgds", ds=ds)
        got.append(cp.asnumpy(d).tobytes())
    assert all(g == got[0] for g in got[1:])
    with pytest.raises(AndreaError, match="dS scratch holds 100 bytes"):
        be.k_attn_bwd("bf16", d, dout, y, lse, cp.zeros(B * H * T, np.float32), qkv, B, T, C, H,
                      accumulate=False, impl="wgds", ds=cp.zeros(100, np.uint8))


def test_attention_backward_is_deterministic_and_accumulates(be):
    B, T, H, D = 2, 256, 4, 64
    a1, y, lse = _attn_case(be, "bf16", B, T, H, D, seed=7)
    a2, _, _ = _attn_case(be, "bf16", B, T, H, D, seed=7)
    assert cp.asnumpy(a1).tobytes() == cp.asnumpy(a2).tobytes()
    # fp32 accumulate=True adds onto what is there
    rng = np.random.default_rng(3)
    C, N = H * D, B * T
    qkv = cp.asarray(rng.normal(0, 1, (N, 3 * C)).astype(np.float32))
    dout = cp.asarray(rng.normal(0, 1, (N, C)).astype(np.float32))
    y = cp.zeros((N, C), np.float32)
    lse = cp.zeros(B * H * T, np.float32)
    dvec = cp.zeros(B * H * T, np.float32)
    be.k_attn_fwd("fp32", y, lse, qkv, B, T, C, H)
    d1 = cp.zeros((N, 3 * C), np.float32)
    be.k_attn_bwd("fp32", d1, dout, y, lse, dvec, qkv, B, T, C, H, accumulate=True)
    base = cp.asarray(rng.normal(0, 1, (N, 3 * C)).astype(np.float32))
    d2 = base.copy()
    be.k_attn_bwd("fp32", d2, dout, y, lse, dvec, qkv, B, T, C, H, accumulate=True)
    close(cp.asnumpy(d2), cp.asnumpy(base + d1), "fp32", what="accumulate")


@pytest.mark.parametrize("prec,V", [("fp32", 1000), ("bf16", 1000), ("bf16", 1001), ("fp16", 8449), ("fp32", 997)])
def test_loss_pair(be, prec, V):
    # odd V: rows start off the 16-byte grid, so the head / vector body / tail split of every row differs
    rng = np.random.default_rng(4)
    N = 64
    logits, l64 = to_dev(rng.normal(0, 3, (N, V)), prec)
    tg = rng.integers(0, V, N).astype(np.int32)
    lse = cp.full(N, np.nan, np.float32)
    losses = cp.full(N, np.nan, np.float32)
    be.k_loss_fwd(prec, lse, losses, logits, cp.asarray(tg), N, V)
    m = l64.max(1, keepdims=True)
    rlse = (m + np.log(np.exp(l64 - m).sum(1, keepdims=True)))[:, 0]
    close(cp.asnumpy(lse), rlse, "fp32", what="lse")
    close(cp.asnumpy(losses), rlse - l64[np.arange(N), tg], "fp32", what="losses")
    out = cp.zeros(8, np.float32)
    from andrea.cuda.loader import kernel

    kernel("loss.cu", "k_loss_mean")((1,), (1024,), (losses, out, np.int32(N)))
    close(cp.asnumpy(out)[:1], [np.mean(rlse - l64[np.arange(N), tg])], "fp32", what="mean")
    d = empty((N, V), prec)
    be.k_loss_bwd(prec, d, logits, cp.asarray(tg), lse, 1.0 / N, N, V)
    p = np.exp(l64 - rlse[:, None])
    p[np.arange(N), tg] -= 1.0
    close(from_dev(d, prec), p / N, prec, scale=1.0 / N, what="dlogits")
    inplace = logits.copy()                         # the engine's use: dlogits written over the logits
    be.k_loss_bwd(prec, inplace, inplace, cp.asarray(tg), lse, 1.0 / N, N, V)
    assert cp.asnumpy(inplace).tobytes() == cp.asnumpy(d).tobytes()
    with pytest.raises(AndreaError, match="alignment"):
        off = cp.zeros(N * V + 8, d.dtype)[1:1 + N * V].reshape(N, V)    # one element off the grid
        be.k_loss_bwd(prec, off, logits, cp.asarray(tg), lse, 1.0 / N, N, V)


def test_embed_pair_matches_and_is_order_independent(be):
    rng = np.random.default_rng(5)
    B, T, V, C = 4, 50, 37, 24
    idx = rng.integers(0, V, (B, T)).astype(np.int32)
    wte = rng.normal(0, 1, (V, C)).astype(np.float32)
    wpe = rng.normal(0, 1, (T, C)).astype(np.float32)
    o = MirrorOps()
    out = cp.full((B, T, C), np.nan, np.float32)
    o.embed_forward(out, cp.asarray(idx), cp.asarray(wte), cp.asarray(wpe))
    ref = np.zeros((B, T, C), np.float32)
    ops.embed_forward(ref, idx, wte, wpe)
    close(cp.asnumpy(out), ref, "fp32", what="embed")
    dout = rng.normal(0, 1, (B, T, C)).astype(np.float32)
    dwte0, dwpe0 = rng.normal(0, 1, (V, C)).astype(np.float32), rng.normal(0, 1, (T, C)).astype(np.float32)
    dwte, dwpe = cp.asarray(dwte0), cp.asarray(dwpe0)
    o.embed_backward(dwte, dwpe, cp.asarray(dout), cp.asarray(idx))
    r1, r2 = dwte0.astype(np.float64), dwpe0.astype(np.float64)
    ops.embed_backward(r1, r2, dout.astype(np.float64), idx)
    close(cp.asnumpy(dwte), r1, "fp32", scale=5, what="dwte")
    close(cp.asnumpy(dwpe), r2, "fp32", scale=5, what="dwpe")
    again = cp.asarray(dwte0)
    o.embed_backward(again, cp.asarray(dwpe0), cp.asarray(dout), cp.asarray(idx))
    assert cp.asnumpy(again).tobytes() == cp.asnumpy(dwte).tobytes()


def test_clipping_and_adamw_match_numpy(be):
    rng = np.random.default_rng(6)
    n, n_decay = 100_003, 60_000
    g = rng.normal(0, 1e-2, n).astype(np.float32)
    o = MirrorOps()
    part = cp.zeros(64, np.float64)
    o.grad_norm_partial(part, cp.asarray(g))
    rpart = np.zeros(64)
    ops.grad_norm_partial(rpart, g.astype(np.float64))
    close(cp.asnumpy(part), rpart, "fp32", scale=1e-3, what="partials")
    assert abs(o.grad_norm_final(part) - ops.grad_norm_final(rpart)) <= 1e-5 * ops.grad_norm_final(rpart)
    w, m, v = (rng.normal(0, 1, n).astype(np.float32), rng.normal(0, 1e-3, n).astype(np.float32),
               np.abs(rng.normal(0, 1e-5, n)).astype(np.float32))
    dw, dm, dv = cp.asarray(w), cp.asarray(m), cp.asarray(v)
    o.adamw(dw, cp.asarray(g), dm, dv, n_decay, 7, 3e-3, 0.9, 0.95, 1e-8, 0.1)
    rw, rm, rv = w.astype(np.float64), m.astype(np.float64), v.astype(np.float64)
    ops.adamw(rw, g.astype(np.float64), rm, rv, n_decay, 7, 3e-3, 0.9, 0.95, 1e-8, 0.1)
    close(cp.asnumpy(dm), rm, "fp32", scale=1e-3, what="m")
    close(cp.asnumpy(dv), rv, "fp32", scale=1e-7, what="v")
    close(cp.asnumpy(dw), rw, "fp32", scale=1e-3, what="w")
    # the device-side clip: gstate = [norm, scale, finite]; NaN grads -> finite = 0 -> AdamW skips
    from andrea.cuda.loader import kernel

    gbad = cp.asarray(g)
    gbad[123] = np.nan
    pp, gs = cp.zeros(512, np.float32), cp.zeros(4, np.float32)
    kernel("optim.cu", "k_grad_norm_partial")((512,), (256,), (gbad, np.int64(n), pp))
    kernel("optim.cu", "k_grad_norm_final")((1,), (512,), (pp, np.int32(512), np.float32(1.0), np.float32(1.0), gs))
    assert cp.asnumpy(gs)[2] == 0.0
    # finite grads: gstate[1] = min(1, clip / (norm + 1e-6)) and k_grad_scale applies it
    gd = cp.asarray(g)
    kernel("optim.cu", "k_grad_norm_partial")((512,), (256,), (gd, np.int64(n), pp))
    kernel("optim.cu", "k_grad_norm_final")((1,), (512,), (pp, np.int32(512), np.float32(0.5), np.float32(1.0), gs))
    norm = float(np.sqrt(np.sum(g.astype(np.float64) ** 2)))
    state = cp.asnumpy(gs)
    assert abs(state[0] - norm) <= 1e-5 * norm and state[2] == 1.0
    assert abs(state[1] - 0.5 / (norm + 1e-6)) <= 1e-5 * state[1]
    kernel("optim.cu", "k_grad_scale")((math.ceil(n / 256),), (256,), (gd, np.int64(n), gs))
    close(cp.asnumpy(gd), g.astype(np.float64) * float(state[1]), "fp32", scale=1e-4, what="k_grad_scale")
    # gstate from the NaN gradients again (the finite check above overwrote it): AdamW must skip
    kernel("optim.cu", "k_grad_norm_partial")((512,), (256,), (gbad, np.int64(n), pp))
    kernel("optim.cu", "k_grad_norm_final")((1,), (512,), (pp, np.int32(512), np.float32(1.0), np.float32(1.0), gs))
    w0 = cp.asarray(w)
    hp = cp.asarray(be.adam_hyper(1, 1e-3, 0.9, 0.95, 1e-8, 0.1))
    kernel("optim.cu", "k_adamw_f32")((math.ceil(n / 256),), (256,), (w0, gbad, cp.zeros(n, np.float32),
                                                                     cp.zeros(n, np.float32), np.uint64(0),
                                                                     np.int64(n), hp, gs, np.int64(n_decay),
                                                                     np.int32(1)))
    assert cp.asnumpy(w0).tobytes() == w.tobytes()


def test_gate_finite_matches_its_twin(be):
    # k_gate_finite: the step's ok (gstate[2]) cleared where the last loss is NaN or inf, as the host's
    # check does (kernels.gate_finite); exact, every other entry untouched
    from andrea.cuda.kernels import gate_finite, k_gate_finite

    for loss in (1.5, 0.0, np.nan, np.inf, -np.inf):
        for ok in (1.0, 0.0):
            state = np.array([2.5, 0.75, ok, 3.0], dtype=np.float32)
            gs, dl = cp.asarray(state), cp.asarray(np.array([loss, 7.0], dtype=np.float32))
            k_gate_finite(dl, gs)
            gate_finite(loss, state)
            assert cp.asnumpy(gs).tobytes() == state.tobytes(), (loss, ok)
            assert state[2] == (ok if np.isfinite(loss) else 0.0)


@pytest.mark.parametrize("prec", ["fp32", "bf16", "fp16"])
def test_adamw_four_a_thread_is_bitwise_the_one_a_thread_kernel(be, prec):
    """k_adamw runs k_adamw4_* (16-byte accesses, the update's roundings pinned) on aligned buffers:
    the same w, m, v and compute copy as k_adamw_* to the bit, with the n_decay boundary inside a
    vector, a tail of n % 4, the clip scale applied, a skipped step (gstate says not finite), and a
    shard one float off alignment (which k_adamw hands to the one-a-thread kernel). bf16: the
    amax partials are the max |copy| of each ADAMW_CHUNK parameters (finite values)."""
    from andrea.cuda.kernels import ADAMW_CHUNK, SUFFIX, blocks, k_adamw
    from andrea.cuda.loader import kernel

    rng = np.random.default_rng(61)
    n, n_decay = 40_003, 20_002                        # n % 4 = 3; n_decay mid-vector
    g = cp.asarray(rng.normal(0, 1e-2, n + 1).astype(np.float32))
    w0, m0 = rng.normal(0, 1, n + 1).astype(np.float32), rng.normal(0, 1e-3, n + 1).astype(np.float32)
    v0 = np.abs(rng.normal(0, 1e-5, n + 1)).astype(np.float32)
    w0[901] = np.float32(3.4e38)                       # its 16-bit copy is inf: not in the amax
    hp = cp.asarray(be.adam_hyper(5, 3e-3, 0.9, 0.95, 1e-8, 0.1))
    low = np.float32 if prec == "fp32" else np.uint16
    for finite in (1.0, 0.0):
        gstate = cp.asarray(np.array([1.0, 0.37, finite, 0.0], np.float32))
        for off in (0, 1):                             # aligned, then a shard starting one float in
            runs = []
            for vec in (True, False):
                w, m, v = cp.asarray(w0), cp.asarray(m0), cp.asarray(v0)
                wl = cp.asarray(np.full(n + 1, 0x3F80, np.uint16) if low is np.uint16 else w0)
                lo = wl[off:off + n] if prec != "fp32" else np.uint64(0)
                args = (w[off:off + n], g[off:off + n], m[off:off + n], v[off:off + n], lo)
                part = cp.full(-(-n // ADAMW_CHUNK), np.nan, np.float32) if prec == "bf16" and off == 0 else None
                if vec:
                    k_adamw(prec, *args, n, hp, gstate, n_decay, 1, part=part)
                else:
                    kernel("optim.cu", f"k_adamw_{SUFFIX[prec]}")((blocks(n),), (256,), args + (
                        np.int64(n), hp, gstate, np.int64(n_decay), np.int32(1)))
                runs.append([cp.asnumpy(a).tobytes() for a in (w, m, v, wl)])
                if vec and part is not None:
                    bits = cp.asnumpy(wl[:n]).astype(np.uint32) << 16
                    vals = np.abs(bits.view(np.float32))
                    vals[~np.isfinite(vals)] = 0.0
                    pad = np.zeros(-(-n // ADAMW_CHUNK) * ADAMW_CHUNK, np.float32)
                    pad[:n] = vals
                    np.testing.assert_array_equal(cp.asnumpy(part), pad.reshape(-1, ADAMW_CHUNK).max(axis=1))
            assert runs[0] == runs[1], f"{prec} offset {off} finite {finite}: k_adamw differs from k_adamw_{SUFFIX[prec]}"
            assert (runs[0][0] != w0.tobytes()) == bool(finite)


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_cublas_gemm_matches_and_is_bitwise_repeatable(be, prec):
    rng = np.random.default_rng(8)
    M, K, N = 1024, 768, 3072
    A, A64 = to_dev(rng.normal(0, 1, (M, K)), prec)
    Bm, B64 = to_dev(rng.normal(0, 1, (K, N)), prec)
    blas = be.Blas()
    lt = be.LOWTYPE[prec]
    outs = []
    for _ in range(2):
        Cm = cp.zeros((M, N), np.float32)
        blas.mm(Cm, A, Bm, lowtype=lt)
        outs.append(cp.asnumpy(Cm))
    assert outs[0].tobytes() == outs[1].tobytes()
    close(outs[0], A64 @ B64, "fp32", scale=30.0, what="gemm")
    # beta = 1 accumulates; a transposed operand: C (K, N) += A.T (K, M) @ B2 (M, N)
    B2, B264 = to_dev(rng.normal(0, 1, (M, N)), prec)
    Ct = cp.ones((K, N), np.float32)
    blas.mm(Ct, A, B2, ta=True, beta=1.0, lowtype=lt)
    close(cp.asnumpy(Ct), 1.0 + A64.T @ B264, "fp32", scale=40.0, what="gemm ta beta=1")
    # and B transposed: C (M, K) = A (M, N') @ B3.T with B3 (K, N')
    B3, B364 = to_dev(rng.normal(0, 1, (K, K)), prec)
    Cb = cp.zeros((M, K), np.float32)
    blas.mm(Cb, A, B3, tb=True, lowtype=lt)
    close(cp.asnumpy(Cb), A64 @ B364.T, "fp32", scale=30.0, what="gemm tb")


@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_cublaslt_gemm_forms_match_and_are_bitwise_repeatable(be, prec):
    """cublaslt.Lt.mm (the bf16/fp16 engine's GEMMs): the engine's three forms (X W, dY W^T,
    X^T dY with an fp32 C and beta = 1), 16-bit and fp32 outputs, against the float64 product of
    the rounded inputs (tol 2e-2 of the largest |entry| of A B plus 16-bit output rounding), and
    the same bits on a repeat; then a row-strided operand and output (the padded logits)."""
    from andrea.cuda.cublaslt import Lt

    rng = np.random.default_rng(9)
    lt = Lt(cp.zeros(32 << 20, dtype=np.uint8))
    low = be.LOWTYPE[prec]
    M, K, N = 512, 256, 768
    A, A64 = to_dev(rng.normal(0, 1, (M, K)), prec)
    W, W64 = to_dev(rng.normal(0, 1, (K, N)), prec)
    out = empty((M, N), prec)
    runs = []
    for _ in range(2):
        lt.mm(out, A, W, lowtype=low)
        runs.append(cp.asnumpy(out))
    assert runs[0].tobytes() == runs[1].tobytes()
    close(from_dev(out, prec), A64 @ W64, prec, scale=20.0, what="X W")
    dY, dY64 = to_dev(rng.normal(0, 1, (M, N)), prec)
    dx = cp.full((M, K), np.nan, np.float32)
    lt.mm(dx, dY, W, tb=True, lowtype=low)
    close(cp.asnumpy(dx), dY64 @ W64.T, "fp32", scale=30.0, what="dY W^T")
    dW = cp.ones((K, N), np.float32)
    lt.mm(dW, A, dY, ta=True, beta=1.0, lowtype=low)
    close(cp.asnumpy(dW), 1.0 + A64.T @ dY64, "fp32", scale=25.0, what="X^T dY beta=1")
    # rows 64 elements wider than the matrix: logits (M, V) = X Wt^T into a padded buffer, and back
    V = 1001
    Wt, Wt64 = to_dev(rng.normal(0, 1, (V, K)), prec)
    pad = empty((M, V + 87), prec)
    lg = pad[:, :V]
    lt.mm(lg, A, Wt, tb=True, lowtype=low)
    got = from_dev(pad, prec)
    close(got[:, :V], A64 @ Wt64.T, prec, scale=20.0, what="padded X Wt^T")
    assert np.isnan(got[:, V:]).all(), "the padding columns were written"
    L64 = got[:, :V]
    dx2 = cp.full((M, K), np.nan, np.float32)
    lt.mm(dx2, lg, Wt, lowtype=low)
    close(cp.asnumpy(dx2), L64 @ Wt64, "fp32", scale=600.0, what="padded dlogits Wt")
    dwt = cp.zeros((V, K), np.float32)
    lt.mm(dwt, lg, A, ta=True, beta=1.0, lowtype=low)
    close(cp.asnumpy(dwt), L64.T @ A64, "fp32", scale=600.0, what="padded dlogits^T X")
    with pytest.raises(AndreaError, match="unit column stride"):
        lt.mm(out, A[:, ::2], W[::2], lowtype=low)


@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_cublaslt_no_workspace_entry_runs_without_one(be, prec):
    """A table entry "w0:i" (cublaslt.table_choice): the problem's candidates come from the heuristic asked for
    no workspace, its calls pass none, and the product matches the float64 one as the engine's X W does
    (test_cublaslt_gemm_forms_match_and_are_bitwise_repeatable's tolerance), the same bits on a repeat."""
    from andrea.cuda.cublaslt import Lt

    rng = np.random.default_rng(19)
    low = be.LOWTYPE[prec]
    M, K, N = 512, 256, 768
    A, A64 = to_dev(rng.normal(0, 1, (M, K)), prec)
    W, W64 = to_dev(rng.normal(0, 1, (K, N)), prec)
    lt = Lt(cp.zeros(32 << 20, dtype=np.uint8))
    out = empty((M, N), prec)
    lt.mm(out, A, W, lowtype=low)
    (pid,) = [plan[8] for plan in lt.plans16.values()]
    assert lt.plan_ws == {}
    lt0 = Lt(cp.zeros(32 << 20, dtype=np.uint8))
    lt0.prefer = {pid: "w0:0"}
    runs = []
    for _ in range(2):
        got = empty((M, N), prec)
        lt0.mm(got, A, W, lowtype=low)
        runs.append(cp.asnumpy(got))
    assert lt0.plan_ws == {pid: 0}
    assert runs[0].tobytes() == runs[1].tobytes()
    close(from_dev(cp.asarray(runs[0]), prec), A64 @ W64, prec, scale=20.0, what="X W, no workspace")


@pytest.mark.parametrize("prec", ["bf16", "fp32"])
def test_loss_pair_on_padded_rows(be, prec):
    """The loss kernels on the first V columns of rows padded to a multiple of 64 (the 16-bit
    engines' logits): the figures of the contiguous (N, V) copy (to fp32 rounding: a row's
    16-byte split, hence its summation order, follows its alignment), the padding untouched."""
    rng = np.random.default_rng(6)
    N, V, Vp = 48, 1001, 1024
    logits, _ = to_dev(rng.normal(0, 3, (N, V)), prec)
    tg = cp.asarray(rng.integers(0, V, N).astype(np.int32))
    pad = empty((N, Vp), prec)
    pad[:, :V] = logits
    res = []
    for lg in (logits, pad[:, :V]):
        lse, losses = cp.full(N, np.nan, np.float32), cp.full(N, np.nan, np.float32)
        be.k_loss_fwd(prec, lse, losses, lg, tg, N, V)
        be.k_loss_bwd(prec, lg, lg, tg, lse, 1.0 / N, N, V)
        res.append((cp.asnumpy(lse), cp.asnumpy(losses), cp.asnumpy(cp.ascontiguousarray(lg))))
    (lse0, loss0, d0), (lse1, loss1, d1) = res
    close(lse1, lse0, "fp32", what="lse")
    close(loss1, loss0, "fp32", what="losses")
    close(from_dev(cp.asarray(d1), prec), from_dev(cp.asarray(d0), prec), prec, scale=1.0 / N, what="dlogits")
    assert np.isnan(from_dev(pad[:, V:], prec)).all()
    with pytest.raises(AndreaError, match="row stride"):
        be.k_loss_bwd(prec, pad[:, :V], logits, tg, cp.zeros(N, np.float32), 1.0, N, V)


# The fused GELU of the cuBLASLt epilogues (the bf16/fp16 engine's MLP): both forms are compared with
# the float64 tanh-form GELU of the exact product of the rounded inputs (the NumPy twin below) and with
# the separate passes the engine ran before (GEMM, round to 16 bits, k_gelu_fwd / k_gelu_bwd).
# Tolerance, elementwise: |out - ref| <= 2e-3 + ULP[prec] |ref| (one 16-bit rounding of the output,
# ULP = 2^-8 bf16, 2^-10 fp16: half a unit in the last place, relative; the 2e-3 absolute covers the
# epilogue's own tanh, whose accuracy cuBLASLt does not document, and the fp32 accumulation). Against
# the separate passes 4e-3 + 3 ULP |ref|: they round the pre-activation first (an error gelu' <= 1.13
# times one ULP) and the output again; fused, gelu sees the fp32 accumulator.
FUSED_ULP = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -10}


def _gelu64(u, form="tanh"):
    """The NumPy twin of the epilogues: the recipe's tanh-form GELU (ops_numpy) and its derivative
    in float64; ``form="erf"`` the exact GELU, to tell the two apart."""
    if form == "erf":
        from math import erf, sqrt
        phi = 0.5 * (1 + np.vectorize(erf)(u / sqrt(2.0)))
        return u * phi, phi + u * np.exp(-0.5 * u * u) / np.sqrt(2 * np.pi)
    k, a = ops.GELU_K, ops.GELU_A
    th = np.tanh(k * (u + a * u ** 3))
    return 0.5 * u * (1 + th), 0.5 * (1 + th) + 0.5 * u * (1 - th ** 2) * k * (1 + 3 * a * u ** 2)


def _fused_close(out, ref, prec, atol, ulps, what):
    err = np.abs(np.asarray(out, np.float64) - ref)
    bound = atol + ulps * FUSED_ULP[prec] * np.abs(ref)
    assert np.isfinite(out).all(), f"{what}: non-finite output (an element left unwritten?)"
    assert float(np.max(err - bound)) <= 0, f"{what}: max err {float(err.max()):.3g}, max excess {float(np.max(err - bound)):.3g}"


@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_cublaslt_gelu_epilogues_match_numpy_and_the_separate_passes(be, prec):
    """GELU_AUX: h_act = gelu(x w_fc) and aux h_pre = x w_fc from one GEMM; DGELU: dh = (dout w_proj^T)
    * gelu'(h_pre) from one GEMM; the same bits on a repeat; the aux of another layer (another pointer,
    same plan) is honoured; outputs prefilled with NaN."""
    from andrea.cuda.cublaslt import EPILOGUE_DGELU, EPILOGUE_GELU_AUX, Lt

    rng = np.random.default_rng(19)
    lt = Lt(cp.zeros(32 << 20, dtype=np.uint8))
    low = be.LOWTYPE[prec]
    N, C = 512, 256
    F = 4 * C
    x, x64 = to_dev(rng.normal(0, 1, (N, C)), prec)
    w_fc, wfc64 = to_dev(rng.normal(0, 2.0 / np.sqrt(C), (C, F)), prec)     # pre-activations ~ N(0, 2^2)
    P = x64 @ wfc64
    g_ref, dg_ref = _gelu64(P)
    h_act, h_pre = empty((2, N, F), prec), empty((2, N, F), prec)            # two "layers" of one plan
    runs = []
    for layer in (0, 1, 0):
        lt.mm(h_act[layer], x, w_fc, lowtype=low, epilogue=EPILOGUE_GELU_AUX, aux=h_pre[layer])
        runs.append((cp.asnumpy(h_act[layer]).tobytes(), cp.asnumpy(h_pre[layer]).tobytes()))
    assert runs[0] == runs[1] == runs[2], "the fused forward's bits changed between calls or layers"
    got_act, got_pre = from_dev(h_act[0], prec), from_dev(h_pre[0], prec)
    close(got_pre, P, prec, scale=8.0, what="GELU_AUX aux = h_pre")
    _fused_close(got_act, g_ref, prec, 2e-3, 1, "GELU_AUX h_act vs the tanh-form twin")
    # the separate passes: GEMM -> 16-bit h_pre -> k_gelu_fwd
    sep_pre, sep_act = empty((N, F), prec), empty((N, F), prec)
    lt.mm(sep_pre, x, w_fc, lowtype=low)
    be.k_gelu_fwd(prec, sep_act, sep_pre, N * F)
    _fused_close(got_pre, from_dev(sep_pre, prec), prec, 1e-3, 2, "GELU_AUX's aux vs the plain GEMM")
    _fused_close(got_act, from_dev(sep_act, prec), prec, 4e-3, 3, "GELU_AUX vs GEMM + k_gelu_fwd")
    # DGELU: dh (N, F) = (dout (N, C) @ w_proj^T (C, F)) * gelu'(h_pre), h_pre the forward's aux
    dout, dout64 = to_dev(rng.normal(0, 1, (N, C)), prec)
    w_proj, wp64 = to_dev(rng.normal(0, 1.0 / np.sqrt(C), (F, C)), prec)
    dg_pre = _gelu64(got_pre)[1]                                            # at the saved (rounded) h_pre
    ref = (dout64 @ wp64.T) * dg_pre
    dh = empty((2, N, F), prec)
    for layer in (0, 1):
        lt.mm(dh[layer], dout, w_proj, tb=True, lowtype=low, epilogue=EPILOGUE_DGELU, aux=h_pre[layer])
    assert cp.asnumpy(dh[0]).tobytes() == cp.asnumpy(dh[1]).tobytes()
    got = from_dev(dh[0], prec)
    _fused_close(got, ref, prec, 2e-3, 1, "DGELU dh vs the twin")
    sep = empty((N, F), prec)
    lt.mm(sep, dout, w_proj, tb=True, lowtype=low)
    be.k_gelu_bwd(prec, sep, sep, h_pre[0], N * F)
    _fused_close(got, from_dev(sep, prec), prec, 4e-3, 3, "DGELU vs GEMM + k_gelu_bwd")
    with pytest.raises(AndreaError, match="aux matrix"):
        lt.mm(h_act[0], x, w_fc, lowtype=low, epilogue=EPILOGUE_GELU_AUX, aux=h_pre[0][:, :8])


@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_cublaslt_gelu_epilogue_is_the_tanh_form(be, prec):
    """cuBLASLt's documentation names no GELU formula: where the tanh and erf forms differ most
    (pre-activations in [-4, -1.5]: up to 4.7e-4, outputs small enough that 16-bit rounding is
    below 2e-4) the epilogue's mean error against the recipe's tanh form must be under a third of its
    mean error against the erf form."""
    from andrea.cuda.cublaslt import EPILOGUE_GELU_AUX, Lt

    rng = np.random.default_rng(23)
    lt = Lt(cp.zeros(32 << 20, dtype=np.uint8))
    N, C = 256, 64
    x, x64 = to_dev(rng.normal(0, 1, (N, C)), prec)
    w, w64 = to_dev(rng.normal(0, 2.0 / np.sqrt(C), (C, 4 * C)), prec)
    h, aux = empty((N, 4 * C), prec), empty((N, 4 * C), prec)
    lt.mm(h, x, w, lowtype=be.LOWTYPE[prec], epilogue=EPILOGUE_GELU_AUX, aux=aux)
    P = x64 @ w64
    sel = (P > -4.0) & (P < -1.5)
    assert sel.sum() > 1000
    got = from_dev(h, prec)[sel]
    e_tanh = float(np.mean(np.abs(got - _gelu64(P[sel])[0])))
    e_erf = float(np.mean(np.abs(got - _gelu64(P[sel], "erf")[0])))
    assert e_tanh < e_erf / 3, f"epilogue GELU: mean error {e_tanh:.3g} vs the tanh form, {e_erf:.3g} vs erf"
