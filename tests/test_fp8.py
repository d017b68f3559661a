"""The NumPy FP8 E4M3 twin (andrea/engine/fp8_numpy.py): every code decodes and re-encodes to
itself, ties round to even, saturation at 448, NaN for non-finite input, the current-scaling
recipe; and an independent check against torch's float8_e4m3fn cast where torch is installed.
The fp8 engine's plan and refusals, without a GPU. (The CUDA casts against this twin:
tests/test_fp8_gpu.py.)

    python -m pytest -q tests/test_fp8.py
"""

from __future__ import annotations

import numpy as np
import pytest

from andrea.engine import fp8_numpy as f8
from andrea.engine.model import ModelConfig
from andrea.errors import AndreaError

ALL = np.arange(256, dtype=np.uint8)
EMAX = np.float32(448.0)
FINITE = ALL[(ALL & 0x7F) != 0x7F]


def test_every_code_decodes_exactly_and_reencodes_to_itself():
    v = f8.decode(ALL)
    assert np.isnan(v[0x7F]) and np.isnan(v[0xFF])
    assert v[0x7E] == 448.0 and v[0xFE] == -448.0 and v[0x01] == 2.0 ** -9 and v[0x08] == 2.0 ** -6
    assert v[0x38] == 1.0 and v[0x39] == 1.125                    # exponent field 7 = 2**0
    np.testing.assert_array_equal(f8.encode(f8.decode(FINITE)), FINITE)
    pos = f8.decode(FINITE[FINITE < 0x80])
    assert np.all(np.diff(pos) > 0)                                # codes are ordered like their values


def test_rounding_is_to_nearest_with_ties_to_even():
    pos = f8.decode(np.arange(0, 0x7F, dtype=np.uint8)).astype(np.float64)
    mids = (pos[:-1] + pos[1:]) / 2                                # exact in float32 (one more bit)
    got = f8.encode(mids.astype(np.float32)).astype(np.int64)
    lo = np.arange(0, 0x7E)
    want = np.where(lo % 2 == 0, lo, lo + 1)                       # the even mantissa wins a tie
    np.testing.assert_array_equal(got, want)
    eps = np.float32(1e-3)
    np.testing.assert_array_equal(f8.encode((mids * (1 - 1e-3)).astype(np.float32)), lo)
    np.testing.assert_array_equal(f8.encode((mids * (1 + eps)).astype(np.float32)), lo + 1)


def test_saturation_sign_and_non_finite():
    big = np.array([448.0, 449.0, 463.9, 464.0, 500.0, 1e30], dtype=np.float32)
    np.testing.assert_array_equal(f8.encode(big), np.full(6, 0x7E, np.uint8))
    np.testing.assert_array_equal(f8.encode(-big), np.full(6, 0xFE, np.uint8))
    np.testing.assert_array_equal(f8.encode(np.array([np.nan, np.inf, -np.inf], np.float32)), [0x7F] * 3)
    np.testing.assert_array_equal(f8.encode(np.array([0.0, -0.0, 2.0 ** -11, -(2.0 ** -11)], np.float32)),
                                  [0x00, 0x80, 0x00, 0x80])        # below half the smallest subnormal: signed 0
    np.testing.assert_array_equal(f8.encode(np.array([3 * 2.0 ** -11], np.float32)), [0x01])   # 0.75 ulp rounds up


def test_current_scaling_maps_amax_to_448_and_bounds_the_error():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4096) * 3e-4).astype(np.float32)
    x[17] = np.inf                                                 # ignored by amax, cast to NaN
    q, inv = f8.quantize(x)
    fin = np.isfinite(x)
    am = np.abs(x[fin]).max()
    s, inv2 = f8.scale_of(am)
    assert inv == inv2 and s == np.float32(448.0) / np.float32(am)
    assert q[17] == 0x7F and (q[fin] & 0x7F).max() == 0x7E          # the largest entry lands on 448
    xh = f8.dequantize(q, inv)
    err = np.abs(xh[fin] - x[fin])
    assert np.all(err <= np.abs(x[fin]) / 16 + 2.0 ** -10 * inv * 1.0001)
    assert f8.scale_of(0.0) == (1.0, 1.0)
    z, zinv = f8.quantize(np.zeros(8, np.float32))
    assert not z.any() and zinv == 1.0


def test_delayed_cast_uses_the_given_scale_saturates_and_reports_its_amax():
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(2048) * 0.5).astype(np.float32)
    x[3], x[9] = np.nan, -np.inf
    q_cur, inv_cur = f8.quantize(x)
    s_cur, _ = f8.scale_of(f8.amax(x))
    q, am, clipped = f8.quantize_delayed(x, s_cur)             # the scale current scaling would take: same codes
    np.testing.assert_array_equal(q, q_cur)
    assert am == f8.amax(x) and not clipped and q[3] == 0x7F and q[9] == 0x7F
    small, _ = f8.scale_of(f8.amax(x) / 4)                      # a history 4x below this tensor's amax
    q, am, clipped = f8.quantize_delayed(x, small)
    fin = np.isfinite(x)
    y = np.clip(x[fin] * small, -EMAX, EMAX)
    np.testing.assert_array_equal(q[fin], f8.encode(y))         # what lies beyond 448 / scale lands on +-448
    assert clipped and np.count_nonzero((q[fin] & 0x7F) == 0x7E) >= np.count_nonzero(np.abs(x[fin]) * small > EMAX) > 0
    assert f8.quantize_delayed(np.zeros(8, np.float32), 1.0)[1:] == (0.0, False)


def test_amax_history_scales_are_scale_of_of_each_sites_max_bit_for_bit():
    # scales() is one array pass; it must give scale_of's (scale, inv) for every site, all-zero,
    # denormal, tiny and huge amaxes included (the kernels read these bits).
    rng = np.random.default_rng(7)
    h = f8.AmaxHistory(400, 4)
    for _ in range(4):
        am = np.exp(rng.uniform(-80, 80, 400)).astype(np.float32)
        am[:20] = 0.0
        am[20:40] = np.float32(1e-30) * rng.uniform(0.5, 2.0, 20).astype(np.float32)
        am[40:50] = np.float32(1e-42)
        h.push(am)
    h.hist[50] = 0.0
    scale, inv = h.scales()
    want = [f8.scale_of(m) for m in h.hist.max(axis=1)]
    assert scale.dtype == inv.dtype == np.float32 and scale.shape == inv.shape == (400,)
    assert scale.tobytes() == np.array([w[0] for w in want], np.float32).tobytes()
    assert inv.tobytes() == np.array([w[1] for w in want], np.float32).tobytes()


def test_amax_history_rule_ring_clip_count_and_state_round_trip():
    import json

    h = f8.AmaxHistory(2, 3)
    assert h.empty and h.push([2.0, 0.0]) == 0                  # the first step (current scaling) never clips
    scale, inv = h.scales()
    assert scale[0] == EMAX / np.float32(2.0) and scale[1] == 1.0 and inv[0] == np.float32(1) / scale[0]
    assert h.push([3.0, 1.0]) == 1                              # 3 * (448 / 2) > 448: site 0 clipped
    assert h.scales()[0][0] == EMAX / np.float32(3.0)           # ... and its scale follows the new amax
    for _ in range(2):
        h.push([1.0, 1.0])
    assert h.scales()[0][0] == EMAX / np.float32(3.0)           # 3 is still among the last 3 steps
    h.push([1.0, 1.0])
    assert h.scales()[0][0] == EMAX and h.steps == 5 and h.clipped_total == 1   # ... now it is out
    back = f8.AmaxHistory(2, 3)
    back.load(json.loads(json.dumps(h.state())))               # the run state is JSON (.state.json "engine")
    assert back.hist.tobytes() == h.hist.tobytes() and back.steps == 5 and back.clipped_total == 1
    assert all(a.tobytes() == b.tobytes() for a, b in zip(back.scales(), h.scales()))
    with pytest.raises(ValueError, match="history of shape"):
        f8.AmaxHistory(2, 4).load(h.state())
    with pytest.raises(ValueError, match="3 sites"):
        h.push([1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="at least 1"):
        f8.AmaxHistory(2, 0)


def test_gemm_reference_is_the_product_of_the_dequantized_operands():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((32, 48)).astype(np.float32), rng.standard_normal((16, 48)).astype(np.float32)
    (qa, ia), (qb, ib) = f8.quantize(a), f8.quantize(b)
    ref = f8.dequantize(qa, ia).astype(np.float64) @ f8.dequantize(qb, ib).astype(np.float64).T
    np.testing.assert_allclose(f8.gemm_nt(qa, ia, qb, ib), ref, rtol=1e-6, atol=1e-6)
    err = np.abs(f8.gemm_nt(qa, ia, qb, ib) - a.astype(np.float64) @ b.T.astype(np.float64))
    # each operand within 1/16 relative (+ the subnormal floor): |err| <= sum |a||b| (1/16 + 1/16 + 1/256) + floor
    bound = (np.abs(a).astype(np.float64) @ np.abs(b).T.astype(np.float64)) * (33 / 256) + 48 * 2.0 ** -9 * 8
    assert np.all(err <= bound) and err.max() > 0


def test_bf16_payloads_widen_exactly():
    bits = np.array([0x3F80, 0xBF80, 0x7F80, 0x0001], np.uint16)
    np.testing.assert_array_equal(f8.bf16_to_f32(bits)[:2], [1.0, -1.0])
    assert np.isinf(f8.bf16_to_f32(bits)[2]) and f8.bf16_to_f32(bits)[3] > 0


def test_agrees_with_torch_float8_e4m3fn_where_torch_is_installed():
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    rng = np.random.default_rng(2)
    y = np.concatenate([rng.uniform(-448, 448, 20000), rng.standard_normal(20000) * 1e-2,
                        rng.standard_normal(5000) * 2.0 ** -8]).astype(np.float32)
    ref = torch.from_numpy(y).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(f8.encode(y), ref)


def test_fp8_engine_plan_and_refusals_without_a_gpu():
    from andrea.cuda.engine import GpuEngine, arena_layout
    from andrea.memory import plan_items

    mc = ModelConfig(vocab_size=97, d_model=64, n_head=2, n_layer=2, context=128)
    a8, a16 = arena_layout(mc, 2, "fp8"), arena_layout(mc, 2, "bf16")
    names = {s[0] for s in a8.spec}
    assert {"w8", "f8_a", "f8_at", "f8_g", "f8_gt", "f8_part", "f8_inv", "lt_ws"} <= names
    assert a8.nbytes > a16.nbytes and sum(plan_items(mc, 2, "fp8").values()) == a8.nbytes
    w8 = dict((s[0], s[1]) for s in a8.spec)["w8"][0]
    n_mm = 2 * (64 * 192 + 64 * 64 + 64 * 256 + 256 * 64)
    assert w8 == 2 * n_mm                                          # both orientations of every matmul weight
    with pytest.raises(AndreaError, match="multiples of 64"):
        GpuEngine(object(), ModelConfig(97, 48, 2, 2, 128), 2, precision="fp8")
    with pytest.raises(AndreaError, match="fp32 | bf16 | fp16 | fp8"):
        GpuEngine(object(), mc, 2, precision="fp4")
    with pytest.raises(AndreaError, match="fp32 only"):
        plan_items(mc, 1, "fp8", "numpy")
    from andrea.cuda.fp8 import require_fp8

    require_fp8("90"), require_fp8("89")
    with pytest.raises(AndreaError, match="sm_80: use train.precision=bf16"):
        require_fp8("80")


# ----------------------------------------------------------------------------- the GEMM path's orientations
class _Dev(np.ndarray):
    """A host array with CuPy's ``.data.ptr``: Fp8Gemm's bookkeeping runs on it unchanged."""

    @property
    def data(self):
        from types import SimpleNamespace

        return SimpleNamespace(ptr=self.__array_interface__["data"][0])

    def get(self, stream=None):
        return np.array(self)

    def set(self, arr, stream=None):
        self[...] = arr


def _dev(x):
    return np.ascontiguousarray(x).view(_Dev)


def _gelu64(u):
    """The recipe's tanh-form GELU and its derivative in float64 (the epilogues' twin)."""
    from andrea.engine import ops_numpy as ops

    u = np.asarray(u, np.float64)
    th = np.tanh(ops.GELU_K * (u + ops.GELU_A * u ** 3))
    return 0.5 * u * (1 + th), 0.5 * (1 + th) + 0.5 * u * (1 - th ** 2) * ops.GELU_K * (1 + 3 * ops.GELU_A * u ** 2)


def test_fp8_gemm_path_orients_every_operand_like_numpy(monkeypatch):
    """Fp8Gemm.mm (the fp8 engine's _mm) with the casts and cuBLASLt replaced by the NumPy twin:
    X W, dY W^T then X^T dY (reusing dY's cast), and the tied head passed to bf16 Blas, against
    NumPy of the dequantized operands. Checks the orientations and the dY reuse, not the kernels
    (tests/test_fp8_gpu.py does those)."""
    from types import SimpleNamespace

    import andrea.cuda.fp8 as k8
    from andrea.cuda.cublaslt import CUDA_R_32F, EPILOGUE_DEFAULT, EPILOGUE_DGELU, EPILOGUE_GELU_AUX

    casts = []

    def quantize(out, out_t, x, part, inv, R=None, C=None, scale=None, rec=None, hp=None):
        assert scale is None and rec is None and hp is None    # current scaling
        q, iv = f8.quantize(f8.bf16_to_f32(np.asarray(x)))
        casts.append(x.data.ptr)
        inv[0] = iv
        if out is not None:
            out.reshape(-1)[:] = q.reshape(-1)
        if out_t is not None:
            out_t[:] = q.reshape(R, C).T

    inv_arr = _dev(np.zeros(k8.SLOT * 4, np.float32))

    def inv_at(ptr):
        return inv_arr[(ptr - inv_arr.data.ptr) // 4]

    trunc = lambda v: (np.asarray(v, np.float32).view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731 (enough here)

    def mm_nt(D, X8, Y8, x_inv, y_inv, M, N, K, d_type, beta=0.0, fast_accum=False, epilogue=EPILOGUE_DEFAULT,
              stream=0, aux=None):
        assert X8.shape == (M, K) and Y8.shape == (N, K)
        ref = f8.gemm_nt(X8, inv_at(x_inv), Y8, inv_at(y_inv))
        if epilogue == EPILOGUE_GELU_AUX:                      # the epilogues' contract, in the recipe's GELU
            aux[:], D[:] = trunc(ref), trunc(_gelu64(ref)[0])
        elif epilogue == EPILOGUE_DGELU:
            D[:] = trunc(ref * _gelu64(f8.bf16_to_f32(np.asarray(aux)))[1])
        elif d_type == CUDA_R_32F:
            D[:] = ref + (D if beta else 0)
        else:
            D[:] = trunc(ref)

    monkeypatch.setattr(k8, "quantize", quantize)
    rng = np.random.default_rng(3)
    N, C = 128, 64
    bf = lambda shape, s=1.0: _dev((rng.standard_normal(shape).astype(np.float32) * s).view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731
    W = _dev(bf((C, 4 * C)))
    head = _dev(bf((96, C)))
    a = {"w8": _dev(np.zeros(4 * 256 * 64 * 4, np.uint8)), "f8_part": _dev(np.zeros(k8.AMAX_BLOCKS, np.float32)),
         "f8_cur": _dev(np.zeros(1, np.float32)),
         "f8_inv": inv_arr, **{k: _dev(np.zeros(N * 4 * C, np.uint8)) for k in ("f8_a", "f8_at", "f8_g", "f8_gt")}}
    layout = SimpleNamespace(tensors=[SimpleNamespace(name="h.0.mlp.w_fc", size=W.size)])
    plan, _ = k8.weight_plan(layout, ("mlp.w_fc",))
    bf16_calls = []
    blas = SimpleNamespace(mm=lambda *a_, **k: pytest.fail("fp8 gemm: the bf16 head goes to cuBLASLt, not cuBLAS"))
    lt = SimpleNamespace(mm_nt=mm_nt, mm=lambda *a_, **k: bf16_calls.append(k))
    g = k8.Fp8Gemm(a, {"h.0.mlp.w_fc": W}, plan, {head.data.ptr}, blas, lt=lt)
    g._stream = lambda: 0
    g.cast_weights()
    dq = lambda x: f8.dequantize(*f8.quantize(f8.bf16_to_f32(np.asarray(x)))).astype(np.float64)  # noqa: E731
    widen = lambda d: f8.bf16_to_f32(np.asarray(d)).astype(np.float64)  # noqa: E731
    X, dY = _dev(bf((N, C))), _dev(bf((N, 4 * C), 1e-3))
    out = _dev(np.zeros((N, 4 * C), np.uint16))
    g.mm(out, X, W)
    np.testing.assert_allclose(widen(out), dq(X) @ dq(W), rtol=2 ** -7, atol=1e-6)
    dX, dW = _dev(np.zeros((N, C), np.uint16)), _dev(np.full((C, 4 * C), 0.5, np.float32))
    casts.clear()
    g.mm(dX, dY, W, tb=True)
    g.mm(dW, X, dY, ta=True, beta=1.0)
    assert casts == [dY.data.ptr, X.data.ptr]                  # dY cast once for both GEMMs
    np.testing.assert_allclose(widen(dX), dq(dY) @ dq(W).T, rtol=2 ** -7, atol=1e-9)
    np.testing.assert_allclose(np.asarray(dW), dq(X).T @ dq(dY) + 0.5, rtol=1e-6, atol=1e-9)
    g.mm(out[:, :96], X, head, tb=True)                        # the head (its weight in bf16_ptrs) stays bf16
    assert len(bf16_calls) == 1 and bf16_calls[0]["stream"] == 0  # on cuBLASLt, on the engine's stream
    casts.clear()
    g.mm(dW, X, dY, ta=True, beta=1.0)                         # a reuse lasts one call only: cast afresh
    assert casts == [X.data.ptr, dY.data.ptr]
    # the fused GELU (engine FUSE_GELU_FP8): the fc forward and the proj dgrad forms, nowhere else
    h_pre = _dev(np.zeros((N, 4 * C), np.uint16))
    g.mm(out, X, W, epilogue=EPILOGUE_GELU_AUX, aux=h_pre)
    P = dq(X) @ dq(W)
    np.testing.assert_allclose(widen(h_pre), P, rtol=2 ** -7, atol=1e-6)
    np.testing.assert_allclose(widen(out), _gelu64(P)[0], rtol=2 ** -6, atol=1e-6)
    g.mm(dX, dY, W, tb=True)
    plain = widen(dX)
    dh = _dev(np.zeros((N, C), np.uint16))
    g.mm(dh, dY, W, tb=True, epilogue=EPILOGUE_DGELU, aux=_dev(np.asarray(h_pre)[:, :C]))
    np.testing.assert_allclose(widen(dh), plain * _gelu64(widen(h_pre)[:, :C])[1], rtol=2 ** -6, atol=1e-9)
    casts.clear()
    for bad in ((dW, X, dY, True, False), (out[:, :96], X, head, False, True)):   # wgrad, the bf16 head
        with pytest.raises(AndreaError, match="epilogue 160 only on X W or dY W"):
            g.mm(bad[0], bad[1], bad[2], ta=bad[3], tb=bad[4], epilogue=EPILOGUE_GELU_AUX, aux=h_pre)
    assert casts == [] and len(bf16_calls) == 1                # refused before any cast or GEMM


def _twin_fp8_gemm(monkeypatch, seed: int, saved: bool = False):
    """An Fp8Gemm with train.fp8_scaling=delayed (3 cast sites, history 4) over one (C, 4C) weight, its
    casts replaced by the NumPy twin. ``saved``: with the kept transposes (``f8_saved``). Returns
    (g, calls, cur, inv_arr, plan, tensors): each cast appends (tensor pointer, site, its delayed scale
    or None) to ``calls``; tensors = (X, dY, W, out, dX, dW): bf16 X (N, C), dY (N, 4C), the weight and the outputs."""
    from types import SimpleNamespace

    import andrea.cuda.fp8 as k8

    calls = []

    def quantize(out, out_t, x, part, inv, R=None, C=None, scale=None, rec=None, hp=None):
        assert hp is None
        xf = f8.bf16_to_f32(np.asarray(x))
        if scale is None:
            q, iv = f8.quantize(xf)
            inv[0] = iv
        else:
            q, _, _ = f8.quantize_delayed(xf, scale[0])
        rec[0] = max(rec[0], f8.amax(xf))
        calls.append((x.data.ptr, (rec.data.ptr - cur.data.ptr) // 4, None if scale is None else float(scale[0])))
        if out is not None:
            out.reshape(-1)[:] = q.reshape(-1)
        if out_t is not None:
            out_t[:] = q.reshape(R, C).T

    monkeypatch.setattr(k8, "quantize", quantize)
    monkeypatch.setattr(k8, "k_fp8_t_u8", lambda x8, out_t, R, C, am, rec: out_t.__setitem__(
        slice(None), np.asarray(x8).reshape(R, C).T))
    rng = np.random.default_rng(seed)
    N, C = 128, 64
    bf = lambda shape, s=1.0: _dev((rng.standard_normal(shape).astype(np.float32) * s).view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731
    W = _dev(bf((C, 4 * C)))
    layout = SimpleNamespace(tensors=[SimpleNamespace(name="h.0.mlp.w_fc", size=W.size)])
    plan, _ = k8.weight_plan(layout, ("mlp.w_fc",))
    n_sites = 3
    cur = _dev(np.zeros(n_sites, np.float32))
    inv_arr = _dev(np.zeros(k8.SLOT * (k8.n_slots(plan) + n_sites + (2 if saved else 0)), np.float32))
    a = {"w8": _dev(np.zeros(2 * 256 * 64 * 4, np.uint8)), "f8_part": _dev(np.zeros(k8.AMAX_BLOCKS, np.float32)),
         "f8_inv": inv_arr, "f8_cur": cur, **{k: _dev(np.zeros(N * 4 * C, np.uint8)) for k in ("f8_a", "f8_at", "f8_g", "f8_gt")}}
    if saved:
        a["f8_saved"] = _dev(np.zeros(N * C, np.uint8))
    lt = SimpleNamespace(mm_nt=lambda *a_, **k: None, mm=lambda *a_, **k: None)
    g = k8.Fp8Gemm(a, {"h.0.mlp.w_fc": W}, plan, set(), None, lt=lt, scaling="delayed", n_sites=n_sites, history=4)
    g._stream = lambda: 0
    X, dY = _dev(bf((N, C))), _dev(bf((N, 4 * C), 1e-3))
    out, dX, dW = (_dev(np.zeros((N, 4 * C), np.uint16)), _dev(np.zeros((N, C), np.uint16)),
                   _dev(np.zeros((C, 4 * C), np.float32)))
    return g, calls, cur, inv_arr, plan, (X, dY, W, out, dX, dW)


def test_delayed_scaling_numbers_sites_in_call_order_and_keeps_them_with_the_memo_off(monkeypatch):
    """Fp8Gemm with train.fp8_scaling=delayed, the casts replaced by the twin: the first step casts
    with current scaling and records each site's amax; after ``after_step`` every cast of the same
    call sequence reads its site's scale (448 / history max) and records again; a gradient reused
    by the next call keeps its site whether its bytes are reused (memo) or cast again."""
    import andrea.cuda.fp8 as k8

    g, calls, cur, inv_arr, plan, (X, dY, W, out, dX, dW) = _twin_fp8_gemm(monkeypatch, 8)
    n_sites = 3

    def step():
        calls.clear()
        g.reset_amax()
        g.begin()
        g.mm(out, X, W)                      # site 0: X
        g.mm(dX, dY, W, tb=True)             # site 1: dY (both orientations)
        g.mm(dW, X, dY, ta=True, beta=1.0)   # site 2: X^T; dY reused at site 1
        g.check_pass()
        return list(calls)

    assert g.calibrating
    first = step()
    assert [(p, s) for p, s, _ in first] == [(X.data.ptr, 0), (dY.data.ptr, 1), (X.data.ptr, 2)]
    assert all(sc is None for _, _, sc in first)                # no history yet: current scaling
    amaxes = [f8.amax(f8.bf16_to_f32(np.asarray(t))) for t in (X, dY, X)]
    np.testing.assert_array_equal(np.asarray(cur), amaxes)
    assert g.after_step(None) == 0 and not g.calibrating
    second = step()
    want = [float(f8.scale_of(m)[0]) for m in amaxes]
    assert [(s, sc) for _, s, sc in second] == list(zip(range(3), want))   # delayed: the history's scales
    for s, m in enumerate(amaxes):                              # inv (what cuBLASLt reads) is the slot's first float
        slot = k8.n_slots(plan) + s
        assert inv_arr[k8.SLOT * slot] == f8.scale_of(m)[1] and inv_arr[k8.SLOT * slot + 1] == f8.scale_of(m)[0]
    g.memo_enabled = False
    third = step()
    assert [(p, s) for p, s, _ in third] == [(X.data.ptr, 0), (dY.data.ptr, 1), (X.data.ptr, 2), (dY.data.ptr, 1)]
    g.begin()
    g.site = n_sites
    with pytest.raises(AndreaError, match="more than the 3 planned cast sites"):
        g.mm(out, X, W)
    g.site = 2
    with pytest.raises(AndreaError, match="cast 2 activation/gradient tensors"):
        g.check_pass()


@pytest.mark.parametrize("wgrad_first,transposes", [(False, False), (True, False), (True, True)])
def test_a_gradient_written_by_its_producer_takes_the_site_its_cast_would(wgrad_first, transposes, monkeypatch):
    """fp8.ATTN_E4M3 / LNB_E4M3's bookkeeping (Fp8Gemm.produce_grad), the casts replaced by the twin:
    with delayed scaling, the kept transposes and a history, dY written by its producer before its two
    GEMMs takes the site (its scale and amax slot) that the cast of dY takes without it, in either GEMM
    order (the attention-out and MLP-proj backwards run dX first, the QKV backward dW first, whose kept
    X^T takes its shadow site before dY's); the other sites and the pass's count are unchanged, and
    nothing casts dY. ``transposes`` (fp8.ATTN_BWD_T): the producer writes dY^T too, into the buffer the
    byte transpose would fill, and no byte transpose runs."""
    import andrea.cuda.fp8 as k8

    g, calls, cur, _, _, (X, dY, W, out, dX, dW) = _twin_fp8_gemm(monkeypatch, 5, saved=True)
    n_sites, produced, transposed = 3, [], []
    t_u8 = k8.k_fp8_t_u8
    monkeypatch.setattr(k8, "k_fp8_t_u8", lambda *a: (transposed.append(a[2:4]), t_u8(*a)))

    def write(nat, *rest):                               # the producer: dY at the site's scale, its amax
        tr, scale, rec = rest if transposes else (None, *rest)
        yf = f8.bf16_to_f32(np.asarray(dY))
        q = f8.quantize_delayed(yf, scale[0])[0]
        nat.reshape(-1)[:] = q.reshape(-1)
        if tr is not None:
            assert tr.shape == dY.shape[::-1]
            tr[:] = q.reshape(dY.shape).T
        rec[0] = max(rec[0], f8.amax(yf))
        produced.append((rec.data.ptr - cur.data.ptr) // 4)

    def step(produce):
        calls.clear()
        g.reset_amax()
        g.begin()
        g.mm(out, X, W)                                  # site 0: X, its transpose kept
        if produce:
            assert g.grad_e4m3(True) and not g.grad_e4m3(False)
            transposed.clear()
            g.produce_grad(dY, write, after_shadow=wgrad_first, transposes=transposes)
            assert transposed == ([] if transposes else [dY.shape])
            tr = g._memo[(dY.data.ptr, dY.shape)][1]
            np.testing.assert_array_equal(tr, np.asarray(g._memo[(dY.data.ptr, dY.shape)][0]).T)
        gemms = [lambda: g.mm(dX, dY, W, tb=True), lambda: g.mm(dW, X, dY, ta=True, beta=1.0)]
        for gemm in (gemms[::-1] if wgrad_first else gemms):
            gemm()
        g.check_pass()
        return list(calls), g.site

    step(False)                                          # no history yet: current scaling, nothing produced
    g.after_step(None)
    cast, n_cast = step(False)
    g.after_step(None)
    dy_site = [s for p, s, _ in cast if p == dY.data.ptr]
    assert dy_site == [2 if wgrad_first else 1] and n_cast == n_sites
    rest, n_rest = step(True)
    assert produced == dy_site and n_rest == n_sites
    assert [(p, s) for p, s, _ in rest] == [(p, s) for p, s, _ in cast if p != dY.data.ptr]   # nothing casts dY


def test_fp8_scaling_params_are_optional_validated_and_logged(tmp_path):
    """train.fp8_scaling / train.fp8_amax_history: optional (delayed, 16), checked by the schema;
    an engine reporting fp8_clipped_total (fp8 delayed) gets it into every .loss.json train record,
    and an engine without it (every other one) leaves the records as they were."""
    import json
    import sys
    from pathlib import Path

    from rich.console import Console

    from andrea.errors import ConfigError
    from andrea.settings import Settings
    from andrea.train import Trainer

    sys.path.insert(0, str(Path(__file__).parent))
    from train_helpers import make_data, micro_cfg

    tc = Settings.from_dict(micro_cfg(2, 2)).train
    assert (tc.fp8_scaling, tc.fp8_amax_history) == ("delayed", 16)     # the default: docs/FP8.md says why
    tc = Settings.from_dict(micro_cfg(2, 2, **{"train.fp8_scaling": "current", "train.fp8_amax_history": 4})).train
    assert (tc.fp8_scaling, tc.fp8_amax_history) == ("current", 4)
    with pytest.raises(ConfigError, match="fp8_scaling"):
        micro_cfg(2, 2, **{"train.fp8_scaling": "lagged"})
    with pytest.raises(ConfigError, match="fp8_amax_history"):
        micro_cfg(2, 2, **{"train.fp8_amax_history": 0})
    tok, tokens = make_data(tmp_path / "data")
    for clipped in (None, 3):
        out = tmp_path / f"run{clipped}"
        tr = Trainer(micro_cfg(2, 2), "warmup", tok, tokens, out, console=Console(stderr=True, force_terminal=False))
        if clipped is not None:
            tr.engine.fp8_clipped_total = clipped
        assert tr.run() == 0
        recs = json.loads((out / "model.loss.json").read_text())["train"]
        assert recs and all(r.get("fp8_clipped") == clipped for r in recs)
        assert all(("fp8_clipped" in r) == (clipped is not None) for r in recs)


def test_an_amax_equal_to_its_history_does_not_count_as_clipped():
    # fl(448 / a) * a > 448 in fp32 for about one a in eleven (1.1485 is one): the same amax on the
    # next step maps onto 448 and loses nothing, so only an amax above the history's max counts
    a = np.float32(1.1485)
    assert np.float32(a * (np.float32(EMAX) / a)) > np.float32(EMAX)
    h = f8.AmaxHistory(3, 4)
    h.push([a, 0.0, 5.0])
    assert h.push([a, 448.0, 5.0]) == 0                         # site 1 (scale 1) holds 448 itself
    assert h.push([np.nextafter(a, np.float32(2)), np.float32(449.0), np.nan]) == 3
    assert h.clipped_total == 3


# ----------------------------------------------------------------------------- what a step casts, and when
def _twin_quantize(log):
    """Fp8Gemm's ``quantize`` as the NumPy twin (both scalings, the GELU-backward input ``hp``, bf16 or
    E4M3), logging (source ptr, site or None, had hp, wrote the natural copy, wrote the transpose)."""
    import andrea.cuda.fp8 as k8
    from andrea.engine import ops_numpy as ops

    def quantize(out, out_t, x, part, inv, R=None, C=None, scale=None, rec=None, hp=None):
        xf = f8.bf16_to_f32(np.asarray(x))
        if hp is not None:                                     # bf16(dL/dh_act * gelu'(h_pre)), as k_gelu_bwd
            log.setdefault("hp", []).append(hp.dtype)          # uint8: E4M3 at HPRE_SCALE (HPRE_E4M3)
            u = (f8.hpre_values(np.asarray(hp), k8.HPRE_SCALE) if hp.dtype == np.uint8
                 else f8.bf16_to_f32(np.asarray(hp))).astype(np.float64)
            th = np.tanh(ops.GELU_K * (u + ops.GELU_A * u ** 3))
            d = xf * (0.5 * (1 + th) + 0.5 * u * (1 - th ** 2) * ops.GELU_K * (1 + 3 * ops.GELU_A * u ** 2))
            xf = f8.bf16_to_f32((d.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
        if scale is None:
            q, iv = f8.quantize(xf)
            inv[0] = iv
        else:
            q, _, _ = f8.quantize_delayed(xf, scale[0])
        site = None
        if rec is not None:
            rec[0] = max(rec[0], f8.amax(xf))
            site = (rec.data.ptr - log["cur"].data.ptr) // 4
        log["calls"].append((x.data.ptr, site, hp is not None, out is not None, out_t is not None))
        if out is not None:
            out.reshape(-1)[:] = q.reshape(-1)
        if out_t is not None:
            out_t[:] = q.reshape(R, C).T
    return quantize


def _gemm_rig(monkeypatch, scaling, saved, n_sites=3, seed=8):
    """An Fp8Gemm over host arrays (twin casts) whose mm_nt records the E4M3 operands and factors
    it is given; ``saved``: the arena has f8_saved (SAVE_TRANSPOSES)."""
    from types import SimpleNamespace

    import andrea.cuda.fp8 as k8

    rng = np.random.default_rng(seed)
    N, C = 128, 64
    bf = lambda shape, s=1.0: _dev((rng.standard_normal(shape).astype(np.float32) * s).view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731
    W = _dev(bf((C, 4 * C)))
    layout = SimpleNamespace(tensors=[SimpleNamespace(name="h.0.mlp.w_fc", size=W.size)])
    plan, _ = k8.weight_plan(layout, ("mlp.w_fc",))
    cur = _dev(np.zeros(n_sites, np.float32))
    log = {"cur": cur, "calls": [], "gemms": []}
    monkeypatch.setattr(k8, "quantize", _twin_quantize(log))
    inv_arr = _dev(np.zeros(k8.SLOT * (k8.n_slots(plan) + n_sites + 4), np.float32))
    a = {"w8": _dev(np.zeros(2 * 256 * 64 * 4, np.uint8)), "f8_part": _dev(np.zeros(k8.AMAX_BLOCKS, np.float32)),
         "f8_inv": inv_arr, "f8_cur": cur, **{k: _dev(np.zeros(N * 4 * C, np.uint8)) for k in ("f8_a", "f8_at", "f8_g", "f8_gt")}}
    if saved:
        a["f8_saved"] = _dev(np.zeros(4 * N * 4 * C, np.uint8))

    def mm_nt(D, X8, Y8, x_inv, y_inv, *rest, **kw):
        val = lambda p: float(inv_arr[(p - inv_arr.data.ptr) // 4])  # noqa: E731
        log["gemms"].append((np.array(X8), val(x_inv), np.array(Y8), val(y_inv)))

    lt = SimpleNamespace(mm_nt=mm_nt, mm=lambda *a_, **k: None)
    g = k8.Fp8Gemm(a, {"h.0.mlp.w_fc": W}, plan, set(), None, lt=lt, scaling=scaling, n_sites=n_sites, history=4)
    g._stream = lambda: 0
    X, dY, H = _dev(bf((N, C))), _dev(bf((N, 4 * C), 1e-3)), _dev(bf((N, 4 * C)))
    return g, log, W, X, dY, H


def _same_gemms(a, b):
    assert len(a) == len(b)
    for (x, xi, y, yi), (x2, xi2, y2, yi2) in zip(a, b):
        np.testing.assert_array_equal(x, x2)
        np.testing.assert_array_equal(y, y2)
        assert (xi, yi) == (xi2, yi2)


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_saved_transposes_give_the_weight_gradient_the_same_operands_and_sites(monkeypatch, scaling):
    """SAVE_TRANSPOSES: the forward casts X in both orientations and the weight gradient X^T dY takes
    the kept X^T instead of casting X again. Every GEMM gets the same E4M3 bytes and factors as
    casting where needed (two steps, so delayed scaling reads its history); delayed scaling keeps
    the site numbering, the weight gradient's site taking the forward site's amax. A transpose the
    backward does not take is refused; an evaluation forward keeps none."""
    runs = {}
    for saved in (False, True):
        g, log, W, X, dY, _ = _gemm_rig(monkeypatch, scaling, saved)
        out, dX, dW = (_dev(np.zeros((128, 256), np.uint16)), _dev(np.zeros((128, 64), np.uint16)),
                       _dev(np.zeros((64, 256), np.float32)))
        hist = []
        for _ in range(2):
            g.reset_amax()
            g.begin()
            g.mm(out, X, W)                      # site 0: X (and, saved, X^T)
            g.mm(dX, dY, W, tb=True)             # site 1: dY
            g.mm(dW, X, dY, ta=True, beta=1.0)   # site 2: X^T, cast or taken
            g.check_pass()
            if g.hist is not None:
                g.after_step(None)
                hist.append(np.array(g.hist.state()["amax_history"]))
        runs[saved] = (log, hist)
    (plain, h0), (kept, h1) = runs[False], runs[True]
    _same_gemms(plain["gemms"], kept["gemms"])
    for a, b in zip(h0, h1):
        np.testing.assert_array_equal(a, b)
    x_ptr = X.data.ptr
    assert [c[0] for c in kept["calls"]][:2] == [x_ptr, dY.data.ptr] and len(kept["calls"]) == 4   # X cast once a step
    assert kept["calls"][0][3:] == (True, True)                # both orientations in the forward
    if scaling == "delayed":
        assert [c[1] for c in plain["calls"][3:]] == [0, 1, 2] and [c[1] for c in kept["calls"][2:]] == [0, 1]
        assert g._shadow == [(2, 0)]
    g.begin()
    g.mm(out, X, W)
    g.site = g.n_sites
    with pytest.raises(AndreaError, match="1 saved activation transposes were not used"):
        g.check_pass()
    kept["calls"].clear()
    g.begin(backward=False)                                    # evaluation: natural copy only
    g.mm(out, X, W)
    assert kept["calls"][0][3:] == (True, False) and not g._saved


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_deferred_gelu_backward_cast_equals_casting_the_bf16_gradient(monkeypatch, scaling):
    """DGELU_CAST: ``defer_dgelu(dh, h_pre)`` makes the next GEMM cast bf16(dh * gelu'(h_pre)) from
    dh and h_pre (one cast, both orientations, dh left as it is) and the GEMM after it reuse that cast:
    the same operands, factors and sites as writing dL/dh_pre in bf16 first (k_gelu_bwd) and casting
    it. An unused deferral and a deferral with the reuse off are refused."""
    from andrea.engine import ops_numpy as ops

    got = {}
    for deferred in (False, True):
        g, log, W, X, dY, H = _gemm_rig(monkeypatch, scaling, False, n_sites=2)
        dh, dX, dW = _dev(np.array(dY)), _dev(np.zeros((128, 64), np.uint16)), _dev(np.zeros((64, 256), np.float32))
        Wt = _dev(np.ascontiguousarray(np.asarray(W)))
        g.begin()
        if deferred:
            g.defer_dgelu(dh, H)
        else:                                                  # the bf16 pass it replaces
            u = f8.bf16_to_f32(np.asarray(H)).astype(np.float64)
            th = np.tanh(ops.GELU_K * (u + ops.GELU_A * u ** 3))
            d = f8.bf16_to_f32(np.asarray(dh)) * (0.5 * (1 + th) + 0.5 * u * (1 - th ** 2) * ops.GELU_K
                                                  * (1 + 3 * ops.GELU_A * u ** 2))
            dh[...] = (d.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        g.mm(dW, X, dh, ta=True, beta=1.0)                     # fc wgrad: X^T, then dh (site 1)
        g.mm(dX, dh, Wt, tb=True)                              # fc dgrad: dh reused
        got[deferred] = log
        if deferred:
            np.testing.assert_array_equal(np.asarray(dh), np.asarray(dY))     # dL/dh_act untouched
            assert [c[2] for c in log["calls"]] == [False, True] and len(log["calls"]) == 2
    _same_gemms(got[False]["gemms"], got[True]["gemms"])
    assert [c[1] for c in got[False]["calls"]] == [c[1] for c in got[True]["calls"]]
    g.begin()
    g.defer_dgelu(dh, H)
    with pytest.raises(AndreaError, match="deferred GELU-backward cast"):
        g.mm(dX, dY, Wt, tb=True)                              # a GEMM on another gradient
    g.memo_enabled = False
    with pytest.raises(AndreaError, match="needs the cast reuse"):
        g.defer_dgelu(dh, H)


def test_weight_table_casts_every_weight_like_casting_them_one_by_one(monkeypatch):
    """``weight_table`` and the twin of its two launches (fp8_numpy.cast_weights_table, block by block
    as k_fp8_wamax / k_fp8_wcast split the work) give the same w8 and factors as the weight-by-weight
    casts; every block lands inside its weight; a misaligned weight is refused."""
    from types import SimpleNamespace

    import andrea.cuda.fp8 as k8

    rng = np.random.default_rng(5)
    shapes = [("h.0.attn.w_qkv", (64, 192)), ("h.0.attn.w_o", (64, 64)), ("h.0.mlp.w_fc", (128, 512)),
              ("h.0.mlp.w_proj", (512, 128))]
    n = sum(r * c + 8 for _, (r, c) in shapes)
    wlow = _dev((rng.standard_normal(n).astype(np.float32) * 0.02).view(np.uint32) >> 16).astype(np.uint16)
    wlow[5] = 0x7F80                                           # an inf outside the weights changes nothing
    WL, off = {}, 8
    for name, (r, c) in shapes:
        WL[name] = wlow[off:off + r * c].reshape(r, c).view(_Dev)
        off += r * c
    WL["h.0.mlp.w_fc"][3, 7] = 0xFF80                          # -inf inside one: not in its amax, NaN code
    layout = SimpleNamespace(tensors=[SimpleNamespace(name=nm, size=r * c) for nm, (r, c) in shapes])
    plan, n8 = k8.weight_plan(layout, ("attn.w_qkv", "attn.w_o", "mlp.w_fc", "mlp.w_proj"))
    rows = [(WL[nm], o, ot, slot) for nm, (o, ot, slot) in plan.items()]
    table, chunks, tiles = k8.weight_table(rows, wlow.data.ptr)
    assert table.shape == (4, 8) and tiles == sum((r // 64) * (c // 64) for _, (r, c) in shapes)
    assert chunks == sum(-(-r * c // k8.WCHUNK) for _, (r, c) in shapes) and list(table[:, 5]) == [
        k8.SLOT * s for _, _, s in plan.values()]
    inv_len = k8.SLOT * (k8.n_slots(plan) + 1)
    w8, inv = np.zeros(n8, np.uint8), np.zeros(inv_len, np.float32)
    f8.cast_weights_table(np.asarray(wlow), table, chunks, tiles, w8, inv)
    log = {"cur": _dev(np.zeros(1, np.float32)), "calls": []}
    monkeypatch.setattr(k8, "quantize", _twin_quantize(log))
    a = {"w8": _dev(np.zeros(n8, np.uint8)), "f8_part": _dev(np.zeros(k8.AMAX_BLOCKS, np.float32)),
         "f8_inv": _dev(np.zeros(inv_len, np.float32)), "lt_ws": None}
    g = k8.Fp8Gemm(a, WL, plan, set(), None, lt=SimpleNamespace())
    g.cast_weights()                                           # no table in this arena: one by one
    np.testing.assert_array_equal(w8, np.asarray(a["w8"]))
    np.testing.assert_array_equal(inv, np.asarray(a["f8_inv"]))
    assert (w8 == 0x7F).sum() == 2 and inv[k8.SLOT * 3] > 0    # the -inf in both copies
    with pytest.raises(AndreaError, match="needs 16-byte alignment"):
        k8.weight_table([(wlow[1:1 + 64 * 64].reshape(64, 64).view(_Dev), 0, 4096, 3)], wlow.data.ptr)
    # an arena with the table (the engine's): cast_weights hands k_fp8_weights the table it wrote
    launches = []

    def weights_twin(w, wd, nw, n_chunks, n_tiles, amax, w8_, inv_, part=None, chunk=0, cast_at=None):
        assert part is None                                      # load_state's casts: the amax pass
        launches.append(nw)
        amax[...] = f8.cast_weights_table(np.asarray(w), np.asarray(wd)[:8 * nw].reshape(nw, 8), n_chunks, n_tiles,
                                          np.asarray(w8_), np.asarray(inv_),
                                          at=None if cast_at is None else np.asarray(cast_at))

    monkeypatch.setattr(k8, "k_fp8_weights", weights_twin)
    a.update(w8=_dev(np.zeros(n8, np.uint8)), f8_inv=_dev(np.zeros(inv_len, np.float32)), wlow=wlow,
             f8_wdesc=_dev(np.zeros(8 * len(plan), np.int64)), f8_wamax=_dev(np.full(3 * len(plan), 7, np.float32)))
    g = k8.Fp8Gemm(a, WL, plan, set(), None, lt=SimpleNamespace())
    g.cast_weights()
    assert launches == [len(plan)]
    np.testing.assert_array_equal(np.asarray(a["w8"]), w8)
    np.testing.assert_array_equal(np.asarray(a["f8_inv"]), inv)
    own = np.asarray(g.wamax[1]).copy()                          # the weights' own amaxes; copies made at them
    assert own[2] > 0 and not g.steps_weights                    # current scaling: the optimizer does not cast
    np.testing.assert_array_equal(np.asarray(g.wamax), [own, own, np.zeros_like(own)])
    # a resumed ADAMW_E4M3 run: the copies re-cast at the amaxes they were made at, the weights' own kept
    at = own * np.float32(0.5)
    g.cast_weights(at=at)
    tw8, tinv = np.zeros(n8, np.uint8), np.zeros(inv_len, np.float32)
    f8.cast_weights_table(np.asarray(wlow), table, chunks, tiles, tw8, tinv, at=at)
    np.testing.assert_array_equal(np.asarray(a["w8"]), tw8)
    np.testing.assert_array_equal(np.asarray(a["f8_inv"]), tinv)
    np.testing.assert_array_equal(np.asarray(g.wamax), [at, own, np.zeros_like(own)])
    sat = lambda q: np.count_nonzero((q & 0x7F) == 0x7E)        # +-448: the amax itself, and what saturates
    assert sat(tw8) > 2 * sat(w8)                                # at half the amax the largest values saturate
    gd = k8.Fp8Gemm(a, WL, plan, set(), None, lt=SimpleNamespace(), scaling="delayed", n_sites=12, history=4)
    assert gd.steps_weights and gd.weight_state() == {"weight_amax": [float(x) for x in at]}    # the same arena
    gd.cast_weights()                                            # load_state's cast: at the weights' own amax
    np.testing.assert_array_equal(np.asarray(a["w8"]), w8)
    gd.load_weight_state({"weight_amax": at.tolist()})
    np.testing.assert_array_equal(np.asarray(a["w8"]), tw8)
    gd.load_weight_state({})                                     # saved before ADAMW_E4M3: the cast stays
    np.testing.assert_array_equal(np.asarray(a["w8"]), tw8)
    with pytest.raises(ValueError, match="weight_amax of 3 weights"):
        gd.load_weight_state({"weight_amax": at[:3].tolist()})
    monkeypatch.setattr(k8, "ADAMW_E4M3", False)
    assert not gd.steps_weights and gd.weight_state() == {}


def test_the_block_weights_lie_in_one_flat_range():
    """The range the GPU engine steps and writes in one piece (WGRAD_WRITES, fp8 ADAMW_E4M3): every layer's
    matmul weights (recipe.MATMUL_WEIGHTS), one after the other from the first; a gap is refused."""
    from types import SimpleNamespace

    from andrea.engine.model import contiguous_span, param_layout
    from andrea.engine.recipe import MATMUL_WEIGHTS

    mc = ModelConfig(vocab_size=97, d_model=64, n_head=2, n_layer=3, context=128)
    layout = param_layout(mc)
    names = [f"h.{l}.{k}" for l in range(mc.n_layer) for k in MATMUL_WEIGHTS]
    C = mc.d_model
    assert contiguous_span(layout, names) == ((97 + 128) * C, (97 + 128) * C + 12 * C * C * mc.n_layer)
    assert contiguous_span(layout, names)[1] == layout.n_decay
    gap = SimpleNamespace(by_name={**layout.by_name})
    t = layout.by_name["h.1.attn.w_o"]
    gap.by_name[t.name] = SimpleNamespace(name=t.name, offset=t.offset + 64, size=t.size)   # w_o moved on
    with pytest.raises(AndreaError, match="h.1.attn.w_o starts at element"):
        contiguous_span(gap, names)


@pytest.mark.parametrize("choice", ["smem", "warp"])
def test_transposing_cast_kernel_follows_cast_t(monkeypatch, choice):
    """fp8.CAST_T picks the transposing cast: "warp" runs k_fp8_cast_t_w_bf16 (8 tiles a block) for a
    plain cast and keeps the shared-memory kernel for the GELU-backward cast; "smem" runs the
    shared-memory kernels (a tile a block). Both give the same bytes (tests/test_fp8_gpu.py)."""
    import andrea.cuda.fp8 as k8

    launched = []
    monkeypatch.setattr(k8, "CAST_T", choice)
    monkeypatch.setattr(k8, "kernel", lambda f, name: lambda grid, block, args: launched.append((name, grid[0])))
    x = _dev(np.zeros((1024, 128), np.uint16))
    k8.k_fp8_cast_t(None, None, x, 1024, 128, None, None)
    k8.k_fp8_cast_t(None, None, x, 1024, 128, None, None, hp=x)
    tiles = 16 * 2
    plain = ("k_fp8_cast_t_w_bf16", tiles // 8) if choice == "warp" else ("k_fp8_cast_t_bf16", tiles)
    assert launched == [plain, ("k_fp8_dgelu_cast_t_bf16", tiles)]


@pytest.mark.parametrize("e4m3,hpre", [(False, "on"), (True, "on"), (True, "off"), (True, "epilogue")])
def test_fc_forward_writes_h_act_in_e4m3_at_its_site_and_the_backward_takes_its_transpose(monkeypatch, e4m3, hpre):
    """FC_E4M3 (delayed scaling, after the first step, transposes kept): the fc forward's GELU_AUX GEMM
    gets an E4M3 D at h_act's site scale (the slot's DSCALE_AT float) and its AMAX_D; k_fp8_t_u8 folds
    that amax into the site and writes the transpose the proj weight gradient takes; the proj forward
    takes the GEMM's own E4M3 copy and h_act is never cast; the sites keep their numbers (the weight
    gradients' shadows too). HPRE_E4M3: the same GEMM writes its aux h_pre in E4M3 at HPRE_SCALE (the
    slot's AUX_AT float) into h_pre's first bytes, and the deferred GELU-backward cast of dh takes those
    bytes. The first (calibrating) step, and every step with FC_E4M3 off, keep the bf16 h_act, h_pre and
    the casts; so does h_pre with HPRE_E4M3 off (``hpre`` "off") or a DGELU proj dgrad to read it
    (``hpre_to_cast`` False: "epilogue"), which refuses an E4M3 h_pre."""
    from types import SimpleNamespace

    import andrea.cuda.fp8 as k8
    from andrea.cuda.cublaslt import CUDA_R_8F_E4M3, CUDA_R_16BF, EPILOGUE_DGELU, EPILOGUE_GELU_AUX

    monkeypatch.setattr(k8, "FC_E4M3", e4m3)
    monkeypatch.setattr(k8, "HPRE_E4M3", hpre != "off")
    rng = np.random.default_rng(12)
    N, C = 128, 64
    bf = lambda shape, s=1.0: _dev((rng.standard_normal(shape).astype(np.float32) * s).view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731
    Wfc, Wp = _dev(bf((C, 4 * C), 0.2)), _dev(bf((4 * C, C), 0.1))
    layout = SimpleNamespace(tensors=[SimpleNamespace(name="h.0.mlp.w_fc", size=Wfc.size),
                                      SimpleNamespace(name="h.0.mlp.w_proj", size=Wp.size)])
    plan, nbytes = k8.weight_plan(layout, ("mlp.w_fc", "mlp.w_proj"))
    n_sites = 6
    cur = _dev(np.zeros(n_sites, np.float32))
    log = {"cur": cur, "calls": [], "gemms": []}
    monkeypatch.setattr(k8, "quantize", _twin_quantize(log))
    inv_arr = _dev(np.zeros(k8.SLOT * (k8.n_slots(plan) + n_sites + 4), np.float32))
    a = {"w8": _dev(np.zeros(nbytes, np.uint8)), "f8_part": _dev(np.zeros(k8.AMAX_BLOCKS, np.float32)),
         "f8_inv": inv_arr, "f8_cur": cur, "f8_saved": _dev(np.zeros(4 * N * 4 * C, np.uint8)),
         **{k: _dev(np.zeros(N * 4 * C, np.uint8)) for k in ("f8_a", "f8_at", "f8_g", "f8_gt")}}
    val = lambda p: float(inv_arr[(p - inv_arr.data.ptr) // 4])  # noqa: E731
    trunc = lambda v: (np.asarray(v, np.float32).view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731

    def mm_nt(D, X8, Y8, x_inv, y_inv, M, N_, K, d_type, beta=0.0, fast_accum=False, epilogue=1, stream=0,
              aux=None, d_scale=None, amax_d=None, aux_scale=None):
        P = f8.gemm_nt(X8, val(x_inv), Y8, val(y_inv))
        log["gemms"].append((np.array(X8), val(x_inv), np.array(Y8), val(y_inv), d_type,
                             None if d_scale is None else val(d_scale)))
        if epilogue == EPILOGUE_GELU_AUX:
            g = _gelu64(P)[0]
            log["aux"] = (aux.dtype, aux.data.ptr, None if aux_scale is None else val(aux_scale))
            aux[:] = f8.hpre_codes(P, val(aux_scale)) if aux.dtype == np.uint8 else trunc(P)
            if d_type == CUDA_R_8F_E4M3:
                assert amax_d == a["f8_part"].data.ptr and D.data.ptr == a["f8_g"].data.ptr
                D[:] = f8.encode(g * val(d_scale))
                a["f8_part"][0] = np.abs(g).max()
            else:
                D[:] = trunc(g)

    transposes = []

    def t_u8(x8, out_t, R, C_, am, rec):
        transposes.append((x8.data.ptr, None if out_t is None else out_t.data.ptr))
        rec[0] = max(rec[0], am[0])
        if out_t is not None:
            out_t[:] = np.asarray(x8).T

    monkeypatch.setattr(k8, "k_fp8_t_u8", t_u8)
    lt = SimpleNamespace(mm_nt=mm_nt, mm=lambda *a_, **k: None)
    g8 = k8.Fp8Gemm(a, {"h.0.mlp.w_fc": Wfc, "h.0.mlp.w_proj": Wp}, plan, set(), None, lt=lt, scaling="delayed",
                    n_sites=n_sites, history=4)
    g8._stream = lambda: 0
    g8.hpre_to_cast = hpre != "epilogue"
    monkeypatch.setattr(k8, "k_fp8_weights", lambda *a_: None)
    X, dout = _dev(bf((N, C))), _dev(bf((N, C), 1e-2))
    h_act, h_pre, out = (_dev(np.zeros((N, 4 * C), np.uint16)), _dev(np.zeros((N, 4 * C), np.uint16)),
                         _dev(np.zeros((N, C), np.uint16)))
    dh, dX = _dev(np.zeros((N, 4 * C), np.uint16)), _dev(np.zeros((N, C), np.uint16))
    dWfc, dWp = _dev(np.zeros((C, 4 * C), np.float32)), _dev(np.zeros((4 * C, C), np.float32))
    steps = []
    for _ in range(3):
        log["calls"].clear(), log["gemms"].clear(), transposes.clear()
        g8.reset_amax()
        g8.begin()
        g8.mm(h_act, X, Wfc, epilogue=EPILOGUE_GELU_AUX, aux=h_pre)   # sites 0 (X), 1 (h_act)
        g8.mm(out, h_act, Wp)                                       # proj forward
        g8.mm(dh, dout, Wp, tb=True)                                # site 2: dout
        g8.mm(dWp, h_act, dout, ta=True, beta=1.0)                  # site 3: h_act^T (kept)
        dh[...] = trunc(f8.bf16_to_f32(np.asarray(dh)))
        g8.defer_dgelu(dh, h_pre)                                   # dh's cast takes gelu'(h_pre)
        g8.mm(dWfc, X, dh, ta=True, beta=1.0)                       # sites 4 (X^T kept), 5 (dh)
        g8.mm(dX, dh, Wfc, tb=True)
        g8.check_pass()
        steps.append(([c[:2] for c in log["calls"]], list(log["gemms"]), list(transposes), np.array(cur),
                      log.pop("aux"), log.pop("hp")))
        g8.after_step(None)
    (calls1, gemms1, t1, _, aux1, hp1), (calls2, gemms2, t2, cur2, aux2, hp2), _ = steps
    assert gemms1[0][4] == CUDA_R_16BF and t1 == []                 # calibrating: the bf16 h_act and its cast
    assert (h_act.data.ptr, 1) in calls1
    assert aux1 == (np.uint16, h_pre.data.ptr, None) and hp1 == [np.uint16]
    if not e4m3:
        assert gemms2[0][4] == CUDA_R_16BF and (h_act.data.ptr, 1) in calls2 and t2 == []
        assert aux2 == aux1 and hp2 == [np.uint16]
        return
    if hpre == "on":
        assert aux2 == (np.uint8, h_pre.data.ptr, k8.HPRE_SCALE) and hp2 == [np.uint8]     # HPRE_E4M3
    else:
        assert aux2 == aux1 and hp2 == [np.uint16]
    scale1 = float(inv_arr[k8.SLOT * (g8.site_base + 1) + 1])
    assert gemms2[0][4] == CUDA_R_8F_E4M3 and gemms2[0][5] == scale1 == float(f8.scale_of(steps[0][3][1])[0])
    assert [p for p, _ in calls2] == [X.data.ptr, dout.data.ptr, dh.data.ptr]   # h_act is never cast
    assert [s for _, s in calls2] == [0, 2, 5]
    nat = np.asarray(a["f8_g"][:N * 4 * C]).reshape(N, 4 * C)
    np.testing.assert_array_equal(gemms2[1][0], nat)                # the proj forward takes the GEMM's E4M3
    assert gemms2[1][1] == float(inv_arr[k8.SLOT * (g8.site_base + 1)])
    np.testing.assert_array_equal(gemms2[3][0], nat.T)              # the proj wgrad its kept transpose
    assert len(t2) == 1 and t2[0][0] == a["f8_g"].data.ptr and t2[0][1] is not None
    assert cur2[1] == np.float32(np.abs(_gelu64(f8.gemm_nt(gemms2[0][0], gemms2[0][1], gemms2[0][2],
                                                             gemms2[0][3]))[0]).max())
    assert g8._shadow == [(3, 1), (4, 0)]
    g8.begin(backward=False)                                        # evaluation: no transpose, amax still folded
    transposes.clear()
    g8.mm(h_act, X, Wfc, epilogue=EPILOGUE_GELU_AUX, aux=h_pre)
    g8.mm(out, h_act, Wp)
    assert transposes == [(a["f8_g"].data.ptr, None)] and not g8._saved
    if hpre == "on":                                                # the DGELU epilogue cannot read E4M3 bytes
        with pytest.raises(AndreaError, match="HPRE_E4M3"):
            g8.mm(dh, dout, Wp, tb=True, epilogue=EPILOGUE_DGELU, aux=h_pre)


def test_a_layernorm_written_in_e4m3_gives_its_gemms_the_cast_operands_and_sites(monkeypatch):
    """LN_E4M3: ``produce`` hands the LayerNorm kernel the site's scale and amax slot and the natural
    E4M3 buffer; the next X W takes that copy and the weight gradient X^T dY its kept transpose, with
    the operands, factors, sites and history of casting X (the kernel writes what the cast writes:
    tests/test_fp8_gpu.py checks that bit for bit). Off before the history exists, for other outputs
    than ``ln_ptrs``, and with LN_E4M3 False. ``produce(..., transposes=True)`` (the attention forward
    under fp8.ATTN_FWD_E4M3): the producer writes the kept transpose too, and no byte transpose runs."""
    import andrea.cuda.fp8 as k8

    runs = {}
    for mode in ("off", "on", "producer transposes"):
        g, log, W, X, dY, _ = _gemm_rig(monkeypatch, "delayed", True)
        g.ln_ptrs = {X.data.ptr}
        monkeypatch.setattr(k8, "LN_E4M3", mode != "off")
        byte_t = []
        monkeypatch.setattr(k8, "k_fp8_t_u8", lambda x8, out_t, R, C, am, rec: (
            byte_t.append(R), out_t.__setitem__(..., np.asarray(x8).T)))
        out, dX, dW = (_dev(np.zeros((128, 256), np.uint16)), _dev(np.zeros((128, 64), np.uint16)),
                       _dev(np.zeros((64, 256), np.float32)))
        produced = []

        def ln_kernel(nat, *rest):                   # what k_layernorm_fwd_e4m3 writes: the delayed cast of X
            out_t, scale, rec = rest if len(rest) == 3 else (None, *rest)
            q, am, _ = f8.quantize_delayed(f8.bf16_to_f32(np.asarray(X)), scale[0])
            nat[...] = q.reshape(nat.shape)
            if out_t is not None:
                out_t[...] = q.reshape(nat.shape).T
            rec[0] = max(rec[0], am)
            produced.append((rec.data.ptr - log["cur"].data.ptr) // 4)

        hist = []
        for _ in range(3):
            g.reset_amax()
            g.begin()
            if g.ln_e4m3(X):
                byte_t.clear()
                g.produce(X, ln_kernel, transposes=mode == "producer transposes")    # site 0
                assert byte_t == ([] if mode == "producer transposes" else [X.shape[0]])
            assert not g.ln_e4m3(dY)
            g.mm(out, X, W)
            g.mm(dX, dY, W, tb=True)                 # site 1
            g.mm(dW, X, dY, ta=True, beta=1.0)       # site 2: X^T
            g.check_pass()
            g.after_step(None)
            hist.append(np.array(g.hist.state()["amax_history"]))
        runs[mode] = (log, hist, produced, X.data.ptr)
    off, h0, p0, _ = runs["off"]
    assert p0 == []
    for mode in ("on", "producer transposes"):
        on_, h1, p1, x_ptr = runs[mode]
        assert p1 == [0, 0]                          # steps 2 and 3: the first step has no history
        _same_gemms(off["gemms"], on_["gemms"])
        for a, b in zip(h0, h1):
            np.testing.assert_array_equal(a, b)
        assert [c[0] for c in on_["calls"]].count(x_ptr) == 1   # X cast on the first step only


def test_the_weight_by_weight_casts_take_cast_weights_arguments():
    """cast_weights_each is cast_weights' reference, and the gpu tests swap one for the other in a
    training run (test_saved_transposes_gelu_cast_and_weight_table_keep_the_bytes), where the engine
    hands cast_weights AdamW's amax partials: the reference must take the same arguments."""
    import inspect

    import andrea.cuda.fp8 as k8

    assert inspect.signature(k8.Fp8Gemm.cast_weights_each) == inspect.signature(k8.Fp8Gemm.cast_weights)


@pytest.mark.parametrize("scaling,saved,fwd", [("current", False, True), ("current", True, True), ("delayed", True, True),
                                               ("delayed", True, False), ("current", False, False)])
def test_the_e4m3_head_orients_its_three_gemms_and_takes_lnf_sites(monkeypatch, scaling, saved, fwd):
    """fp8.FP8_HEAD over host arrays (twin casts, twin k_loss_bwd_e4m3, twin transpose, the GEMM as the
    product of the dequantized operands): logits = lnf wte_pad^T, dx = dlogits wte_pad, dwte += (dlogits^T
    lnf)[:V] (its product in f8_dwte, added into the first V rows), against NumPy of the dequantized
    operands (the twin GEMM truncates its bf16 outputs: 2**-7 |ref| + 1e-6; fp32 1e-6 |ref|). dlogits' transpose
    lives in the logits' bytes; wte_pad is cast with the weights; lnf is cast once (kept transpose) or twice
    (without f8_saved), and under delayed scaling takes two sites, the second its forward's shadow.
    ``fwd`` False (fp8.FP8_HEAD_FWD): the forward is the bf16 GEMM, and lnf is cast once, for dwte, at one site."""
    from types import SimpleNamespace

    import andrea.cuda.fp8 as k8
    from andrea.cuda.cublaslt import CUDA_R_16BF, CUDA_R_32F

    monkeypatch.setattr(k8, "FP8_HEAD", True)
    monkeypatch.setattr(k8, "FP8_HEAD_FWD", fwd)
    rng = np.random.default_rng(11)
    N, C, V, Vp = 128, 64, 97, 128
    to16 = lambda v: _dev((np.asarray(v, np.float32).view(np.uint32) >> 16).astype(np.uint16))  # noqa: E731
    wf = (rng.standard_normal((Vp, C)) * 0.5).astype(np.float32)
    wf[V:] = 0
    wp, lnf = to16(wf), to16(rng.standard_normal((N, C)))
    n_sites = k8.head_sites() if scaling == "delayed" else 0
    cur = _dev(np.zeros(max(1, n_sites), np.float32))
    log = {"cur": cur, "calls": [], "gemms": []}
    monkeypatch.setattr(k8, "quantize", _twin_quantize(log))
    monkeypatch.setattr(k8, "k_fp8_t_u8", lambda x8, out_t, R, C_, am, rec: out_t.__setitem__(
        slice(None), np.asarray(x8).reshape(R, C_).T))

    def loss_bwd(d8, inv, logits, targets, lse, dscale, N_, V_):
        codes, iv = f8.loss_dlogits_e4m3(f8.bf16_to_f32(np.asarray(logits)), targets, lse, dscale, ld=d8.shape[1])
        d8[:] = codes
        inv[0] = iv

    monkeypatch.setattr(k8, "k_loss_bwd_e4m3", loss_bwd)
    monkeypatch.setattr(k8, "k_residual_add", lambda prec, out, a_, b_, n: out.__setitem__(
        slice(None), np.asarray(a_) + np.asarray(b_)))
    plan: dict = {}
    buf = k8.fp8_buffers(0, N, C, k8.n_slots(plan), 0, vp=Vp)
    a = {name: _dev(np.zeros(shape, dt)) for name, shape, dt in buf if name != "f8_saved" or saved}
    a.update(wte_pad=wp, f8_cur=cur)
    inv_arr = a["f8_inv"]
    val = lambda p: np.float32(inv_arr[(p - inv_arr.data.ptr) // 4])  # noqa: E731

    def mm_nt(D, X8, Y8, x_inv, y_inv, M, N_, K, d_type, beta=0.0, fast_accum=False, stream=0, **kw):
        assert X8.shape == (M, K) and Y8.shape == (N_, K) and D.shape == (M, N_) and beta == 0.0
        ref = f8.gemm_nt(X8, val(x_inv), Y8, val(y_inv))
        D[:] = ref if d_type == CUDA_R_32F else (np.asarray(ref, np.float32).view(np.uint32) >> 16).astype(np.uint16)
        log["gemms"].append(d_type)

    def mm_bf16(D, A, B, ta=False, tb=False, **k):                       # the bf16 forward (fwd False)
        assert not fwd and tb and not ta and B.data.ptr == wp.data.ptr
        ref = f8.bf16_to_f32(np.asarray(A)).astype(np.float64) @ f8.bf16_to_f32(np.asarray(B)).astype(np.float64).T
        D[:] = (ref.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        log["gemms"].append("bf16")

    lt = SimpleNamespace(mm_nt=mm_nt, mm=mm_bf16)
    g = k8.Fp8Gemm(a, {}, plan, {wp.data.ptr}, None, lt=lt, scaling=scaling, n_sites=n_sites, history=4)
    g._stream = lambda: 0
    assert g.head is not None
    g.cast_weights()
    assert log["calls"] == [(wp.data.ptr, None, False, True, True)]       # wte_pad: both orientations
    w_dq = f8.dequantize(a["w8_head"][:Vp * C], val(g._slot(g.head[3]))).reshape(Vp, C).astype(np.float64)
    assert np.all(w_dq[V:] == 0)
    log["calls"].clear()
    g.begin(backward=True)
    logits = _dev(np.full((N, Vp), 0x7FC0, np.uint16))                    # prefilled NaN
    g.mm(logits, lnf, wp, tb=True)
    x_dq = f8.dequantize(*f8.quantize(f8.bf16_to_f32(np.asarray(lnf)))).astype(np.float64)
    lg = f8.bf16_to_f32(np.asarray(logits)).astype(np.float64)
    w16 = f8.bf16_to_f32(np.asarray(wp)).astype(np.float64)
    np.testing.assert_allclose(lg, (x_dq @ w_dq.T) if fwd else f8.bf16_to_f32(np.asarray(lnf)) @ w16.T,
                               rtol=2 ** -7, atol=1e-6)
    # the loss: lse of the first V columns; dlogits from the twin
    targets = rng.integers(0, V, N).astype(np.int32)
    z = lg[:, :V]
    lse = (z.max(1) + np.log(np.exp(z - z.max(1, keepdims=True)).sum(1))).astype(np.float32)
    dscale = 1.0 / N
    d_codes, d_inv = f8.loss_dlogits_e4m3(lg[:, :V].astype(np.float32), targets, lse, dscale, ld=Vp)
    d_dq = f8.dequantize(d_codes, d_inv).astype(np.float64)
    g.head_dlogits(logits, V, targets, lse, dscale)
    np.testing.assert_array_equal(np.asarray(logits).view(np.uint8).reshape(-1)[:Vp * N].reshape(Vp, N), d_codes.T)
    dx = _dev(np.full((N, C), 0x7FC0, np.uint16))
    g.mm(dx, logits, wp)
    np.testing.assert_allclose(f8.bf16_to_f32(np.asarray(dx)), d_dq @ w_dq, rtol=2 ** -7, atol=1e-6)
    dwte = _dev(np.full((V, C), 0.5, np.float32))
    g.mm(dwte, logits, lnf, ta=True, beta=1.0)
    np.testing.assert_allclose(np.asarray(dwte), 0.5 + (d_dq.T @ x_dq)[:V], rtol=1e-6, atol=1e-9)
    assert log["gemms"] == [CUDA_R_16BF if fwd else "bf16", CUDA_R_16BF, CUDA_R_32F]
    lnf_casts = [c for c in log["calls"] if c[0] == lnf.data.ptr]
    if not fwd:                                    # the bf16 forward casts nothing: the transpose for dwte
        assert [c[3:] for c in lnf_casts] == [(False, True)]
    elif saved:                                    # one cast, both orientations, the transpose kept
        assert [c[3:] for c in lnf_casts] == [(True, True)]
    else:                                          # the forward's, then the transpose for dwte
        assert [c[3:] for c in lnf_casts] == [(True, False), (False, True)]
    if scaling == "delayed":
        assert [c[1] for c in lnf_casts] == [0] and g._shadow == ([(1, 0)] if fwd else [])
    g.check_pass()
    with pytest.raises(AndreaError, match="not taken by its weight gradient"):
        g.begin()
        g.head_dlogits(logits, V, targets, lse, dscale)
        g.check_pass()
