"""The proj dgrad GEMM with gelu' fused (andrea/cuda/mm_dgelu.cu; its launcher and twin in andrea/cuda/kernels.py): on the CPU its
variants and their refusals, the launcher's copy of the file's defaults, the twin's gelu' and the sm_90a
build of every variant (with NVRTC installed); on an H100/H200 each variant against the twin (output
prefilled with NaN, persistent CTAs over several tiles), the same bytes on a repeat, and cuBLASLt's DGELU
GEMM, the engine's call, at one of the step's widths.

    python3 -m pytest -q tests/test_cuda_mm_dgelu.py          # -m gpu for the device tests
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

from andrea.cuda import kernels as K
from andrea.engine.fp8_numpy import bf16_to_f32, f32_to_bf16
from andrea.errors import AndreaError

CU = Path(K.__file__).with_name("mm_dgelu.cu")
VARIANTS = [(), ("MM_CLUSTER=2",), ("MM_BN=192", "MM_STAGES=4"), ("MM_BN=192", "MM_STAGES=4", "MM_CLUSTER=2"),
            ("MM_LDSM=1",), ("MM_LDSM=1", "MM_CLUSTER=2", "MM_BN=192", "MM_STAGES=4"),
            ("MM_CLUSTER=2", "MM_CLUSTER_N=2"), ("MM_CLUSTER_N=2", "MM_BN=192", "MM_STAGES=4"),
            ("MM_XREG=1",), ("MM_XREG=1", "MM_LDSM=1", "MM_CLUSTER=2"), ("MM_XREG=1", "MM_BN=192", "MM_STAGES=4")]
EPS, TOL = 2.0 ** -7, 1e-3        # one bf16 unit of the value, and the fp32 sums' error near zero


def test_the_launcher_holds_the_files_defaults_and_sizes():
    src = CU.read_text()
    found = {k: int(v) for k, v in re.findall(r"#ifndef (MM_\w+)\n#define \1 (\d+)", src)}
    assert found == K.MM_DGELU
    fixed = {k: int(v) for k, v in re.findall(r"#define (MM_BM|MM_BK|MM_THREADS) (\d+)", src)}
    assert fixed == {"MM_BM": K.MM_BM, "MM_BK": K.MM_BK, "MM_THREADS": K.MM_THREADS}
    assert all(f"WG_SS_N{bn}" in src for bn in K.MM_BN_BUILT)
    # 3 stages of (16 + 32) KB, a 64 KB xbuf, 9 barriers, the alignment slack
    assert K.mm_dgelu_smem(K.mm_dgelu_config()) == 3 * 49152 + 65536 + 72 + 1024
    assert K.mm_dgelu_smem(K.mm_dgelu_config(("MM_BN=192", "MM_STAGES=4"))) == 4 * 40960 + 49152 + 88 + 1024


@pytest.mark.parametrize("defines, what", [
    (("MM_BK=32",), "NAME one of MM_BN"),
    (("MM_BN",), "expected NAME=VALUE"),
    (("MM_STAGES=three",), "must be an integer"),
    (("MM_BN=128",), "wgmma for (256, 192) only"),
    (("MM_CLUSTER=4",), "MM_CLUSTER and MM_CLUSTER_N are 1 or 2"),
    (("MM_LDSM=2",), "MM_LDSM, MM_XREG and MM_HANG 0 or 1"),
    (("MM_XREG=2",), "MM_LDSM, MM_XREG and MM_HANG 0 or 1"),
    (("MM_HANG=2",), "MM_LDSM, MM_XREG and MM_HANG 0 or 1"),
    (("MM_STAGES=4",), "take fewer MM_STAGES or MM_BN=192"),     # 4 x 48 KB + 64 KB > 227 KB
])
def test_a_variant_the_kernel_cannot_build_is_refused_by_name(defines, what):
    with pytest.raises(AndreaError, match=re.escape(what)):
        K.mm_dgelu_config(defines)


def test_variants_name_only_what_differs_from_the_file():
    assert K.mm_dgelu_defines(K.mm_dgelu_config()) == ()
    assert K.mm_dgelu_defines(K.mm_dgelu_config(("MM_CLUSTER=2", "MM_BN=256"))) == ("MM_CLUSTER=2",)


def test_problems_fit_whole_cluster_tiles_and_the_grid_takes_whole_clusters():
    one, two, narrow = K.mm_dgelu_config(), K.mm_dgelu_config(("MM_CLUSTER=2",)), K.mm_dgelu_config(("MM_BN=192", "MM_STAGES=4"))
    assert K.mm_dgelu_fits(16384, 6144, 1536, one) and K.mm_dgelu_fits(32768, 3072, 768, two) and K.mm_dgelu_fits(8192, 6144, 1536, narrow)
    assert not K.mm_dgelu_fits(128, 256, 64, two)              # one tile of M: no pair for the cluster
    assert not K.mm_dgelu_fits(256, 6144 + 64, 64, one) and not K.mm_dgelu_fits(256, 256, 96, one)
    assert K.mm_dgelu_grid(16384, 6144, one, 132) == 132
    assert K.mm_dgelu_grid(16384, 6144, two, 132) == 132 and K.mm_dgelu_grid(16384, 6144, two, 133) == 132
    assert K.mm_dgelu_grid(256, 512, two, 132) == 4            # 2 units of 2 tiles: no idle cluster
    assert K.mm_dgelu_grid(512, 768, two, 2) == 2
    quad = K.mm_dgelu_config(("MM_CLUSTER=2", "MM_CLUSTER_N=2"))
    assert K.mm_dgelu_fits(16384, 6144, 1536, quad) and not K.mm_dgelu_fits(256, 256 * 3, 64, quad)
    assert K.mm_dgelu_grid(16384, 6144, quad, 132) == 132 and K.mm_dgelu_grid(512, 1024, quad, 132) == 16   # 2 x 2 units of 2 x 2 tiles


def test_the_twins_gelu_grad_is_the_derivative_of_the_engines_gelu():
    from andrea.engine.ops_numpy import gelu_forward

    x = np.linspace(-8.0, 8.0, 4001)
    h = 1e-5
    up, dn = np.empty((1, x.size)), np.empty((1, x.size))
    gelu_forward(up, (x + h)[None, :])
    gelu_forward(dn, (x - h)[None, :])
    np.testing.assert_allclose(K.gelu_grad(x), (up - dn)[0] / (2 * h), rtol=1e-6, atol=1e-8)
    assert K.gelu_grad(np.array([-1e4]))[0] == 0.0 and K.gelu_grad(np.array([1e4]))[0] == 1.0


def test_the_twin_is_the_product_where_gelu_prime_is_one_and_zero_where_it_vanishes():
    rng = np.random.default_rng(0)
    a, b = (f32_to_bf16(rng.standard_normal(s).astype(np.float32)) for s in ((6, 64), (4, 64)))
    x = np.full((6, 4), f32_to_bf16(np.float32(30.0)), np.uint16)          # gelu'(30) rounds to 1
    prod = bf16_to_f32(a).astype(np.float64) @ bf16_to_f32(b).astype(np.float64).T
    assert (K.mm_dgelu_reference(a, b, x) == f32_to_bf16(prod.astype(np.float32))).all()
    x[:] = f32_to_bf16(np.float32(-30.0))                                   # gelu'(-30) = 0 in fp16
    assert (bf16_to_f32(K.mm_dgelu_reference(a, b, x)) == 0.0).all()


def test_f32_to_bf16_rounds_to_nearest_even():
    v = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5], np.float32)    # ties to even: down, then up
    assert bf16_to_f32(f32_to_bf16(v)).tolist() == [1.0, 1.0, 1.0 + 2 ** -6, -2.5]


def _resources_or_skip():
    from andrea.cuda import loader

    try:
        from cuda.bindings import nvrtc

        if nvrtc.nvrtcVersion()[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise ImportError
        loader._cuobjdump()
    except (ImportError, AndreaError):
        pytest.skip("cuda-bindings / nvidia-cuda-nvrtc / nvidia-cuda-cuobjdump not installed")
    return loader


@pytest.mark.parametrize("defines", VARIANTS, ids=lambda d: ",".join(d) or "default")
def test_every_variant_builds_for_sm_90a_without_spilling(defines):
    loader = _resources_or_skip()
    use = loader.resource_usage("mm_dgelu.cu", "sm_90a", defines)["k_mm_dgelu"]
    # one CTA of 384 threads an SM: at most 168 registers a thread; a stack frame would be spilled registers
    assert use["stack"] == 0 and use["local"] == 0 and use["registers"] <= 168
    # on the plain sm_90 target the file compiles to nothing (no wgmma there)
    assert loader.compile_log("mm_dgelu.cu", "sm_90", defines) is None


# ----------------------------------------------------------------------------------------- GPU
def _hopper_or_skip():
    from andrea.cuda.loader import cupy_or_none

    cp = cupy_or_none()
    if cp is None:
        pytest.skip("CuPy cannot be imported or finds no CUDA device")
    if not K.hopper():
        pytest.skip("k_mm_dgelu needs a compute capability 9.0 device")
    return cp


def _operands(cp, M, N, k, seed=0):
    rng = np.random.default_rng(seed)
    a = f32_to_bf16(rng.standard_normal((M, k)).astype(np.float32))
    b = f32_to_bf16((rng.standard_normal((N, k)) / math.sqrt(k)).astype(np.float32))
    x = f32_to_bf16((2.0 * rng.standard_normal((M, N))).astype(np.float32))
    return (a, b, x), tuple(cp.asarray(v) for v in (a, b, x))


def _assert_close(got, ref):
    g, r = bf16_to_f32(got).astype(np.float64), bf16_to_f32(ref).astype(np.float64)
    assert not np.isnan(g).any(), f"{int(np.isnan(g).sum())} elements left unwritten (NaN prefill)"
    bad = np.abs(g - r) > TOL + EPS * np.abs(r)
    assert not bad.any(), f"{int(bad.sum())} elements out of tolerance, worst {np.abs(g - r).max():.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("defines", VARIANTS, ids=lambda d: ",".join(d) or "default")
def test_each_variant_matches_the_twin_over_several_tiles_a_cta_and_repeats_its_bytes(defines):
    cp = _hopper_or_skip()
    M, N, k = 512, 1536, 320                 # N a multiple of 2 x 256 and 2 x 192; 5 k steps wrap every ring
    host, (a, b, x) = _operands(cp, M, N, k)
    mm = K.MmDgelu(defines)
    cs = mm.cfg["MM_CLUSTER"] * mm.cfg["MM_CLUSTER_N"]
    assert mm.slots >= cs and mm.slots % cs == 0          # whole clusters, as the driver can place them
    d = cp.full((M, N), 0x7FC0, cp.uint16)   # bf16 NaN: an element never written shows
    mm(d, a, b, x, ctas=4)                   # at most one cluster: every CTA runs several tiles
    first = cp.asnumpy(d)
    _assert_close(first, K.mm_dgelu_reference(*host))
    d.fill(0x7FC0)
    mm(d, a, b, x)                           # the full persistent grid: same bytes
    assert (cp.asnumpy(d) == first).all()


@pytest.mark.gpu
def test_the_kernel_agrees_with_cublaslts_dgelu_gemm_at_a_step_width():
    cp = _hopper_or_skip()
    from andrea.cuda.cublaslt import EPILOGUE_DGELU, Lt

    M, N, k = 2048, 3072, 768                # 120M's proj dgrad widths, 2 sequences
    _, (a, b, x) = _operands(cp, M, N, k, seed=1)
    ours, lt_out = cp.full((M, N), 0x7FC0, cp.uint16), cp.full((M, N), 0x7FC0, cp.uint16)
    K.MmDgelu()(ours, a, b, x)
    Lt(cp.empty(32 << 20, cp.uint8)).mm(lt_out, a, b, tb=True, epilogue=EPILOGUE_DGELU, aux=x)
    got, ref = bf16_to_f32(cp.asnumpy(ours)), bf16_to_f32(cp.asnumpy(lt_out))
    assert not np.isnan(got).any()
    assert (np.abs(got - ref) <= 2e-3 + EPS * np.abs(ref)).all()


@pytest.mark.gpu
def test_a_problem_the_variant_does_not_cover_is_refused_before_launch():
    cp = _hopper_or_skip()
    mm = K.MmDgelu(("MM_CLUSTER=2",))
    a, b, x = cp.zeros((128, 64), cp.uint16), cp.zeros((256, 64), cp.uint16), cp.zeros((128, 256), cp.uint16)
    with pytest.raises(AndreaError, match="M must be a multiple of 256"):
        mm(cp.zeros((128, 256), cp.uint16), a, b, x)
    with pytest.raises(AndreaError, match="argument D has shape"):
        mm(cp.zeros((128, 255), cp.uint16), a, b, x)


# ----------------------------------------------------------------------------------------- the engine's switch
def test_own_dgelu_plans_its_maps_in_the_arena_for_bf16_only(monkeypatch):
    import andrea.cuda.engine as ce
    from andrea.engine.model import ModelConfig
    from andrea.memory import plan_items

    mc = ModelConfig(vocab_size=300, d_model=128, n_head=2, n_layer=3, context=256)
    off = ce.arena_layout(mc, 2, "bf16")
    monkeypatch.setattr(ce, "OWN_DGELU", True)
    on = ce.arena_layout(mc, 2, "bf16")
    assert ("dgelu_maps", (3, 512), np.uint8) in on.spec and all(e[0] != "dgelu_maps" for e in off.spec)
    assert 0 < on.nbytes - off.nbytes <= 3 * 512 + 512
    for prec in ("fp32", "fp16", "fp8"):
        assert all(e[0] != "dgelu_maps" for e in ce.arena_layout(mc, 2, prec).spec)
    assert sum(plan_items(mc, 2, "bf16", grad_accum=None).values()) == ce.arena_layout(mc, 2, "bf16").nbytes


def test_the_engine_sends_a_dgelu_gemm_to_the_kernel_only_where_it_takes_the_call():
    import andrea.cuda.engine as ce
    from andrea.cuda.cublaslt import EPILOGUE_DGELU, EPILOGUE_DEFAULT

    calls = []

    class Own:
        def __init__(self, ok):
            self.ok = ok

        def takes(self, C, A, B, X, ta, tb, beta):
            calls.append(("takes", ta, tb, beta))
            return self.ok

        def __call__(self, C, A, B, X):
            calls.append(("own", X))

    class Next:                                   # the path a call falls through to (here fp8's)
        def mm(self, C, A, B, **k):
            calls.append(("next", k["epilogue"], k["aux"]))

    ops = ce.FastOps("bf16", None, {})
    ops.f8 = Next()
    ops.dgelu = Own(True)
    ops._mm("dh", "dout", "w_proj", tb=True, epilogue=EPILOGUE_DGELU, aux="h_pre")
    ops._mm("h", "x", "w_fc", epilogue=EPILOGUE_DEFAULT)              # not a DGELU call: never asked
    ops.dgelu = Own(False)
    ops._mm("dh", "dout", "w_proj", tb=True, epilogue=EPILOGUE_DGELU, aux="h_pre")
    assert calls == [("takes", False, True, 0.0), ("own", "h_pre"), ("next", EPILOGUE_DEFAULT, None),
                     ("takes", False, True, 0.0), ("next", EPILOGUE_DGELU, "h_pre")]


@pytest.mark.gpu
def test_a_wait_that_does_not_end_fails_the_launch_instead_of_hanging():
    # MM_HANG=1: no load is ever issued, so the consumers' first wait never ends; MM_WATCHDOG=1000000 (1 ms)
    # traps it. In a child, since a trap ends the context. (A working launch's waits are too short to trip
    # even a 1 ns watchdog reliably: it reads the timer every 1024 polls, and session 33's H200 never did.)
    import subprocess
    import sys

    _hopper_or_skip()
    code = ("import cupy as cp\n"
            "from andrea.cuda.kernels import MmDgelu\n"
            "a, b, x = cp.zeros((512, 1536), cp.uint16), cp.zeros((768, 1536), cp.uint16), cp.zeros((512, 768), cp.uint16)\n"
            "MmDgelu(('MM_HANG=1', 'MM_WATCHDOG=1000000'))(cp.zeros((512, 768), cp.uint16), a, b, x)\n"
            "cp.cuda.Device().synchronize()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode != 0 and "Error" in r.stderr, r.stderr[-2000:]

