"""The fp8 engine on the GPU: the E4M3 casts (current scaling, and delayed scaling's fused
cast + amax) bit-exact against the NumPy twin; the cuBLASLt FP8 GEMM against the product of
the dequantized operands, and with the MLP's GELU in its epilogues (GELU_AUX, DGELU) against the
NumPy twin and the separate passes; the engine's gradients against the fp32 NumPy engine, with
and without those epilogues (engine.FUSE_GELU_FP8); under both scalings two runs byte-identical,
resume (w, m, v and the amax history) bit-exact, CUDA graph == eager, the dY-cast reuse ==
casting afresh, the kept transposes, the GELU backward inside the cast and the two-launch weight
casts == casting every operand where it is needed (bit-exact kernels and engine bytes); a non-finite input skips the step; delayed scaling counts the casts a jump in
magnitude clipped and its scales follow.

    PYTHONPATH=. python3 -m pytest -m gpu -s tests/test_fp8_gpu.py      # on a Hopper (sm_90) GPU

Skipped cleanly without CuPy/a CUDA device, and on GPUs before sm_89 (no FP8 tensor cores).
Tolerances (each stated where it is used):
- casts: bit-exact (codes, the fp32 dequantization factor, the fused amax);
- GEMM: |D - ref| <= 2**-8 |ref| (bf16 output rounding; 0 for fp32 D) + 2**-12 (|X| |Y|^T)
  (fp32 accumulation in cuBLASLt's order, fast accumulation in the forward); with a GELU epilogue
  that accumulation term times 1.13 (max |gelu'|) plus 2e-3 (the epilogue's tanh; DGELU: 2e-3
  |dY W^T|), against the separate passes about twice that (test_fp8_gelu_epilogues_...);
- engine vs fp32 NumPy, per parameter tensor relative to its largest entry: 0.25. E4M3 keeps 3
  mantissa bits, so every GEMM operand carries up to 1/16 relative error (bf16: 1/256); a
  gradient passes through 2-3 such GEMMs per layer and the errors of a K-term dot product
  average out only partly, so per-tensor errors of 5-15% of the largest entry are what FP8
  training runs with (measured figures printed with -s); losses within 3e-2 relative.
"""

from __future__ import annotations

import numpy as np
import pytest

from andrea.cuda.loader import cupy_or_none
from andrea.engine import fp8_numpy as f8
from andrea.engine.backend import NumpyBackend
from andrea.engine.engine import Engine, Hyper
from andrea.engine.model import ModelConfig

cp = cupy_or_none()


def _fp8_capable() -> bool:
    if cp is None:
        return False
    major = cp.cuda.Device().compute_capability
    return int(major) >= 89


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _fp8_capable(), reason="needs CuPy and an sm_89+ GPU (FP8)")]

MC = ModelConfig(vocab_size=97, d_model=64, n_head=2, n_layer=2, context=128)
B = 2
HP = Hyper(grad_clip=1.0)


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 payloads, round to nearest even (NaN kept NaN)."""
    return np.where(np.isnan(x), np.uint16(0x7FC0), f8.f32_to_bf16(x))


def special_tensor(n: int, seed: int, scale: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * scale).astype(np.float32)
    x[:12] = [0.0, -0.0, np.inf, -np.inf, np.nan, scale * 1e-6, -scale * 1e-6, scale * 40, 1e-30, -1e-38, 3.0, -3.0]
    return to_bf16(x)


def gpu(a):
    return cp.asarray(a)


@pytest.fixture(params=["smem", "warp"])
def cast_t(request, monkeypatch):
    """Each transposing-cast test runs both kernels (andrea/cuda/fp8.py CAST_T): the same bytes."""
    from andrea.cuda import fp8 as k8

    monkeypatch.setattr(k8, "CAST_T", request.param)
    return request.param


def _engine_modules():
    from andrea.cuda import fp8 as k8

    return k8


@pytest.mark.parametrize("scale", [1.0, 3e-5, 700.0])
def test_casts_are_bit_exact_with_numpy(scale, cast_t):
    k8 = _engine_modules()
    R, C = 128, 192
    xb = special_tensor(R * C, 7, scale)
    xf = f8.bf16_to_f32(xb)
    q_ref, inv_ref = f8.quantize(xf)
    x = gpu(xb)
    part = cp.full(k8.AMAX_BLOCKS, np.nan, dtype=np.float32)
    inv = cp.full(1, np.nan, dtype=np.float32)
    out = cp.full(R * C, 0xAA, dtype=np.uint8)
    k8.quantize(out, None, x, part, inv)
    assert float(cp.asnumpy(part).max()) == float(f8.amax(xf))
    assert cp.asnumpy(inv)[0] == inv_ref
    np.testing.assert_array_equal(cp.asnumpy(out), q_ref)
    nat = cp.full((R, C), 0xAA, dtype=np.uint8)
    tr = cp.full((C, R), 0xAA, dtype=np.uint8)
    inv2 = cp.full(1, np.nan, dtype=np.float32)
    k8.quantize(nat, tr, x, part, inv2, R, C)
    np.testing.assert_array_equal(cp.asnumpy(nat).reshape(-1), q_ref)
    np.testing.assert_array_equal(cp.asnumpy(tr), q_ref.reshape(R, C).T)
    assert cp.asnumpy(inv2)[0] == inv_ref
    tr_only = cp.full((C, R), 0xAA, dtype=np.uint8)
    k8.quantize(None, tr_only, x, part, inv2, R, C)
    np.testing.assert_array_equal(cp.asnumpy(tr_only), q_ref.reshape(R, C).T)


@pytest.mark.parametrize("scale,factor", [(1.0, 1.0), (3e-5, 0.25), (700.0, 3.0)])
def test_fused_delayed_cast_and_amax_are_bit_exact_with_numpy(scale, factor, cast_t):
    """Delayed scaling's one pass: E4M3 at a given scale (factor < 1: the history's amax below
    this tensor's, so values saturate at 448) and the tensor's amax atomicMax-ed into rec; the
    first step's current casts with rec. Tolerance: none (codes and amax bit-exact)."""
    k8 = _engine_modules()
    R, C = 128, 192
    xb = special_tensor(R * C, 11, scale)
    xf = f8.bf16_to_f32(xb)
    am = f8.amax(xf)
    s, _ = f8.scale_of(np.float32(am) * np.float32(factor))
    q_ref, am_ref, clipped = f8.quantize_delayed(xf, s)
    assert clipped == (factor < 1)
    x, sc = gpu(xb), gpu(np.array([s], np.float32))
    part = cp.full(k8.AMAX_BLOCKS, np.nan, dtype=np.float32)
    inv = cp.full(1, np.nan, dtype=np.float32)
    for shape in ("flat", "both", "t"):
        rec = cp.zeros(1, dtype=np.float32)
        nat = cp.full((R, C), 0xAA, dtype=np.uint8)
        tr = cp.full((C, R), 0xAA, dtype=np.uint8)
        if shape == "flat":
            k8.quantize(nat.reshape(-1), None, x, part, inv, scale=sc, rec=rec)
        else:
            k8.quantize(nat if shape == "both" else None, tr, x, part, inv, R, C, scale=sc, rec=rec)
            np.testing.assert_array_equal(cp.asnumpy(tr), q_ref.reshape(R, C).T)
        if shape != "t":
            np.testing.assert_array_equal(cp.asnumpy(nat).reshape(-1), q_ref)
        assert cp.asnumpy(rec)[0] == am_ref, shape
    assert np.isnan(cp.asnumpy(inv)[0])                      # the delayed cast leaves inv to the host
    big = cp.full(1, 2 * am_ref + 1, dtype=np.float32)
    k8.quantize(nat.reshape(-1), None, x, part, inv, scale=sc, rec=big)
    assert cp.asnumpy(big)[0] == 2 * am_ref + 1              # a max: a larger amax already there stays
    q_cur, inv_cur = f8.quantize(xf)
    rec = cp.zeros(1, dtype=np.float32)
    k8.quantize(None, tr, x, part, inv, R, C, rec=rec)       # current scaling recording its amax (first step)
    np.testing.assert_array_equal(cp.asnumpy(tr), q_cur.reshape(R, C).T)
    assert cp.asnumpy(rec)[0] == am_ref and cp.asnumpy(inv)[0] == inv_cur


def test_fused_cast_over_more_tiles_than_blocks_is_bit_exact(cast_t):
    """A (4096, 4096) tensor: 4096 tiles for at most 2112 blocks (the grid-stride tile loop) and
    1056 blocks of the flat cast, each adding its max; bit-exact, the amax too."""
    k8 = _engine_modules()
    R = C = 4096
    rng = np.random.default_rng(12)
    xf32 = (rng.standard_normal(R * C) * 0.02).astype(np.float32)
    xf32[rng.integers(0, R * C, 50)] = 7.0                     # a few outliers beyond the scale
    xb = to_bf16(xf32)
    xf = f8.bf16_to_f32(xb)
    s, _ = f8.scale_of(np.float32(1.0))
    q_ref, am_ref, clipped = f8.quantize_delayed(xf, s)
    assert clipped
    x, sc = gpu(xb), gpu(np.array([s], np.float32))
    part, inv = cp.zeros(k8.AMAX_BLOCKS, np.float32), cp.zeros(1, np.float32)
    rec, rec_t = cp.zeros(1, np.float32), cp.zeros(1, np.float32)
    flat, tr = cp.zeros(R * C, np.uint8), cp.zeros((C, R), np.uint8)
    k8.quantize(flat, None, x, part, inv, scale=sc, rec=rec)
    k8.quantize(None, tr, x, part, inv, R, C, scale=sc, rec=rec_t)
    np.testing.assert_array_equal(cp.asnumpy(flat), q_ref)
    np.testing.assert_array_equal(cp.asnumpy(tr), q_ref.reshape(R, C).T)
    assert cp.asnumpy(rec)[0] == am_ref == cp.asnumpy(rec_t)[0]


@pytest.mark.parametrize("delayed", [False, True])
def test_gelu_backward_cast_is_bit_exact_with_k_gelu_bwd_then_the_cast(delayed, cast_t):
    """k_fp8_amax_dgelu_bf16 / k_fp8_dgelu_cast_t_bf16 (quantize(..., hp=h_pre)) against the two
    passes they replace: k_gelu_bwd writing dL/dh_pre in bf16, then the cast of that tensor. Codes,
    factor and amax bit-exact (tolerance: none), specials included (inf, NaN, -0, tiny)."""
    from andrea.cuda.kernels import k_gelu_bwd

    k8 = _engine_modules()
    R, C = 256, 320
    dy, hp = gpu(special_tensor(R * C, 21, 0.01)), gpu(special_tensor(R * C, 22, 2.0))
    ref = cp.empty(R * C, dtype=np.uint16)
    k_gelu_bwd("bf16", ref, dy, hp, R * C)
    sc = gpu(np.array([f8.scale_of(np.float32(3.0))[0]], np.float32)) if delayed else None
    outs = []
    for x, h in ((ref, None), (dy, hp)):
        part = cp.full(k8.AMAX_BLOCKS, np.nan, dtype=np.float32)
        inv, rec = cp.full(1, np.nan, dtype=np.float32), cp.zeros(1, dtype=np.float32)
        nat, tr = cp.full((R, C), 0xAA, dtype=np.uint8), cp.full((C, R), 0xAA, dtype=np.uint8)
        k8.quantize(nat, tr, x, part, inv, R, C, scale=sc, rec=rec, hp=h)
        outs.append([cp.asnumpy(v) for v in (nat, tr, inv, rec)])
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    assert (outs[0][0] == 0x7F).any()                          # the specials reached the codes


@pytest.mark.parametrize("C", [320, 384])
def test_gelu_backward_cast_of_an_e4m3_h_pre_is_bit_exact_with_its_bf16_value(C):
    """HPRE_E4M3: k_fp8_dgelu8_cast_t_bf16 (C = 320) and its 64 x 128-tile form k_fp8_dgelu8_cast_t2_bf16
    (C = 384, a multiple of 128) read h_pre as E4M3 codes at HPRE_SCALE. decode(code) / HPRE_SCALE is a
    bf16 value (3 mantissa bits, a power-of-two scale), so the codes, amax and factor equal
    k_fp8_dgelu_cast_t_bf16's over that bf16 h_pre (tolerance: none). Every code 0..255 appears (NaN
    0x7F / 0xFF too: its gradient's code is NaN), dL/dh_act with the specials."""
    k8 = _engine_modules()
    R = 256
    rng = np.random.default_rng(23)
    codes = rng.integers(0, 256, R * C).astype(np.uint8)
    codes[:256] = np.arange(256, dtype=np.uint8)
    hv = f8.hpre_values(codes, k8.HPRE_SCALE)                  # the NumPy twin: decode / HPRE_SCALE
    hp_bf16 = to_bf16(hv)
    assert np.array_equal(f8.bf16_to_f32(hp_bf16)[np.isfinite(hv)], hv[np.isfinite(hv)])   # bf16 values
    dy = gpu(special_tensor(R * C, 24, 0.01))
    sc = gpu(np.array([f8.scale_of(np.float32(0.05))[0]], np.float32))
    outs = []
    for h in (gpu(hp_bf16), gpu(codes)):
        inv, rec = cp.full(1, np.nan, dtype=np.float32), cp.zeros(1, dtype=np.float32)
        nat, tr = cp.full((R, C), 0xAA, dtype=np.uint8), cp.full((C, R), 0xAA, dtype=np.uint8)
        k8.quantize(nat, tr, dy, None, inv, R, C, scale=sc, rec=rec, hp=h)
        outs.append([cp.asnumpy(v) for v in (nat, tr, rec)])
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    nan_rows = np.isnan(f8.decode(codes)).reshape(R, C)
    assert nan_rows.any() and (outs[1][0][nan_rows] == 0x7F).all()
    assert len(np.unique(outs[1][0])) > 100                     # the gradient spans the code range


def test_weight_casts_in_two_launches_are_bit_exact():
    """cast_weights (k_fp8_wamax + k_fp8_wcast over the weight table) against the weight-by-weight
    casts and against their NumPy twin (fp8_numpy.cast_weights_table): w8 and every weight's factor
    bit-exact, with weights of several chunks and an inf inside one."""
    from andrea.cuda.backend import make_backend

    k8 = _engine_modules()
    mc = ModelConfig(vocab_size=97, d_model=128, n_head=2, n_layer=2, context=128)
    eng = make_backend().make_engine(mc, B, precision="fp8", cuda_graph=False)
    eng.init_weights(3)
    host = eng.state_host()[0]
    t = eng.layout.tensors[[x.name for x in eng.layout.tensors].index("h.1.mlp.w_proj")]
    host[t.offset + 77] = -np.inf
    eng.load_state(host, np.zeros_like(host), np.zeros_like(host))        # casts with the two launches
    g = eng.f8
    nw, chunks, tiles = g.table
    wlow, wd = eng.a["wlow"], eng.a["f8_wdesc"]
    assert nw == 4 * mc.n_layer and chunks > nw                 # w_fc, w_proj: 4 chunks each
    w8, inv = cp.asnumpy(eng.a["w8"]), cp.asnumpy(eng.a["f8_inv"])
    first = slice(k8.SLOT * 3, k8.SLOT * (3 + nw), k8.SLOT)    # each weight's factor: its slot's first float
    tw8, tinv = np.zeros_like(w8), inv.copy()
    tinv[first] = np.nan
    f8.cast_weights_table(cp.asnumpy(wlow), cp.asnumpy(wd)[:8 * nw].reshape(nw, 8), chunks, tiles, tw8, tinv)
    np.testing.assert_array_equal(w8, tw8)
    np.testing.assert_array_equal(inv, tinv)
    eng.a["w8"].fill(0xAA)
    eng.a["f8_inv"][first] = np.nan
    g.cast_weights_each()
    np.testing.assert_array_equal(cp.asnumpy(eng.a["w8"]), w8)
    np.testing.assert_array_equal(cp.asnumpy(eng.a["f8_inv"]), inv)
    assert (w8 == 0x7F).sum() == 2                              # the -inf: NaN in both copies


def test_weight_amax_from_the_optimizer_partials_is_bit_exact():
    """apply_update's fused path: k_adamw4_bf16 leaves the max |wlow| of each ADAMW_CHUNK parameters
    and k_fp8_wamax_parts reads those instead of wlow. After a step and after a skipped one (a NaN
    gradient: wlow unchanged), w8, every factor and every amax equal cast_weights' own amax pass over
    the same wlow. The matmul weights start off the chunk grid (V = 97), so the ragged ends come from
    wlow; the weight casts of load_state keep the amax pass."""
    from andrea.cuda.backend import make_backend

    mc = ModelConfig(vocab_size=97, d_model=128, n_head=2, n_layer=2, context=128)
    eng = make_backend().make_engine(mc, B, precision="fp8", cuda_graph=False)
    eng.init_weights(5)
    assert eng._amax_part() is not None
    first = (mc.vocab_size + mc.context) * mc.d_model           # wte, wpe, then the matmul weights
    assert first % 1024 != 0
    for t, bad in ((1, False), (2, True), (3, False)):
        eng.zero_grads()
        loss = eng.micro_step(*batch(40 + t, mc))
        if bad:
            eng.a["g"][first + 3] = np.nan
        res = eng.apply_update(1, loss, 3e-3, t, HP)
        assert res.ok == (not bad)
        fused = [cp.asnumpy(eng.a[k]).tobytes() for k in ("w8", "f8_inv", "f8_wamax")]
        eng.a["w8"].fill(0xAA)
        eng.a["f8_wamax"].fill(np.nan)
        eng.f8.cast_weights()                                   # k_fp8_wamax over wlow, then the casts
        again = [cp.asnumpy(eng.a[k]).tobytes() for k in ("w8", "f8_inv", "f8_wamax")]
        assert fused == again, f"step {t}: the partials' amaxes differ from the amax pass over wlow"


def test_the_optimizer_step_writes_the_weights_e4m3_at_the_amax_before_it():
    """fp8.ADAMW_E4M3 (delayed scaling): k_adamw_w8_bf16 + k_fp8_wamax_roll against k_adamw over copies of
    the same buffers (w, m, v and wlow bit-exact: the same arithmetic, adamw_pinned) and the NumPy twin of
    the weight casts at the amax of the weights *before* the step (fp8_numpy.cast_weights_table(at=): w8
    and every weight's factor bit-exact); the amax rows move on (the copies' amax, the new weights' own,
    zeros) and gstate[3] counts the weights whose new amax passed the one their scale came from. Three
    steps: an ordinary one, a skipped one (a NaN gradient: nothing of the weights written), one at lr 1 (the
    weights jump: codes saturate at 448 and the weights are counted). The matmul weights start off the
    ADAMW_CHUNK grid (V = 97), so the flat AdamW around them is split unevenly. With fp8.W8_ONLY (the default)
    the matmul rows of wlow stay as they were; the codes are those of the new weights' bf16 values all the same."""
    from andrea.cuda.backend import make_backend
    from andrea.cuda.kernels import k_adamw

    k8 = _engine_modules()
    mc = ModelConfig(vocab_size=97, d_model=128, n_head=2, n_layer=2, context=128)
    eng = make_backend().make_engine(mc, B, precision="fp8", cuda_graph=False, fp8_scaling="delayed")
    eng.init_weights(5)
    a, g8 = eng.a, eng.f8
    first = (mc.vocab_size + mc.context) * mc.d_model             # wte, wpe, then the matmul weights
    assert g8.steps_weights and eng._w8_range() == (first, eng.layout.n_decay)
    nw, chunks, tiles = g8.table
    wd = cp.asnumpy(a["f8_wdesc"])[:8 * nw].reshape(nw, 8)
    slots = wd[:, 5]
    for t, (lr, bad) in enumerate(((3e-3, False), (3e-3, True), (1.0, False)), start=1):
        eng.zero_grads()
        loss = eng.micro_step(*batch(40 + t, mc))
        if bad:
            a["g"][first + 3] = np.nan
        before = {k: a[k].copy() for k in ("w", "m", "v", "wlow", "g", "w8", "f8_inv", "f8_wamax")}
        clipped = eng.fp8_clipped_total
        res = eng.apply_update(1, loss, lr, t, HP)
        assert res.ok == (not bad)
        ref = {k: before[k].copy() for k in ("w", "m", "v", "wlow")}
        k_adamw("bf16", ref["w"], before["g"], ref["m"], ref["v"], ref["wlow"], eng.n_params, a["hp"], a["gstate"],
                eng.layout.n_decay, 1)
        new_low = ref["wlow"].copy()                             # the new weights' bf16 values, as the kernel has them
        if k8.W8_ONLY:                                           # the matmul rows of wlow are left as they were
            ref["wlow"][first:eng.layout.n_decay] = before["wlow"][first:eng.layout.n_decay]
        for k in ref:
            assert cp.asnumpy(a[k]).tobytes() == cp.asnumpy(ref[k]).tobytes(), f"step {t}: {k}"
        am0 = cp.asnumpy(before["f8_wamax"])[:3 * nw].reshape(3, nw)
        am = cp.asnumpy(a["f8_wamax"])[:3 * nw].reshape(3, nw)
        w8, inv, n_clip = cp.asnumpy(a["w8"]), cp.asnumpy(a["f8_inv"]), float(cp.asnumpy(a["gstate"])[3])
        if bad:
            assert w8.tobytes() == cp.asnumpy(before["w8"]).tobytes() and n_clip == 0
            np.testing.assert_array_equal(inv[slots], cp.asnumpy(before["f8_inv"])[slots])
            np.testing.assert_array_equal(am, am0)
            continue
        tw8, tinv = np.full_like(w8, 0xAA), np.full_like(inv, np.nan)
        own = f8.cast_weights_table(cp.asnumpy(new_low), wd, chunks, tiles, tw8, tinv, at=am0[1])
        np.testing.assert_array_equal(w8, tw8)
        np.testing.assert_array_equal(inv[slots], tinv[slots])
        np.testing.assert_array_equal(am[0], am0[1])
        np.testing.assert_array_equal(am[1], own)
        assert not am[2].any()
        want = int(np.count_nonzero(own > np.where(am0[1] > f8.AMAX_TINY, am0[1], np.float32(448))))
        assert n_clip == want and eng.fp8_clipped_total - clipped >= want
        if lr == 1.0:                                            # the jump: saturated codes, counted
            assert want > 0 and np.count_nonzero((w8 & 0x7F) == 0x7E) > 0, (want, am0[1], own)
        print(f"ADAMW_E4M3 step {t} (lr {lr}): {want} of {nw} weights past their scale's amax")


def _lt():
    from andrea.cuda.cublaslt import Lt

    return Lt(cp.zeros(32 << 20, dtype=np.uint8))


@pytest.mark.parametrize("M,N,K", [(256, 192, 64), (64, 256, 256), (128, 64, 512)])
def test_fp8_gemm_matches_the_dequantized_product(M, N, K):
    from andrea.cuda.cublaslt import CUDA_R_16BF, CUDA_R_32F

    rng = np.random.default_rng(M + N + K)
    xa = rng.standard_normal((M, K)).astype(np.float32)
    ya = (rng.standard_normal((N, K)) * 1e-3).astype(np.float32)
    (qx, ix), (qy, iy) = f8.quantize(xa), f8.quantize(ya)
    ref = f8.gemm_nt(qx, ix, qy, iy)
    mag = np.abs(f8.dequantize(qx, ix)).astype(np.float64) @ np.abs(f8.dequantize(qy, iy)).T.astype(np.float64)
    inv = gpu(np.array([ix] + [0] * 15 + [iy], np.float32))        # 16-byte aligned factors, as cuBLASLt needs
    lt = _lt()
    for fast in (False, True):
        d16 = cp.full((M, N), 0x7FC0, dtype=np.uint16)
        lt.mm_nt(d16, gpu(qx), gpu(qy), inv.data.ptr, inv.data.ptr + 64, M, N, K, CUDA_R_16BF, fast_accum=fast)
        got = f8.bf16_to_f32(cp.asnumpy(d16)).astype(np.float64)
        err = np.abs(got - ref)
        assert np.all(err <= 2.0 ** -8 * np.abs(ref) + 2.0 ** -12 * mag), (fast, float(err.max()))
        d32 = cp.full((M, N), 0.5, dtype=np.float32)
        lt.mm_nt(d32, gpu(qx), gpu(qy), inv.data.ptr, inv.data.ptr + 64, M, N, K, CUDA_R_32F, beta=1.0, fast_accum=fast)
        err = np.abs(cp.asnumpy(d32) - (ref + 0.5))
        assert np.all(err <= 2.0 ** -12 * mag + 1e-6), (fast, float(err.max()))
        print(f"fp8 gemm {M}x{N}x{K} fast={fast}: max |err| / max|ref| = {float(err.max() / np.abs(ref).max()):.2e}")


def _gelu64(u):
    """The NumPy twin of the epilogues: the recipe's tanh-form GELU and its derivative, float64."""
    from andrea.engine import ops_numpy as ops

    th = np.tanh(ops.GELU_K * (u + ops.GELU_A * u ** 3))
    return 0.5 * u * (1 + th), 0.5 * (1 + th) + 0.5 * u * (1 - th ** 2) * ops.GELU_K * (1 + 3 * ops.GELU_A * u ** 2)


GELU_SLOPE = 1.13        # max |gelu'| of the tanh form: an accumulation error in P reaches gelu(P) times at most this


def _within(got, ref, bound, what):
    err = np.abs(np.asarray(got, np.float64) - ref)
    assert np.isfinite(got).all(), f"{what}: non-finite output (an element left unwritten?)"
    excess = float(np.max(err - bound))
    assert excess <= 0, f"{what}: max err {float(err.max()):.3g}, max excess over the bound {excess:.3g}"
    print(f"{what}: max |err| / max |ref| = {float(err.max() / np.abs(ref).max()):.2e}")


def test_fp8_gelu_epilogues_match_numpy_and_the_separate_passes():
    """The fp8 engine's fused MLP GEMMs (Lt.mm_nt; the engine's with FUSE_GELU_FP8), E4M3 x E4M3 -> bf16:
    GELU_AUX (fc forward, fast accumulation): aux h_pre = P and h_act = gelu(P); DGELU (proj dgrad,
    split accumulation): dh = (dY W^T) * gelu'(h_pre). Against the float64 twin on the dequantized
    operands, with the bound, elementwise,
        2^-8 |ref| (bf16 rounding of the output) + 2^-12 |X||Y|^T (fp32 accumulation, the GEMM
        test's) x 1.13 (max |gelu'|) + 2e-3 (the epilogue's own tanh; cuBLASLt documents none;
        DGELU: 2e-3 |dY W^T|, gelu' error times the product),
    and against the separate passes (plain FP8 GEMM -> bf16 -> k_gelu_fwd / k_gelu_bwd) within
    twice that plus one more rounding. The same bits on a repeat, another layer's aux honoured,
    outputs prefilled with NaN."""
    from andrea.cuda import kernels as kk
    from andrea.cuda.cublaslt import CUDA_R_16BF, EPILOGUE_DGELU, EPILOGUE_GELU_AUX

    rng = np.random.default_rng(31)
    M, C = 512, 256
    F = 4 * C
    q = lambda a: f8.quantize(a.astype(np.float32))                           # noqa: E731
    (qx, ix), (qw, iw) = q(rng.standard_normal((M, C))), q(rng.normal(0, 2.0 / np.sqrt(C), (F, C)))
    (qg, ig), (qp, ip) = q(rng.standard_normal((M, C))), q(rng.normal(0, 1.0 / np.sqrt(C), (F, C)))
    (qx2, ix2) = q(rng.standard_normal((M, C)) * 0.5)                          # another layer's input
    inv = gpu(np.kron(np.array([ix, iw, ig, ip, ix2], np.float32), np.eye(1, 16, dtype=np.float32)[0]))
    slot = lambda i: inv.data.ptr + 64 * i                                     # noqa: E731 (16-byte aligned)
    mag = lambda a, ia, b, ib: (np.abs(f8.dequantize(a, ia)).astype(np.float64)     # noqa: E731
                                @ np.abs(f8.dequantize(b, ib)).T.astype(np.float64))
    widen = lambda d: f8.bf16_to_f32(cp.asnumpy(d)).astype(np.float64)       # noqa: E731
    nan16 = lambda *shape: cp.full(shape, 0x7FC0, dtype=np.uint16)             # noqa: E731
    lt = _lt()
    X, W, dY, Wp, X2 = (gpu(a) for a in (qx, qw, qg, qp, qx2))
    # GELU_AUX, two "layers" of one plan (layer 1 another input): (0, 1, 0) to check the bits repeat
    h_act, h_pre = nan16(2, M, F), nan16(2, M, F)
    runs = []
    for layer, (x8, sx) in zip((0, 1, 0), ((X, 0), (X2, 4), (X, 0))):
        lt.mm_nt(h_act[layer], x8, W, slot(sx), slot(1), M, F, C, CUDA_R_16BF, fast_accum=True,
                 epilogue=EPILOGUE_GELU_AUX, aux=h_pre[layer])
        runs.append((cp.asnumpy(h_act[layer]).tobytes(), cp.asnumpy(h_pre[layer]).tobytes()))
    assert runs[0] == runs[2] and runs[0] != runs[1], "the fused forward's bits changed, or layer 1's aux was ignored"
    for layer, (qa, ia) in ((0, (qx, ix)), (1, (qx2, ix2))):
        P, m = f8.gemm_nt(qa, ia, qw, iw), mag(qa, ia, qw, iw)
        _within(widen(h_pre[layer]), P, 2.0 ** -8 * np.abs(P) + 2.0 ** -12 * m,
                f"fp8 GELU_AUX aux h_pre (layer {layer})")
        g = _gelu64(P)[0]
        _within(widen(h_act[layer]), g, 2.0 ** -8 * np.abs(g) + GELU_SLOPE * 2.0 ** -12 * m + 2e-3,
                f"fp8 GELU_AUX h_act (layer {layer}) vs the tanh-form twin")
    P, m = f8.gemm_nt(qx, ix, qw, iw), mag(qx, ix, qw, iw)
    sep_pre, sep_act = nan16(M, F), nan16(M, F)
    lt.mm_nt(sep_pre, X, W, slot(0), slot(1), M, F, C, CUDA_R_16BF, fast_accum=True)
    kk.k_gelu_fwd("bf16", sep_act, sep_pre, M * F)
    g = _gelu64(P)[0]
    _within(widen(h_act[0]), widen(sep_act), 3 * 2.0 ** -8 * np.abs(g) + 2 * GELU_SLOPE * 2.0 ** -12 * m + 4e-3,
            "fp8 GELU_AUX vs FP8 GEMM + k_gelu_fwd")
    # DGELU: dh (M, F) = (dY (M, C) @ Wp^T) * gelu'(h_pre), h_pre the forward's (rounded) aux
    prod, m = f8.gemm_nt(qg, ig, qp, ip), mag(qg, ig, qp, ip)
    dh = nan16(3, M, F)
    for k, layer in enumerate((0, 1, 0)):
        lt.mm_nt(dh[k], dY, Wp, slot(2), slot(3), M, F, C, CUDA_R_16BF, epilogue=EPILOGUE_DGELU, aux=h_pre[layer])
    assert cp.asnumpy(dh[0]).tobytes() == cp.asnumpy(dh[2]).tobytes() != cp.asnumpy(dh[1]).tobytes()
    for k in (0, 1):
        dg = _gelu64(widen(h_pre[k]))[1]
        ref = prod * dg
        # two bf16 roundings: on the H200, DGELU went 0.00098 past a one-rounding bound (max err
        # 0.0201), as if the product (or gelu') were rounded before the multiply as well as after
        _within(widen(dh[k]), ref, 2 * 2.0 ** -8 * np.abs(ref) + GELU_SLOPE * 2.0 ** -12 * m + 2e-3 * np.abs(prod)
                + 1e-6, f"fp8 DGELU dh (aux of layer {k}) vs the twin")
    sep = nan16(M, F)
    lt.mm_nt(sep, dY, Wp, slot(2), slot(3), M, F, C, CUDA_R_16BF)
    kk.k_gelu_bwd("bf16", sep, sep, h_pre[0], M * F)
    ref = prod * _gelu64(widen(h_pre[0]))[1]
    _within(widen(dh[0]), widen(sep), 3 * 2.0 ** -8 * np.abs(ref) + 2 * GELU_SLOPE * 2.0 ** -12 * m
            + 4e-3 * np.abs(prod) + 1e-6, "fp8 DGELU vs FP8 GEMM + k_gelu_bwd")
    from andrea.cuda.cublaslt import CUDA_R_32F
    from andrea.errors import AndreaError

    with pytest.raises(AndreaError, match="needs a bf16 or E4M3 D, beta 0 and a bf16 aux"):
        lt.mm_nt(h_act[0], X, W, slot(0), slot(1), M, F, C, CUDA_R_16BF, epilogue=EPILOGUE_GELU_AUX,
                 aux=h_pre[0][:, :8])
    with pytest.raises(AndreaError, match="needs a bf16 or E4M3 D, beta 0 and a bf16 aux"):
        lt.mm_nt(cp.zeros((M, F), np.float32), X, W, slot(0), slot(1), M, F, C, CUDA_R_32F,
                 epilogue=EPILOGUE_GELU_AUX, aux=h_pre[0])


def _fc_gemm_problem(seed: int, gain: float):
    """An fc GEMM's E4M3 operands (X (512, 256) standard normal, W (1024, 256) of std gain / sqrt(256),
    each quantized with its factor), their float64 product P and |X||W|^T (the accumulation bound)."""
    rng = np.random.default_rng(seed)
    M, C = 512, 256
    F = 4 * C
    x, w = f8.quantize(rng.standard_normal((M, C)).astype(np.float32)), \
        f8.quantize(rng.normal(0, gain / np.sqrt(C), (F, C)).astype(np.float32))
    P = f8.gemm_nt(*x, *w)
    m = np.abs(f8.dequantize(*x)).astype(np.float64) @ np.abs(f8.dequantize(*w)).T.astype(np.float64)
    return M, C, F, x, w, P, m


def test_fp8_gelu_gemm_writes_an_e4m3_aux_at_its_fixed_scale_and_saturates():
    """HPRE_E4M3's GEMM (Lt.mm_nt with an E4M3 D, GELU_AUX and a uint8 aux with aux_scale): the aux is
    E4M3(aux_scale * P), satfinite. Against the float64 twin P, elementwise where |P| < 448 / 64 / 1.1:
        2^-4 |P| (E4M3 rounding) + 2^-12 |X||Y|^T (the accumulation) + 2^-10 / 64 (half the subnormal step);
    beyond 448 / 64 * 1.1 the code is 0x7E / 0xFE (+-448), never NaN. D and amax_d as with a bf16 aux
    (the same bits), the same bits on a repeat; D and aux prefilled with NaN codes."""
    from andrea.cuda.cublaslt import CUDA_R_8F_E4M3, EPILOGUE_GELU_AUX
    from andrea.errors import AndreaError

    M, C, F, (qx, ix), (qw, iw), P, m = _fc_gemm_problem(41, 4.0)
    lt = _lt()
    X, W = gpu(qx), gpu(qw)
    hs = 64.0
    s = np.float32(f8.scale_of(np.float32(np.abs(_gelu64(P)[0]).max()))[0])
    inv = gpu(np.kron(np.array([ix, iw, s, hs], np.float32), np.eye(1, 16, dtype=np.float32)[0]))
    slot = lambda i: inv.data.ptr + 64 * i                                 # noqa: E731
    runs = []
    for aux8 in (True, True, False):
        D, am = cp.full((M, F), 0x7F, dtype=np.uint8), cp.full(4, np.nan, dtype=np.float32)
        aux = cp.full((M, F), 0x7F, dtype=np.uint8) if aux8 else cp.full((M, F), 0x7FC0, dtype=np.uint16)
        lt.mm_nt(D, X, W, slot(0), slot(1), M, F, C, CUDA_R_8F_E4M3, fast_accum=True, epilogue=EPILOGUE_GELU_AUX,
                 aux=aux, d_scale=slot(2), amax_d=am.data.ptr, **({"aux_scale": slot(3)} if aux8 else {}))
        runs.append((cp.asnumpy(D), cp.asnumpy(aux), float(cp.asnumpy(am)[0])))
    assert runs[0][0].tobytes() == runs[1][0].tobytes() == runs[2][0].tobytes() and runs[0][2] == runs[2][2]
    assert runs[0][1].tobytes() == runs[1][1].tobytes()
    a8 = runs[0][1]
    assert not np.isin(a8, (0x7F, 0xFF)).any(), "the E4M3 aux wrote NaN codes"
    free, sat = np.abs(P) < 448 / hs / 1.1, np.abs(P) > 448 / hs * 1.1
    assert free.mean() > 0.5 and sat.any()
    bound = 2.0 ** -4 * np.abs(P) + 2.0 ** -12 * m + 2.0 ** -10 / hs
    _within(np.where(free, f8.hpre_values(a8, hs), P), P, bound, "fp8 GELU_AUX E4M3 aux (h_pre at 64)")
    twin = f8.hpre_codes(P, hs)                                 # where P is not near a rounding tie: the twin's code
    assert (a8 == twin).mean() > 0.95, (a8 == twin).mean()
    np.testing.assert_array_equal(a8[sat], np.where(P[sat] < 0, 0xFE, 0x7E).astype(np.uint8))
    with pytest.raises(AndreaError, match="aux_scale"):
        lt.mm_nt(cp.zeros((M, F), np.uint16), X, W, slot(0), slot(1), M, F, C, 14, epilogue=EPILOGUE_GELU_AUX,
                 aux=cp.zeros((M, F), np.uint8), aux_scale=slot(3))


def test_fp8_gelu_gemm_writes_e4m3_with_its_amax_and_saturates():
    """FC_E4M3's GEMM (Lt.mm_nt with an E4M3 D, GELU_AUX, bf16 aux): D = E4M3(d_scale * gelu(P)) and
    amax_d = max |gelu(P)| before the scale. Against the float64 twin, elementwise,
        2^-4 |ref| (E4M3 rounding, 3 mantissa bits) + GELU_SLOPE 2^-12 |X||Y|^T (the accumulation, as
        in the bf16 test) + 2e-3 (the epilogue's tanh) + 2^-10 / scale (half the subnormal step),
    the aux h_pre within the bf16 test's bound, amax_d within the largest bound. With the scale 8x too
    large, what lies beyond 448 saturates at +-448 (0x7E / 0xFE), never NaN: the delayed scale trails a
    growing tensor, and the step must stay finite (the engine counts it as clipped). The same bits on a
    repeat; D, aux and amax prefilled with NaN."""
    from andrea.cuda.cublaslt import CUDA_R_8F_E4M3, EPILOGUE_GELU_AUX

    M, C, F, (qx, ix), (qw, iw), P, m = _fc_gemm_problem(37, 2.0)
    g = _gelu64(P)[0]
    lt = _lt()
    X, W = gpu(qx), gpu(qw)
    for factor in (1.0, 8.0):
        s = np.float32(f8.scale_of(np.float32(np.abs(g).max()))[0] * np.float32(factor))
        inv = gpu(np.kron(np.array([ix, iw, s], np.float32), np.eye(1, 16, dtype=np.float32)[0]))
        slot = lambda i: inv.data.ptr + 64 * i                                 # noqa: E731
        runs = []
        for _ in range(2):
            D, aux = cp.full((M, F), 0x7F, dtype=np.uint8), cp.full((M, F), 0x7FC0, dtype=np.uint16)
            am = cp.full(4, np.nan, dtype=np.float32)
            lt.mm_nt(D, X, W, slot(0), slot(1), M, F, C, CUDA_R_8F_E4M3, fast_accum=True,
                     epilogue=EPILOGUE_GELU_AUX, aux=aux, d_scale=slot(2), amax_d=am.data.ptr)
            runs.append((cp.asnumpy(D), cp.asnumpy(aux), float(cp.asnumpy(am)[0])))
        assert all(a.tobytes() == b.tobytes() for a, b in zip(runs[0][:2], runs[1][:2])) and runs[0][2] == runs[1][2]
        d8, h_pre, amax_d = runs[0]
        bound = 2.0 ** -4 * np.abs(g) + GELU_SLOPE * 2.0 ** -12 * m + 2e-3 + 2.0 ** -10 / float(s)
        assert not np.isin(d8, (0x7F, 0xFF)).any(), "an E4M3 D wrote NaN codes"
        free = np.abs(g) * float(s) < 440                                     # not at the saturation edge
        _within(np.where(free, f8.decode(d8) / float(s), g), g, bound, f"fp8 GELU_AUX E4M3 D (scale x{factor})")
        sat = np.abs(g) * float(s) > 460
        assert (sat.any() if factor > 1 else not sat.any())
        np.testing.assert_array_equal(d8[sat], np.where(g[sat] < 0, 0xFE, 0x7E).astype(np.uint8))
        _within(f8.bf16_to_f32(h_pre).astype(np.float64), P, 2.0 ** -8 * np.abs(P) + 2.0 ** -12 * m,
                "fp8 GELU_AUX E4M3 D: aux h_pre")
        assert abs(amax_d - np.abs(g).max()) <= bound.max(), (amax_d, np.abs(g).max())


@pytest.mark.parametrize("R,C", [(192, 640), (192, 768), (320, 512)])
def test_e4m3_transpose_kernel_and_its_amax_fold(R, C):
    """k_fp8_t_u8: out_t = in^T byte for byte (more tiles than a block's warps, a non-square matrix;
    C = 640 the per-warp kernel, C a multiple of 256 the shared-memory one, k_fp8_t_u8_s, over
    several 64 x 256 tiles), prefilled; the GEMM's amax atomicMax-ed into the site (a smaller one
    leaves it, a NaN or inf counts as 0); with out_t None only the fold. Tolerance: none."""
    from andrea.cuda import fp8 as k8

    rng = np.random.default_rng(5)
    x = rng.integers(0, 256, (R, C), dtype=np.uint8)
    out_t = cp.full((C, R), 0xAA, dtype=np.uint8)
    rec, am = cp.asarray(np.array([1.5], np.float32)), cp.asarray(np.array([2.25], np.float32))
    k8.k_fp8_t_u8(gpu(x), out_t, R, C, am, rec)
    np.testing.assert_array_equal(cp.asnumpy(out_t), x.T)
    assert float(rec[0]) == 2.25
    for a, want in ((1.0, 2.25), (np.nan, 2.25), (np.inf, 2.25), (3.0, 3.0)):
        am[0] = a
        k8.k_fp8_t_u8(gpu(x), None, R, C, am, rec)
        assert float(rec[0]) == want, (a, float(rec[0]))


@pytest.mark.parametrize("V,ld", [(97, 128), (8449, 8512), (256, 256)])
def test_e4m3_loss_backward_matches_numpy(V, ld):
    """k_loss_bwd_e4m3 (the fp8 head's dlogits, fp8.FP8_HEAD) against fp8_numpy.loss_dlogits_e4m3: bf16
    logits rows ld elements apart (the padded head's), the lse from k_loss_fwd, the output prefilled
    with 0xAA. Codes: the kernel's expf and NumPy's exp may part in the last fp32 bit, which moves an
    E4M3 code by one step only at a rounding boundary: every decoded value within one E4M3 step of
    NumPy's (2**-3 |ref| + 2**-9), at most 1% of the codes differing; columns past V exactly 0; a
    non-finite row all NaN (0x7F); inv = dscale / 448 bit for bit."""
    from andrea.cuda import kernels as K

    rng = np.random.default_rng(V)
    N, dscale = 192, 1.0 / 192
    x = rng.standard_normal((N, ld)).astype(np.float32) * 3
    x[:, V:] = 0
    lb = to_bf16(x)
    lb[5, 3] = 0x7FC0                                          # a NaN logit: row 5 is all NaN
    targets = rng.integers(0, V, N).astype(np.int32)
    logits = gpu(lb)
    lse, losses = cp.zeros(N, np.float32), cp.zeros(N, np.float32)
    K.k_loss_fwd("bf16", lse, losses, logits[:, :V], gpu(targets), N, V)
    d8, inv = cp.full((N, ld), 0xAA, dtype=np.uint8), cp.full(4, np.nan, dtype=np.float32)
    K.k_loss_bwd_e4m3(d8, inv, logits[:, :V], gpu(targets), lse, dscale, N, V)
    want, want_inv = f8.loss_dlogits_e4m3(f8.bf16_to_f32(lb)[:, :V], targets, cp.asnumpy(lse), dscale, ld=ld)
    got = cp.asnumpy(d8)
    assert float(inv[0]) == float(want_inv)
    assert np.all(got[5, :V] == 0x7F) and np.all(want[5, :V] == 0x7F) and np.all(got[5, V:] == 0)
    ok = np.arange(N) != 5
    assert np.all(got[ok][:, V:] == 0)
    g, w = f8.decode(got[ok][:, :V]).astype(np.float64), f8.decode(want[ok][:, :V]).astype(np.float64)
    assert np.all(np.abs(g - w) <= 2.0 ** -3 * np.abs(w) + 2.0 ** -9), float(np.abs(g - w).max())
    assert np.mean(got[ok] != want[ok]) <= 0.01


@pytest.mark.parametrize("C", [128, 768, 1536])
@pytest.mark.parametrize("residual", [False, True])
def test_e4m3_layernorm_forward_is_the_bf16_forward_then_the_delayed_cast(C, residual):
    """fp8.LN_E4M3's kernels (k_layernorm_fwd_e4m3, plain and residual) against k_layernorm_fwd /
    k_residual_layernorm_fwd (bf16) followed by the delayed cast at the same scale: the E4M3 bytes, the
    amax (atomicMax-ed over blocks, into a nonzero start), mean, rstd and the residual sum bit-exact,
    with a row of a NaN (NaN codes) and a scale small enough that the largest values saturate.
    Tolerance: none."""
    from andrea.cuda import kernels as kk

    rng = np.random.default_rng(C)
    N = 64
    x = (rng.standard_normal((N, C)) * 3 + 0.5).astype(np.float32)
    x[5, 7] = np.nan
    g, b = (rng.standard_normal(C) * 0.5 + 1).astype(np.float32), (rng.standard_normal(C) * 0.1).astype(np.float32)
    a, br = (x * 0.5).astype(np.float32), to_bf16(x * 0.5)
    ref_y, ref_m, ref_r = cp.full((N, C), 0x7FC0, np.uint16), cp.full(N, np.nan, np.float32), cp.full(N, np.nan, np.float32)
    ref_xo = cp.full((N, C), np.nan, np.float32)
    if residual:
        kk.k_residual_layernorm_fwd("bf16", ref_xo, ref_y, ref_m, ref_r, gpu(a), gpu(br), gpu(g), gpu(b), N, C)
    else:
        kk.k_layernorm_fwd("bf16", ref_y, ref_m, ref_r, gpu(x), gpu(g), gpu(b), N, C)
    yf = f8.bf16_to_f32(cp.asnumpy(ref_y))
    am = f8.amax(yf)
    scale = np.float32(f8.scale_of(am)[0] * np.float32(4.0))            # 4x: the top values saturate
    q_ref, am_ref, clipped = f8.quantize_delayed(yf, scale)
    assert clipped and am_ref == am
    y8, m, r = cp.full((N, C), 0xAA, np.uint8), cp.full(N, np.nan, np.float32), cp.full(N, np.nan, np.float32)
    xo = cp.full((N, C), np.nan, np.float32)
    rec = cp.asarray(np.array([np.float32(am) / 2], np.float32))          # a smaller amax already there
    sc = gpu(np.array([scale], np.float32))
    if residual:
        kk.k_layernorm_fwd_e4m3(y8, m, r, xo, gpu(g), gpu(b), N, C, sc, rec, a=gpu(a), br=gpu(br))
        np.testing.assert_array_equal(cp.asnumpy(xo), cp.asnumpy(ref_xo))
    else:
        kk.k_layernorm_fwd_e4m3(y8, m, r, gpu(x), gpu(g), gpu(b), N, C, sc, rec)
    np.testing.assert_array_equal(cp.asnumpy(y8), q_ref.reshape(N, C))
    assert (cp.asnumpy(y8)[5] == 0x7F).all()                             # the NaN row
    np.testing.assert_array_equal(cp.asnumpy(m), cp.asnumpy(ref_m))
    np.testing.assert_array_equal(cp.asnumpy(r), cp.asnumpy(ref_r))
    assert float(rec[0]) == float(am_ref)
    from andrea.errors import AndreaError

    with pytest.raises(AndreaError, match="N a multiple of 8"):
        kk.k_layernorm_fwd_e4m3(y8[:60], m[:60], r[:60], gpu(x[:60]), gpu(g), gpu(b), 60, C, sc, rec)


@pytest.mark.parametrize("heads_per_launch,transposed", [(None, False), (1, False), (None, True), (1, True)])
def test_e4m3_attention_backward_is_the_bf16_backward_then_the_delayed_cast(heads_per_launch, transposed):
    """fp8.ATTN_E4M3's kernels (kernels.k_attn_bwd(impl="wgds", e4m3=)) against the same backward in
    bf16 followed by the NumPy twin of the delayed cast at one scale: the E4M3 bytes of dq, dk and dv
    (and, fp8.ATTN_BWD_T, their transpose, staged in shared memory) and the amax (atomicMax-ed over
    warps and both kernels, into a smaller start) bit-exact; T = 200 is ragged against the 64-row
    tiles, the scale 4x too large so the top values saturate, and the heads go in one launch or one
    per launch. Tolerance: none."""
    from andrea.cuda import kernels as kk

    if not kk.hopper():
        pytest.skip("the dS-storing attention backward needs a compute capability 9.0 device")
    rng = np.random.default_rng(9)
    Bq, T, H, D = 2, 200, 2, 64
    C, N = H * D, Bq * T
    qkv, dout = _bf16_gpu(rng, (N, 3 * C)), _bf16_gpu(rng, (N, C))
    y, lse = cp.zeros((N, C), np.uint16), cp.zeros(Bq * H * T, np.float32)
    kk.k_attn_fwd("bf16", y, lse, qkv, Bq, T, C, H, impl="wg")
    ds = None if heads_per_launch is None else cp.empty(kk.attn_ds_bytes(T, heads_per_launch), np.uint8)
    ref = cp.full((N, 3 * C), 0x7FC0, np.uint16)
    kk.k_attn_bwd("bf16", ref, dout, y, lse, cp.zeros(Bq * H * T, np.float32), qkv, Bq, T, C, H, False,
                  impl="wgds", ds=ds)
    rf = f8.bf16_to_f32(cp.asnumpy(ref))
    am = f8.amax(rf)
    scale = np.float32(f8.scale_of(am)[0] * np.float32(4.0))
    q_ref, am_ref, clipped = f8.quantize_delayed(rf, scale)
    assert clipped and am_ref == am
    d8 = cp.full((N, 3 * C), 0xAA, np.uint8)
    d8t = cp.full((3 * C, N), 0xAA, np.uint8) if transposed else None
    rec = cp.asarray(np.array([np.float32(am) / 2], np.float32))
    kk.k_attn_bwd("bf16", cp.full((N, 3 * C), 0x7FC0, np.uint16), dout, y, lse, cp.zeros(Bq * H * T, np.float32),
                  qkv, Bq, T, C, H, False, impl="wgds", ds=ds,
                  e4m3=(d8, gpu(np.array([scale], np.float32)), rec, d8t))
    np.testing.assert_array_equal(cp.asnumpy(d8), q_ref.reshape(N, 3 * C))
    if transposed:
        np.testing.assert_array_equal(cp.asnumpy(d8t), q_ref.reshape(N, 3 * C).T)
    assert float(rec[0]) == float(am_ref)
    from andrea.errors import AndreaError

    with pytest.raises(AndreaError, match="E4M3 dqkv needs"):
        kk.k_attn_bwd("bf16", ref, dout, y, lse, cp.zeros(Bq * H * T, np.float32), qkv, Bq, T, C, H, False,
                      impl="wg", e4m3=(d8, gpu(np.array([scale], np.float32)), rec))


@pytest.mark.parametrize("T,D,rows,transposed", [(200, 64, 256, True), (1024, 64, 256, True), (520, 32, 128, True),
                                                  (70, 64, 64, True), (1024, 32, 128, False)])
def test_e4m3_attention_forward_is_the_bf16_forward_then_the_delayed_cast(T, D, rows, transposed):
    """fp8.ATTN_FWD_E4M3's kernels (kernels.k_attn_fwd(impl="wg", e4m3=)) against the bf16 forward
    followed by the NumPy twin of the delayed cast at one scale: y and lse2 byte-identical, the E4M3 y
    bytes, their transpose (written through shared memory; T = 520 and 200 end inside a 16-byte run, 70
    inside the block) and the amax (atomicMax-ed over blocks into a smaller start) bit-exact; the scale
    4x too large so the top values saturate. Tolerance: none."""
    from andrea.cuda import kernels as kk
    from andrea.errors import AndreaError

    if not kk.hopper():
        pytest.skip("the wgmma attention forward needs a compute capability 9.0 device")
    rng = np.random.default_rng(13)
    Bq, H = 2, 2
    C, N = H * D, Bq * T
    qkv = _bf16_gpu(rng, (N, 3 * C))
    y, lse = cp.full((N, C), 0x7FC0, np.uint16), cp.full(Bq * H * T, np.nan, np.float32)
    kk.k_attn_fwd("bf16", y, lse, qkv, Bq, T, C, H, rows=rows, impl="wg")
    yf = f8.bf16_to_f32(cp.asnumpy(y))
    am = f8.amax(yf)
    scale = np.float32(f8.scale_of(am)[0] * np.float32(4.0))
    q_ref, am_ref, clipped = f8.quantize_delayed(yf, scale)
    assert clipped and am_ref == am
    y2, lse2 = cp.full((N, C), 0x7FC0, np.uint16), cp.full(Bq * H * T, np.nan, np.float32)
    y8, y8t = cp.full((N, C), 0xAA, np.uint8), cp.full((C, N), 0xAA, np.uint8) if transposed else None
    rec = cp.asarray(np.array([np.float32(am) / 2], np.float32))
    kk.k_attn_fwd("bf16", y2, lse2, qkv, Bq, T, C, H, rows=rows, impl="wg",
                  e4m3=(y8, y8t, gpu(np.array([scale], np.float32)), rec))
    assert cp.asnumpy(y2).tobytes() == cp.asnumpy(y).tobytes()
    assert cp.asnumpy(lse2).tobytes() == cp.asnumpy(lse).tobytes()
    np.testing.assert_array_equal(cp.asnumpy(y8), q_ref.reshape(N, C))
    if transposed:
        np.testing.assert_array_equal(cp.asnumpy(y8t), q_ref.reshape(N, C).T)
    assert float(rec[0]) == float(am_ref)
    with pytest.raises(AndreaError, match="E4M3 y needs"):
        kk.k_attn_fwd("bf16", y2, lse2, qkv, Bq, T, C, H, impl="mma", e4m3=(y8, y8t, gpu(np.array([scale])), rec))


@pytest.mark.parametrize("C", [64, 768, 1536])
def test_e4m3_layernorm_backward_is_the_bf16_backward_then_the_delayed_cast(C):
    """fp8.LNB_E4M3's kernel (kernels.k_layernorm_bwd(e4m3=)) against k_layernorm_bwd with a bf16 dlow
    followed by the NumPy twin of the delayed cast at one scale: the E4M3 bytes and the amax (into a
    smaller start) bit-exact, dx, dg and db byte-identical; the scale 4x too large so the top values
    saturate; C = 64, 768, 1536 take three (V, R) kernels. Tolerance: none."""
    from andrea.cuda import kernels as kk

    rng = np.random.default_rng(C + 1)
    N = 96
    x, g = (rng.standard_normal((N, C)) * 2).astype(np.float32), (rng.standard_normal(C) * 0.5 + 1).astype(np.float32)
    mean, rstd = x.mean(1).astype(np.float32), (1 / np.sqrt(x.var(1) + 1e-5)).astype(np.float32)
    dy, dx0 = to_bf16((rng.standard_normal((N, C))).astype(np.float32)), (rng.standard_normal((N, C)) * 0.3).astype(np.float32)
    part = cp.zeros(((N + kk.LN_ROWS_PER_CHUNK - 1) // kk.LN_ROWS_PER_CHUNK) * 2 * C, np.float32)

    def run(e4m3):
        dx, dg, db = gpu(dx0), cp.zeros(C, np.float32), cp.zeros(C, np.float32)
        low = None if e4m3 else cp.full((N, C), 0x7FC0, np.uint16)
        kk.k_layernorm_bwd("bf16", dx, dg, db, gpu(dy), gpu(x), gpu(mean), gpu(rstd), gpu(g), part, N, C, dlow=low,
                           e4m3=e4m3)
        return dx, dg, db, low

    dx, dg, db, low = run(None)
    lf = f8.bf16_to_f32(cp.asnumpy(low))
    am = f8.amax(lf)
    scale = np.float32(f8.scale_of(am)[0] * np.float32(4.0))
    q_ref, am_ref, clipped = f8.quantize_delayed(lf, scale)
    assert clipped and am_ref == am
    d8, rec = cp.full((N, C), 0xAA, np.uint8), cp.asarray(np.array([np.float32(am) / 2], np.float32))
    dx8, dg8, db8, _ = run((d8, gpu(np.array([scale], np.float32)), rec))
    np.testing.assert_array_equal(cp.asnumpy(d8), q_ref.reshape(N, C))
    assert float(rec[0]) == float(am_ref)
    for a, b in ((dx, dx8), (dg, dg8), (db, db8)):
        assert cp.asnumpy(a).tobytes() == cp.asnumpy(b).tobytes()


def _bf16_gpu(rng, shape, scale=1.0):
    return gpu(to_bf16((rng.standard_normal(shape) * scale).astype(np.float32)).reshape(shape))


def test_the_three_gemm_forms_match_numpy():
    """Fp8Gemm.mm (the engine's _mm): X W, dY W^T (tb) and X^T dY (ta, fp32 beta=1)."""
    from andrea.cuda.backend import make_backend

    eng = make_backend().make_engine(MC, B, precision="fp8")
    eng.init_weights(3)
    f = eng.f8
    with eng.stream:
        f.cast_weights()
    rng = np.random.default_rng(5)
    N, C = B * MC.context, MC.d_model
    W = eng.WL["h.0.mlp.w_fc"]                               # (C, 4C) bf16
    Wf = f8.bf16_to_f32(cp.asnumpy(W))

    def deq(xf):
        q, inv = f8.quantize(xf)
        return f8.dequantize(q, inv).astype(np.float64)

    def check(got, ref, what, bf16_out=True):
        got = f8.bf16_to_f32(cp.asnumpy(got)) if bf16_out else cp.asnumpy(got)
        mag = np.abs(ref).max()
        err = np.abs(got.astype(np.float64) - ref)
        assert np.all(err <= (2.0 ** -8 if bf16_out else 0) * np.abs(ref) + 1e-3 * mag), (what, float(err.max()))

    X = _bf16_gpu(rng, (N, C))
    out = cp.full((N, 4 * C), 0x7FC0, dtype=np.uint16)
    with eng.stream:
        f.mm(out, X, W)
    eng.stream.synchronize()
    check(out, deq(f8.bf16_to_f32(cp.asnumpy(X))) @ deq(Wf), "X W")
    dY = _bf16_gpu(rng, (N, 4 * C), 1e-4)
    dX = cp.full((N, C), 0x7FC0, dtype=np.uint16)
    dW = cp.full((C, 4 * C), 0.25, dtype=np.float32)
    with eng.stream:
        f.mm(dX, dY, W, tb=True)
        f.mm(dW, X, dY, ta=True, beta=1.0)                   # reuses the transposed dY cast by the call above
    eng.stream.synchronize()
    dYf = f8.bf16_to_f32(cp.asnumpy(dY))
    check(dX, deq(dYf) @ deq(Wf).T, "dY W^T")
    check(dW, deq(f8.bf16_to_f32(cp.asnumpy(X))).T @ deq(dYf) + 0.25, "X^T dY", bf16_out=False)


def numpy_engine(seed=0):
    eng = Engine(MC, B, NumpyBackend())
    eng.init_weights(seed)
    return eng


def batch(seed, mc=MC, b=B):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, mc.vocab_size, (b, mc.context)).astype(np.int32)
    return x, np.roll(x, -1, axis=1)


@pytest.mark.parametrize("scaling,gemms", [("current", ""), ("delayed", ""), ("current", "fwd,bwd"),
                                           ("delayed", "fwd,bwd"), ("delayed", "fwd")])
def test_fp8_engine_gradients_and_ten_steps_track_numpy(scaling, gemms, monkeypatch):
    """Delayed: the gradients are its first (current-scaled) step; the 10 steps run on the history.
    ``gemms``: engine.FUSE_GELU_FP8, the GELU in the epilogues of the fc forward / proj dgrad or the
    separate passes; h_act and the LayerNorm outputs are one buffer for all layers either way (the
    backward reads their kept E4M3 transposes, fp8.SAVE_TRANSPOSES)."""
    import andrea.cuda.engine as ce
    from andrea.cuda.backend import make_backend

    monkeypatch.setattr(ce, "FUSE_GELU_FP8", frozenset(gemms.split(",")) - {""})
    ref = numpy_engine()
    g8 = make_backend().make_engine(MC, B, precision="fp8", fp8_scaling=scaling)
    assert (g8.ops.fused, g8.ops.fused_bwd) == ("fwd" in gemms, "bwd" in gemms)
    assert g8.a["h_act"].shape[0] == g8.a["ln1"].shape[0] == 1 and g8.policy.recompute == frozenset()
    g8.init_weights(0)
    x, y = batch(2)
    ref.zero_grads()
    l_ref = ref.forward(x, y)
    ref.backward(1.0 / ref.N)
    l8 = g8.compute_grads(x, y)
    assert abs(l8 - l_ref) <= 3e-2 * abs(l_ref), (l8, l_ref)
    got = g8.grads_host()
    worst = {}
    for t in ref.layout.tensors:
        r = ref.g[t.offset:t.offset + t.size]
        a = got[t.offset:t.offset + t.size]
        worst[t.name] = float(np.abs(a - r).max()) / (float(np.abs(r).max()) or 1.0)
    print("fp8 vs fp32 numpy, max |err| / max |ref| per tensor:",
          " ".join(f"{k}={v:.3f}" for k, v in sorted(worst.items(), key=lambda kv: -kv[1])))
    assert max(worst.values()) <= 0.25, worst
    for t in range(1, 11):
        xb, yb = batch(200 + t)
        a = ref.train_step([(xb, yb)], 3e-3, t, HP)
        b = g8.train_step([(xb, yb)], 3e-3, t, HP)
        assert a.ok and b.ok
        assert abs(a.loss - b.loss) <= 3e-2 * abs(a.loss), (t, a.loss, b.loss)
    print(f"fp8 {scaling} (GELU epilogues: {gemms or 'none'}) after 10 steps: loss {b.loss:.4f} "
          f"vs numpy fp32 {a.loss:.4f}"
          + (f", clipped casts {g8.fp8_clipped_total}" if scaling == "delayed" else ""))


def _wgds(monkeypatch) -> bool:
    """The attention backward that stores dS ("wgds", where fp8.ATTN_E4M3 applies) at MC's D = 32 too
    (the default there is "wg"), on a compute capability 9.0 device; False elsewhere."""
    from andrea.cuda import kernels as K

    if not K.hopper():
        return False
    monkeypatch.setattr(K, "ATTN_HOPPER", {"fwd": "wg", "bwd": "wgds"})
    return True


def _run(steps, start=None, graph=True, accum=1, memo=True, scaling="current"):
    from andrea.cuda.backend import make_backend

    eng = make_backend().make_engine(MC, B, precision="fp8", cuda_graph=graph, fp8_scaling=scaling, fp8_amax_history=4)
    eng.f8.memo_enabled = memo
    t0 = 0
    if start is None:
        eng.init_weights(0)
    else:
        t0, w, m, v, extra = start
        eng.load_state(w, m, v)
        eng.load_extra_state(extra)
    for t in range(t0 + 1, t0 + steps + 1):
        eng.train_step([batch(300 + 7 * t + k) for k in range(accum)], 3e-3, t, HP)
    return (t0 + steps, *eng.state_host(), eng.extra_state())


@pytest.mark.parametrize("scaling,gemms,wgds", [("current", "", False), ("delayed", "", False),
                                                ("current", "fwd,bwd", False), ("delayed", "fwd,bwd", False),
                                                ("delayed", "fwd", False), ("delayed", "fwd", True)])
def test_fp8_two_runs_are_byte_identical_resume_is_bit_exact_graph_is_eager(scaling, gemms, wgds, monkeypatch):
    """Delayed with a 4-step history over 6 steps: the ring wraps, and the resume at step 3
    restores it (and the step count) from extra_state, as a checkpoint does. ``gemms``:
    engine.FUSE_GELU_FP8 (the GELU epilogues on the fc forward and proj dgrad, or none). ``wgds``: the
    dS-storing attention backward, so delayed scaling's dqkv is written in E4M3 by it (fp8.ATTN_E4M3);
    the run without the cast reuse (``fresh``: every operand cast from bf16) then checks its bytes."""
    import andrea.cuda.engine as ce

    if wgds and not _wgds(monkeypatch):
        pytest.skip("the dS-storing attention backward needs a compute capability 9.0 device")
    monkeypatch.setattr(ce, "FUSE_GELU_FP8", frozenset(gemms.split(",")) - {""})
    a = _run(6, scaling=scaling)
    b = _run(6, scaling=scaling)
    for x, y in zip(a[1:4], b[1:4]):
        assert x.tobytes() == y.tobytes()
    assert a[4] == b[4]
    half = _run(3, scaling=scaling)
    if scaling == "current":
        assert half[4] == {}                                 # current scaling: no state beyond w, m, v
    else:
        from andrea.cuda.fp8 import FP8_HEAD, n_sites_for

        assert half[4]["steps"] == 3 and len(half[4]["amax_history"]) == n_sites_for(MC.n_layer, FP8_HEAD)
        assert len(half[4]["weight_amax"]) == 4 * MC.n_layer     # ADAMW_E4M3: the amax the copies were made at
        assert a[4]["steps"] == 6 and max(max(r) for r in a[4]["amax_history"]) > 0
    resumed = _run(3, start=half, scaling=scaling)
    for x, y in zip(a[1:4], resumed[1:4]):
        assert x.tobytes() == y.tobytes()
    assert resumed[4] == a[4]
    eager = _run(6, graph=False, scaling=scaling)
    for x, y in zip(a[1:4], eager[1:4]):
        assert x.tobytes() == y.tobytes()
    import andrea.cuda.fp8 as k8

    with monkeypatch.context() as m:      # without the reuse the GELU backward is k_gelu_bwd on a bf16 h_pre
        m.setattr(k8, "HPRE_E4M3", False)
        ref = _run(6, scaling=scaling)
        fresh = _run(6, memo=False, scaling=scaling)         # every operand cast afresh: the reuse is exact
    for x, y in zip(ref[1:4], fresh[1:4]):
        assert x.tobytes() == y.tobytes()
    acc = _run(3, accum=2, scaling=scaling)
    assert all(np.isfinite(x).all() for x in acc[1:4])


def test_queued_amax_copy_gives_the_synchronous_bytes(monkeypatch):
    """Delayed scaling's history update after the optimizer is queued (Fp8Gemm.queue_amax: the amaxes
    copied to pinned memory before the update, the new scales uploaded from pinned memory, no sync of
    its own) against the synchronous read-back and pageable upload: w, m, v and the history the same
    bytes after 6 steps, with and without gradient accumulation."""
    import andrea.cuda.fp8 as k8

    for accum in (1, 2):
        queued = _run(6, accum=accum, scaling="delayed")
        with monkeypatch.context() as m:
            m.setattr(k8.Fp8Gemm, "queue_amax", lambda self, stream: None)
            sync = _run(6, accum=accum, scaling="delayed")
        for x, y in zip(queued[1:4], sync[1:4]):
            assert x.tobytes() == y.tobytes()
        assert queued[4] == sync[4] and queued[4]["steps"] == 6


@pytest.mark.parametrize("scaling,gemms,kernel", [("current", "", "smem"), ("delayed", "", "smem"),
                                                  ("delayed", "fwd", "smem"), ("current", "", "warp"),
                                                  ("delayed", "fwd", "warp")])
def test_saved_transposes_gelu_cast_and_weight_table_keep_the_bytes(scaling, gemms, kernel, monkeypatch):
    """fp8.SAVE_TRANSPOSES, fp8.DGELU_CAST and the two-launch weight casts on (the default), with either
    transposing cast (fp8.CAST_T), against all three off and the shared-memory cast (every transpose
    cast in the backward, k_gelu_bwd then the cast of dL/dh_pre, the weights one by one): w, m, v and
    the delayed history byte-identical after 6 steps; fp8.LN_E4M3 (delayed scaling's LayerNorms writing
    E4M3) is on in the first. fp8.FC_E4M3 is off in both (it rounds h_act once from fp32, not the same
    bytes: test_e4m3_h_act_tracks_the_bf16_cast), and so is fp8.ADAMW_E4M3 (the weights' scale lags a step:
    test_adamw_e4m3_keeps_the_bytes_at_lr_0_and_tracks_the_weight_casts_after_the_step). On a compute capability 9.0 device both run the
    dS-storing attention backward, and fp8.ATTN_E4M3 (its dqkv written in E4M3) is on in the first only,
    as are fp8.LNB_E4M3 (the residual LayerNorm backwards' branch gradient written in E4M3),
    fp8.ATTN_FWD_E4M3 (the attention forward's y written in E4M3, both orientations) and fp8.ATTN_BWD_T
    (the attention backward writing dqkv's transpose too)."""
    import andrea.cuda.engine as ce
    import andrea.cuda.fp8 as k8

    _wgds(monkeypatch)
    monkeypatch.setattr(ce, "FUSE_GELU_FP8", frozenset(gemms.split(",")) - {""})
    monkeypatch.setattr(k8, "FC_E4M3", False)
    monkeypatch.setattr(k8, "ADAMW_E4M3", False)                # casts at the new weights' amax (the reference)
    monkeypatch.setattr(k8, "CAST_T", kernel)
    monkeypatch.setattr(k8, "ATTN_FWD_E4M3", True)              # off by default (no faster), held to the bytes
    on = _run(6, scaling=scaling)
    monkeypatch.setattr(k8, "CAST_T", "smem")
    monkeypatch.setattr(k8, "SAVE_TRANSPOSES", False)
    monkeypatch.setattr(k8, "DGELU_CAST", False)
    monkeypatch.setattr(k8, "ATTN_E4M3", False)
    monkeypatch.setattr(k8, "ATTN_FWD_E4M3", False)
    monkeypatch.setattr(k8, "ATTN_BWD_T", False)
    monkeypatch.setattr(k8, "LNB_E4M3", False)
    monkeypatch.setattr(k8.Fp8Gemm, "cast_weights", k8.Fp8Gemm.cast_weights_each)
    off = _run(6, scaling=scaling)
    for x, y in zip(on[1:4], off[1:4]):
        assert x.tobytes() == y.tobytes()
    assert on[4] == off[4]


def _tracks(on, off, lr: float, hist_rtol: float, mean_lr: float = 0.1) -> str:
    """Two delayed runs (losses, w, amax history) that differ in rounding only: every step's loss within 2e-3
    relative; the weights: AdamW moves an entry by up to ~lr a step whatever its gradient's size, so an entry
    whose tiny gradient changes sign parts by up to 2 lr a step (max |dw| <= 12 lr over 6 steps), while the
    mean |dw| stays below ``mean_lr`` lr; the histories within ``hist_rtol`` relative. Returns a line to print."""
    (l1, w1, h1), (l0, w0, h0) = on, off
    assert w1.tobytes() != w0.tobytes()
    np.testing.assert_allclose(l1, l0, rtol=2e-3)
    dw = np.abs(w1 - w0)
    assert float(dw.max()) <= 12 * lr and float(dw.mean()) <= mean_lr * lr, (float(dw.max()), float(dw.mean()))
    np.testing.assert_allclose(h1, h0, rtol=hist_rtol, atol=0)
    return (f"losses {l1[-1]:.5f} / {l0[-1]:.5f}, |dw| max {float(dw.max()):.2e} mean {float(dw.mean()):.2e}, "
            f"lr {lr}")


def _delayed_run(lr: float, steps: int = 6):
    """6 delayed-scaling steps from init_weights(0): (losses, w, amax history)."""
    from andrea.cuda.backend import make_backend

    eng = make_backend().make_engine(MC, B, precision="fp8", fp8_scaling="delayed", fp8_amax_history=4)
    eng.init_weights(0)
    losses = [eng.train_step([batch(300 + 7 * t)], lr, t, HP).loss for t in range(1, steps + 1)]
    return eng, (losses, eng.state_host()[0], np.array(eng.extra_state()["amax_history"]))


def test_e4m3_h_act_tracks_the_bf16_cast(monkeypatch):
    """fp8.FC_E4M3 on (the default: delayed scaling's fc GEMM writes h_act in E4M3) against off (bf16
    h_act, then its cast), 6 steps: E4M3 rounded once from fp32 instead of from bf16 moves a code by one
    step where the two roundings part, so the runs differ in the bytes but not in what they learn
    (``_tracks``); the per-site amax histories: the first step's the same (both cast a bf16 h_act), later
    ones within 10% relative (the gradients' amaxes of two runs that part slightly: up to 4.7% on the H200)."""
    import andrea.cuda.engine as ce
    import andrea.cuda.fp8 as k8

    monkeypatch.setattr(ce, "FUSE_GELU_FP8", frozenset({"fwd"}))
    out = {}
    for on in (True, False):
        monkeypatch.setattr(k8, "FC_E4M3", on)
        eng, out[on] = _delayed_run(3e-3)
        assert eng.f8.e4m3_gelu is on
    print("FC_E4M3 on vs off, 6 steps:", _tracks(out[True], out[False], 3e-3, 0.1))


def test_adamw_e4m3_keeps_the_bytes_at_lr_0_and_tracks_the_weight_casts_after_the_step(monkeypatch):
    """fp8.ADAMW_E4M3 on (the default: the optimizer writes the E4M3 copies at the scale of the weights before
    the step) against off (an amax pass and a cast of the new weights after it), delayed scaling, 6 steps.
    At lr 0 the weights never move, so the amax before is the amax after: w, m, v and the history are
    byte-identical, and nothing counts as clipped beyond the off run. At lr 3e-3 a weight's scale lags its
    amax by one step; in this model (weights of amax ~0.05-0.1 moving by up to lr a step) most weights grow
    past their scale early on, and their largest entries saturate by up to ~lr / amax (a few %, below E4M3's
    own step of 6-12%), so the runs part more than FC_E4M3's: every loss within 2e-3 relative, max |dw| <= 12
    lr, mean |dw| <= lr / 4 (H200: 0.12 lr), histories within 10% (``_tracks``). fp8.W8_ONLY (the step leaves
    the matmul weights' bf16 copy alone) gives the same losses, w and history bytes."""
    import andrea.cuda.fp8 as k8

    out, state = {}, {}
    for lr in (0.0, 3e-3):
        for on in (True, False):
            monkeypatch.setattr(k8, "ADAMW_E4M3", on)
            eng, out[lr, on] = _delayed_run(lr)
            assert eng.f8.steps_weights is on and ("weight_amax" in eng.extra_state()) is on
            state[lr, on] = (eng.state_host(), eng.fp8_clipped_total)
    for x, y in zip(state[0.0, True][0], state[0.0, False][0]):
        assert x.tobytes() == y.tobytes()
    assert state[0.0, True][1] == state[0.0, False][1]
    np.testing.assert_array_equal(out[0.0, True][2], out[0.0, False][2])
    print("ADAMW_E4M3 on vs off, 6 steps:", _tracks(out[3e-3, True], out[3e-3, False], 3e-3, 0.1, mean_lr=0.25))
    monkeypatch.setattr(k8, "ADAMW_E4M3", True)
    monkeypatch.setattr(k8, "W8_ONLY", not k8.W8_ONLY)
    eng, flipped = _delayed_run(3e-3)
    for x, y in zip((flipped[1], flipped[2]), (out[3e-3, True][1], out[3e-3, True][2])):
        assert x.tobytes() == y.tobytes()
    assert flipped[0] == out[3e-3, True][0]


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_a_non_finite_input_skips_the_fp8_step(scaling):
    from andrea.cuda.backend import make_backend

    eng = make_backend().make_engine(MC, B, precision="fp8", fp8_scaling=scaling)
    eng.init_weights(0)
    w = eng.state_host()[0]
    layer = eng.layout.tensors[[t.name for t in eng.layout.tensors].index("h.1.mlp.w_fc")]
    w[layer.offset + 5] = np.inf                              # one overflowed weight entry
    eng.load_state(w, np.zeros_like(w), np.zeros_like(w))
    before = eng.state_host()
    res = eng.train_step([batch(9)], 3e-3, 1, HP)
    assert not res.ok
    for p, q in zip(before, eng.state_host()):
        assert p.tobytes() == q.tobytes()
    if scaling == "delayed":                                  # the skipped step's amaxes still enter the history
        assert eng.extra_state()["steps"] == 1
        res = eng.train_step([batch(9)], 3e-3, 2, HP)         # now on delayed scales: still skipped
        assert not res.ok and eng.extra_state()["steps"] == 2


@pytest.mark.parametrize("fc_e4m3", [False, True])
def test_delayed_scaling_counts_clipped_casts_and_its_scales_follow_a_jump(fc_e4m3, monkeypatch):
    """lr = 0 keeps the weights: step 2 repeats step 1 on the history's scales (nothing clips);
    then one layer's w_fc grows 8x: its activations and gradients exceed their scales, they
    saturate at 448 (the step stays finite) and are counted; the history takes the new amaxes,
    and with the same batch and weights the count falls back to 0 within a few steps.
    fp8.FC_E4M3 (the default): the first step casts a bf16 h_act, later ones take the GEMM's E4M3 of
    the unrounded gelu, whose amax can lie a bf16 rounding above the first step's: step 2 may count
    those sites (and what follows from them) as clipped, and the scales that follow may move the sites
    after them once more (with the E4M3 head, fp8.FP8_HEAD, step 3 did: [0, 5, 3, 0] on the H200); once a
    step clips nothing, the next one repeats it."""
    import andrea.cuda.fp8 as k8
    from andrea.cuda.backend import make_backend

    monkeypatch.setattr(k8, "FC_E4M3", fc_e4m3)
    eng = make_backend().make_engine(MC, B, precision="fp8", fp8_scaling="delayed", fp8_amax_history=16)
    eng.init_weights(0)
    xb = batch(21)
    counts = []

    def step(t):
        res = eng.train_step([xb], 0.0, t, HP)
        assert res.ok
        counts.append(eng.fp8_clipped_total - sum(counts))
        return res.loss

    if fc_e4m3:
        ls = [step(t) for t in range(1, 7)]
        assert counts[0] == 0 and abs(ls[1] - ls[0]) <= 1e-3 * abs(ls[0]), (counts, ls)
        # a step that clips nothing leaves every scale as it was, so the next step repeats it
        settled = next((k for k in range(1, 5) if counts[k] == 0), None)
        assert settled is not None and ls[settled + 1] == ls[settled], (counts, ls)
        print(f"fp8 delayed with FC_E4M3, clipped casts per step at lr 0: {counts}")
        t0 = 6
    else:
        l1, l2 = step(1), step(2)
        assert counts == [0, 0] and l1 == l2
        t0 = 2
    w, m, v = eng.state_host()
    layer = eng.layout.tensors[[t.name for t in eng.layout.tensors].index("h.1.mlp.w_fc")]
    w[layer.offset:layer.offset + layer.size] *= 8
    eng.load_state(w, m, v)
    for t in range(t0 + 1, t0 + 7):
        step(t)
    print(f"fp8 delayed, clipped casts per step (w_fc x8 at step {t0 + 1}): {counts}")
    assert counts[t0] > 0 and counts[-1] == 0
