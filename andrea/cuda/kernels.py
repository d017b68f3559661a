"""Launch geometry, argument checks and cuBLAS for ANDREA's CUDA kernels: one Python launcher per
kernel of ``andrea/cuda/*.cu`` (grid, block, argument order), the dtype/shape/contiguity checks
made before a launch (``need``), and the row-major GEMM over cuBLAS (``Blas``: the fp32 engine's, the
mirror's and fp8's bf16 head; the bf16/fp16 engine's GEMMs are ``cublaslt.Lt.mm``). The op sets that
call these are ``andrea/cuda/mirror.py`` (fp32, ops_numpy's contract) and ``andrea/cuda/engine.py``
(the mixed-precision engine).

    from andrea.cuda.kernels import Blas, k_layernorm_fwd
    k_layernorm_fwd("bf16", y, mean, rstd, x, g, b, N, C)      # y (N, C) uint16 bf16 payload

Storage types: prec is fp32 | bf16 | fp16; 16-bit arrays are uint16 payloads. Large matmuls go to
cuBLAS (``cublasGemmEx``, fp32 accumulation, no TF32; deterministic for fixed shapes). The kernels
are compiled through ``andrea.cuda.loader``; importing this module needs neither CuPy nor a GPU.
"""

from __future__ import annotations

import ctypes
import functools
import math

import numpy as np

from andrea.cuda.loader import kernel
from andrea.engine.fp8_numpy import bf16_to_f32, f32_to_bf16
from andrea.engine.ops_numpy import GELU_A, GELU_K
from andrea.errors import AndreaError

# cudaDataType / cublas enums (cublas_api.h, library_types.h)
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
LN_EPS = 1e-5
LN_ROWS_PER_CHUNK = 32
NORM_BLOCKS = 512

SUFFIX = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}
LOWTYPE = {"fp32": CUDA_R_32F, "bf16": CUDA_R_16BF, "fp16": CUDA_R_16F}


def cp():
    import cupy  # noqa: PLC0415

    return cupy


# ----------------------------------------------------------------------------- launch helpers
def need(op: str, name: str, a, dtype=None, shape=None, size=None) -> None:
    """Refuse an argument the kernel would misread: wrong dtype, shape, size or a strided view."""
    if a is None:
        raise AndreaError(f"cuda op {op}: argument {name} is None")
    if not a.flags.c_contiguous:
        raise AndreaError(f"cuda op {op}: argument {name} must be C-contiguous (shape {a.shape}, strides {a.strides})")
    if dtype is not None and a.dtype != np.dtype(dtype):
        raise AndreaError(f"cuda op {op}: argument {name} has dtype {a.dtype}, expected {np.dtype(dtype)}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise AndreaError(f"cuda op {op}: argument {name} has shape {tuple(a.shape)}, expected {tuple(shape)}")
    if size is not None and a.size != size:
        raise AndreaError(f"cuda op {op}: argument {name} has {a.size} elements, expected {size}")


def ptr(a, offset_elems: int = 0) -> np.uint64:
    return np.uint64(a.data.ptr + offset_elems * a.dtype.itemsize)


def i32(v) -> np.int32:
    return np.int32(v)


def f32(v) -> np.float32:
    return np.float32(v)


def blocks(n: int, t: int = 256) -> int:
    return (int(n) + t - 1) // t


class Blas:
    """Row-major GEMM over cuBLAS: C (M, N) = alpha op(A) op(B) + beta C, fp32 accumulation."""

    def __init__(self):
        from cupy.cuda import cublas  # noqa: PLC0415

        self.cublas = cublas
        self.cp = cp()
        self._one = np.ones(1, dtype=np.float32)
        self._zero = np.zeros(1, dtype=np.float32)
        # CuPy's cuBLAS wrapper refuses calls while a stream is being captured; the C entry points
        # of the very library CuPy loaded (already in the process) take the same arguments and are
        # legal inside a capture, so the GEMMs go through ctypes.
        self._lib = None
        import ctypes  # noqa: PLC0415

        for name in ("libcublas.so.13", "libcublas.so.12", "libcublas.so"):
            try:
                lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
                f = lib.cublasGemmEx
                P, I = ctypes.c_void_p, ctypes.c_int
                f.argtypes = [P, I, I, I, I, I, P, P, I, I, P, I, I, P, P, I, I, I, I]
                f.restype = I
                g = lib.cublasSetStream_v2
                g.argtypes = [P, P]
                g.restype = I
                self._lib = lib
                break
            except (OSError, AttributeError):
                continue

    def mm(self, C, A, B, ta: bool = False, tb: bool = False, beta: float = 0.0, lowtype: int = CUDA_R_32F) -> None:
        def tcode(a):
            if a.dtype == np.float32:
                return CUDA_R_32F
            if a.dtype == np.uint16:
                return lowtype
            raise AndreaError(f"cuda gemm: unsupported dtype {a.dtype}")

        for nm, a in (("A", A), ("B", B), ("C", C)):
            if a.ndim != 2 or not a.flags.c_contiguous:
                raise AndreaError(f"cuda gemm: {nm} must be a C-contiguous matrix (shape {a.shape})")
        M, K = (A.shape[1], A.shape[0]) if ta else A.shape
        Kb, N = (B.shape[1], B.shape[0]) if tb else B.shape
        if K != Kb or C.shape != (M, N):
            raise AndreaError(f"cuda gemm: shapes do not chain: op(A) {M}x{K}, op(B) {Kb}x{N}, C {C.shape}")
        h = self.cp.cuda.device.get_cublas_handle()
        alpha = self._one
        b = self._one if beta == 1.0 else self._zero
        if beta not in (0.0, 1.0):
            raise AndreaError("cuda gemm: beta must be 0 or 1")
        if self._lib is not None:
            st = self._lib.cublasSetStream_v2(h, self.cp.cuda.get_current_stream().ptr)
            rc = self._lib.cublasGemmEx(h, 1 if tb else 0, 1 if ta else 0, N, M, K, alpha.ctypes.data,
                                        B.data.ptr, tcode(B), B.shape[1], A.data.ptr, tcode(A), A.shape[1],
                                        b.ctypes.data, C.data.ptr, tcode(C), N, CUBLAS_COMPUTE_32F,
                                        CUBLAS_GEMM_DEFAULT)
            if st or rc:
                raise AndreaError(f"cuda gemm: cuBLAS status {st or rc} for {M}x{N}x{K}")
            return
        self.cublas.setStream(h, self.cp.cuda.get_current_stream().ptr)
        self.cublas.gemmEx(h, 1 if tb else 0, 1 if ta else 0, N, M, K, alpha.ctypes.data,
                           B.data.ptr, tcode(B), B.shape[1], A.data.ptr, tcode(A), A.shape[1],
                           b.ctypes.data, C.data.ptr, tcode(C), N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)


# ----------------------------------------------------------------------------- kernel wrappers
# Storage-type-generic wrappers (prec in fp32 | bf16 | fp16; 16-bit arrays are uint16 payloads).

def _ln_aligned(C: int, *arrays) -> bool:
    """The float4 LayerNorm kernels need C % 4 == 0 and 16-byte aligned buffers."""
    return C % 4 == 0 and all(a.data.ptr % 16 == 0 for a in arrays)


def _ln_vec(C: int, *arrays) -> int | None:
    """V (float4 columns per lane / 32) of the vectorized LayerNorm forward, or None for the scalar one."""
    if not _ln_aligned(C, *arrays):
        return None
    return next((V for V in (1, 2, 3, 6, 12, 16) if C // 4 <= 32 * V), None)


# (V, R) of the vectorized LayerNorm backwards compiled in layernorm.cu: R warps share a row, each lane
# owns V float4 columns (C <= 128 R V). ln_bwd_vr picks the one run: R the fewest warps that cover
# the row with V <= 3 (x, dy and dx of the row and the lane's dg/db partials stay in registers).
# (6, 1), (6, 2) and (4, 4) are the alternatives `bench/layernorm_gpu.py --sweep` times: on the H200
# (3, 2) took 0.0985 ms at 32768 x 768 against 0.1033 for (6, 1) and 0.1062 for (2, 4); (3, 4) 0.0537 ms
# at 8192 x 1536 against 0.0591 for (6, 2) and 0.0644 for (2, 8) (docs/bench/layernorm_h200.md).
LN_BWD_BUILT = frozenset({(1, 1), (2, 1), (3, 1), (6, 1), (2, 2), (3, 2), (6, 2), (2, 4), (3, 4), (4, 4),
                          (2, 8), (3, 8)})


def ln_bwd_vr(C: int) -> tuple[int, int] | None:
    """(V, R) of the backward for width C (C % 4 == 0), or None past C = 3072 (the scalar kernels)."""
    c4 = C // 4
    for R in (1, 2, 4, 8):
        if c4 <= 3 * 32 * R:
            return -(-c4 // (32 * R)), R
    return None


def k_layernorm_fwd(prec, y, mean, rstd, x, g, b, N, C):
    V = _ln_vec(C, x, g, b, y)
    name = f"k_layernorm_fwd4_{SUFFIX[prec]}_v{V}" if V else f"k_layernorm_fwd_{SUFFIX[prec]}"
    kernel("layernorm.cu", name)((blocks(N, 8),), (256,), (x, g, b, y, mean, rstd, i32(N), i32(C), f32(LN_EPS)))


def k_residual_layernorm_fwd(prec, xo, y, mean, rstd, a, br, g, b, N, C):
    """xo (N, C) fp32 = a + br (br in storage type prec), then y, mean, rstd = LayerNorm(xo): the
    bits of k_residual_add followed by k_layernorm_fwd, one kernel where the rows allow it."""
    V = _ln_vec(C, a, br, xo, g, b, y)
    if V is None:
        k_residual_add(prec, xo, a, br, N * C)
        k_layernorm_fwd(prec, y, mean, rstd, xo, g, b, N, C)
        return
    kernel("layernorm.cu", f"k_residual_layernorm_fwd4_{SUFFIX[prec]}_v{V}")(
        (blocks(N, 8),), (256,), (a, br, xo, g, b, y, mean, rstd, i32(N), i32(C), f32(LN_EPS)))


def ln_e4m3_fits(N: int, C: int, *arrays) -> bool:
    """The E4M3 LayerNorm forwards take these rows: the vectorized kernels, and N a multiple of a block's 8."""
    return N % 8 == 0 and _ln_vec(C, *arrays) is not None


def k_layernorm_fwd_e4m3(y8, mean, rstd, x, g, b, N, C, sc, rec, a=None, br=None):
    """The fp8 engine's LayerNorm forward straight to E4M3 (fp8.LN_E4M3): y8 (N, C) uint8 =
    E4M3(bf16(LayerNorm(x)) * sc[0]) and mean, rstd as k_layernorm_fwd; the max |bf16 value| over the
    finite entries atomicMax-ed into rec[0]: the bytes of k_layernorm_fwd (bf16) then fp8.cu's delayed
    cast. With ``a``, ``br`` (bf16): x (fp32) = a + br first, as k_residual_layernorm_fwd."""
    arrays = (x, g, b) if a is None else (a, br, x, g, b)
    if not ln_e4m3_fits(N, C, *arrays):
        raise AndreaError(f"cuda op layernorm_forward (E4M3): {N} x {C} rows need the vectorized kernel "
                          f"(C % 4 == 0, C <= 2048, 16-byte aligned rows) and N a multiple of 8")
    V = _ln_vec(C, *arrays)
    tail = (y8, mean, rstd, i32(N), i32(C), f32(LN_EPS), sc, rec)
    if a is None:
        kernel("layernorm.cu", f"k_layernorm_fwd4_e4m3_v{V}")((blocks(N, 8),), (256,), (x, g, b, *tail))
    else:
        kernel("layernorm.cu", f"k_residual_layernorm_fwd4_e4m3_v{V}")((blocks(N, 8),), (256,), (a, br, x, g, b, *tail))


def k_layernorm_wsum(dg, db, part, n_chunks, C):
    """dg, db (C,) += the column sums of part (n_chunks, 2, C) over its chunks, in a fixed order."""
    kernel("layernorm.cu", "k_layernorm_bwd_wsum")((blocks(C, 32),), (32, 32), (part, dg, db, i32(n_chunks), i32(C)))


def k_layernorm_bwd(prec, dx, dg, db, dy, x, mean, rstd, g, part, N, C, dlow=None, vr=None, e4m3=None):
    """dx (N, C) fp32 += ...; dg, db (C,) += ...; part holds >= ceil(N/32)*2*C floats of scratch.
    ``dlow`` (N, C) in storage type prec, if given, = the updated dx (the branch gradient's cast,
    ``residual_add_backward``); ``vr`` overrides ln_bwd_vr (bench/layernorm_gpu.py's sweep).
    ``e4m3`` (fp8, bf16, the vectorized kernel): (d8, sc, rec) instead of dlow: the updated dx as E4M3
    bytes (N, C) at scale sc[0], its max |bf16 value| atomicMax-ed into rec[0] (fp8.LNB_E4M3: the bytes
    of the bf16 dlow followed by fp8.cu's cast at that scale)."""
    s = SUFFIX[prec]
    n_chunks = (N + LN_ROWS_PER_CHUNK - 1) // LN_ROWS_PER_CHUNK
    if part.size < n_chunks * 2 * C:
        raise AndreaError(f"cuda op layernorm_backward: scratch has {part.size} floats, needs {n_chunks * 2 * C}")
    if e4m3 is not None:                               # the E4M3 kernels: dlow's place, and (sc, rec) after
        dlow, tail, s = e4m3[0], tuple(e4m3[1:]), "e4m3"
    else:
        tail = ()
    vec = _ln_aligned(C, x, g, dy, dx, *(() if dlow is None else (dlow,)))
    V, R = vr or (ln_bwd_vr(C) if vec else None) or (None, None)
    if e4m3 is not None and not (prec == "bf16" and vec and V):
        raise AndreaError(f"cuda op layernorm_backward (E4M3): {N} x {C} rows need bf16 and the vectorized kernel "
                          f"(C % 4 == 0, C <= 3072, 16-byte aligned rows)")
    if vec and V:
        if (V, R) not in LN_BWD_BUILT or C // 4 > 32 * R * V:
            raise AndreaError(f"cuda op layernorm_backward: no kernel with V={V}, R={R} for C={C}")
        kernel("layernorm.cu", f"k_layernorm_bwd4_{s}_v{V}_r{R}")(
            (n_chunks,), (256,), (x, g, mean, rstd, dy, dx, np.uint64(0) if dlow is None else dlow, part,
                                  i32(N), i32(C), i32(LN_ROWS_PER_CHUNK), *tail))
    else:
        kernel("layernorm.cu", f"k_layernorm_bwd_{s}")((blocks(N, 8),), (256,),
                                                       (x, g, mean, rstd, dy, dx, i32(N), i32(C)))
        kernel("layernorm.cu", f"k_layernorm_bwd_wpart_{s}")(
            (blocks(C, 128), n_chunks), (128,), (x, mean, rstd, dy, part, i32(N), i32(C), i32(LN_ROWS_PER_CHUNK)))
        if dlow is not None:
            k_cast(prec, dlow, dx, N * C)
    k_layernorm_wsum(dg, db, part, n_chunks, C)


def _vec8(n: int, *arrays) -> bool:
    """The 8-wide kernels need n % 8 == 0 and 16-byte aligned buffers."""
    return n % 8 == 0 and all(a.data.ptr % 16 == 0 for a in arrays)


def _ew(name: str, prec: str, n: int, *arrays) -> None:
    """Launch elementwise.cu's k_<name>_<t> over n elements, arrays in kernel order; its 8-wide
    twin k_<name>8_<t> where n and every buffer allow it."""
    if _vec8(n, *arrays):
        kernel("elementwise.cu", f"k_{name}8_{SUFFIX[prec]}")((blocks(n // 8),), (256,), (*arrays, np.int64(n // 8)))
    else:
        kernel("elementwise.cu", f"k_{name}_{SUFFIX[prec]}")((blocks(n),), (256,), (*arrays, np.int64(n)))


def k_gelu_fwd(prec, y, x, n):
    _ew("gelu_fwd", prec, n, x, y)


def k_gelu_bwd(prec, dx, dy, x, n):
    _ew("gelu_bwd", prec, n, x, dy, dx)


def k_residual_add(prec, out, a, b, n):
    _ew("residual_add", prec, n, a, b, out)


def k_cast(prec, dst, src, n):
    _ew("cast", prec, n, src, dst)


def k_scale(g, n, s):
    kernel("optim.cu", "k_scale")((blocks(n),), (256,), (g, np.int64(n), f32(s)))


# The tensor-core kernels each pass runs on a compute capability 9.0 device: "wg" (wgmma) or "mma"
# (mma.sync). H200, one layer, session 9 (docs/bench/attn_wgmma_h200.md): the wgmma forward (the
# FlashAttention-3 order: softmax under the P V product) 0.0505 / 0.2626 / 0.1425 ms against mma's
# 0.0567 / 0.2770 / 0.1498 (12M B=8, 120M B=32, 480M B=8), the wgmma backward 0.140 / 0.893 / 0.469
# against 0.184 / 0.965 / 0.512. The whole step, same call (`bench/engine_gpu.py --attn F,B`), wg,wg
# against mma,wg: 4.13 vs 4.26 ms (12M B=8), 25.94 vs 26.35 (B=64), 52.49 vs 53.37 (120M B=32),
# 53.62 vs 54.19 (480M B=8); the engine gpu tests pass with either pair (213 passed).
# Session 12: the backward "wgds" (the dK/dV kernel stores dS, the dQ kernel does one product a tile
# instead of recomputing S and dP: 5 tile products instead of 7), one layer 0.771 vs 0.894 ms
# (120M B=32) and 0.406 vs 0.466 (480M B=8), but 0.146 vs 0.141 at D = 32 (12M B=8: the dS bytes are
# the same, the products saved half as long), so D = 32 keeps "wg"; docs/bench/attn_ds_h200.md.
# A pass's pick is one name, or a dict by head size.
ATTN_HOPPER = {"fwd": "wg", "bwd": {32: "wg", 64: "wgds"}}


def attn_impl(prec: str, D: int, ld: int, which: str = "fwd") -> str:
    """The attention kernels of pass ``which`` (fwd | bwd) for this storage type and head size:
    tensor cores for bf16/fp16 at D = 32/64 ("wg"/"wgds" or "mma", ATTN_HOPPER's pick on a compute
    capability 9.0 device, else "mma"), else "simt"."""
    if prec in ("bf16", "fp16") and D in (32, 64) and ld % 8 == 0:
        if not hopper():
            return "mma"
        pick = ATTN_HOPPER[which]
        return pick[D] if isinstance(pick, dict) else pick
    if D not in (8, 16, 32, 64, 128):
        raise AndreaError(f"cuda attention: head size D={D} is not supported (8, 16, 32, 64 or 128)")
    return "simt"


@functools.cache
def hopper() -> bool:
    """True on a compute capability 9.0 device (H100/H200): the wgmma kernels exist there."""
    return cp().cuda.Device().compute_capability == "90"


# Rows per block of the mma.sync attention kernels (64: 16 per warp, 128: 32 per warp), per
# (kernel, head size): the fastest of each in one `bench/engine_gpu.py --attn-sweep` run on the H200
# (12M B=8, 120M B=32, 480M B=8, one layer; summed per head size). The backward's 64-row pair beat
# 128/128 by 15% at D=32 (0.182 vs 0.213 ms) and 14% at D=64 (1.463 vs 1.699 ms); the forward is
# within 3% either way. Every choice is tested against the NumPy twin (tests/test_cuda_kernels.py).
ATTN_MMA_ROWS = {("fwd", 32): 64, ("fwd", 64): 128, ("dq", 32): 64, ("dq", 64): 64,
                 ("dkv", 32): 64, ("dkv", 64): 64}
# Rows per block of the wgmma kernels: 64 per warpgroup, one or two warpgroups (the forward also four);
# the fastest of each in the same sweep (dq 128 / dkv 64 beat 128 / 128 by 1-12%; the forward 128 beat
# 64 by 8-33%). Session 13 (bench/attention_gpu.py, H200): the forward at 256 rows, 0.2477 vs 0.2637 ms
# (120M B=32) and 0.1341 vs 0.1418 (480M B=8) at D = 64, but 0.0561 vs 0.0501 at D = 32 (12M B=8),
# so D = 32 keeps 128. The ex2.approx.ftz exponential in place of exp2f (3 fewer instructions a
# score) measured no change in either pass (0.2624 vs 0.2622 ms forward) and was left out.
ATTN_WG_ROWS = {("fwd", 32): 128, ("fwd", 64): 256, ("dq", 32): 128, ("dq", 64): 128,
                ("dkv", 32): 64, ("dkv", 64): 64}


def _attn_launch(impl: str, which: str, prec: str, D: int, T: int, BH: int, rows=None):
    """(kernel name, grid, block) of attention kernel ``which`` (fwd | dq | dkv); ``rows`` overrides
    ATTN_MMA_ROWS / ATTN_WG_ROWS. simt blocks have one thread per row (64, or 32 at D = 128).
    "wgds" is the wgmma backward whose dK/dV kernel stores dS for a dQ kernel of one product a tile."""
    name = {"fwd": "fwd", "dq": "bwd_dq", "dkv": "bwd_dkv"}[which]
    if impl == "wgds":
        tile = rows or ATTN_WG_ROWS[(which, D)]
        return f"k_attn_{name}s_wg_{SUFFIX[prec]}_d{D}_r{tile}", ((T + tile - 1) // tile, BH), (2 * tile,)
    if impl == "wg":
        tile = rows or ATTN_WG_ROWS[(which, D)]
        return f"k_attn_{name}_wg_{SUFFIX[prec]}_d{D}_r{tile}", ((T + tile - 1) // tile, BH), (2 * tile,)
    if impl == "mma":
        tile = rows or ATTN_MMA_ROWS[(which, D)]
        return f"k_attn_{name}_mma_{SUFFIX[prec]}_d{D}_r{tile}", ((T + tile - 1) // tile, BH), (128,)
    tile = 64 if D <= 64 else 32
    return f"k_attn_{name}_simt_{SUFFIX[prec]}_d{D}", ((T + tile - 1) // tile, BH), (tile,)


def _tensor_impl(prec: str, D: int, ld: int, impl: str | None, which: str) -> str:
    """attn_impl, or ``impl`` ("mma" | "wg" | "wgds", the latter a backward: its forward is "wg")
    where the caller picks one of the tensor-core kernels."""
    auto = attn_impl(prec, D, ld, which)
    if impl is None or auto == "simt":
        return auto
    if impl == "wgds" and which == "fwd":
        impl = "wg"
    if impl in ("wg", "wgds") and not hopper():
        raise AndreaError("cuda attention: the wgmma kernels need a compute capability 9.0 device (H100/H200)")
    return impl


def k_attn_fwd(prec, y, lse2, qkv, B, T, C, H, rows=None, impl=None, e4m3=None):
    """qkv (B*T, 3C) -> y (B*T, C), lse2 (B*H, T). ``impl``: "mma" or "wg" instead of attn_impl's pick.
    ``e4m3`` (fp8: the "wg" forward in bf16): (y8, y8t, sc, rec): y also as E4M3 bytes into y8 (B*T, C)
    at scale sc[0] and, y8t not None, transposed into y8t (C, B*T); the amax into rec[0] (atomicMax): the
    bytes of the bf16 y followed by fp8.cu's cast at that scale."""
    D = C // H
    impl = _tensor_impl(prec, D, 3 * C, impl, "fwd")
    name, grid, block = _attn_launch(impl, "fwd", prec, D, T, B * H, rows)
    sl2 = math.log2(math.e) / math.sqrt(D)
    args = (ptr(qkv), ptr(qkv, C), ptr(qkv, 2 * C), i32(3 * C), y, i32(C), lse2, i32(T), i32(H), f32(sl2))
    if e4m3 is not None:
        if impl != "wg" or prec != "bf16":
            raise AndreaError(f"cuda attention: an E4M3 y needs the \"wg\" forward in bf16 (got {impl}, {prec})")
        y8, y8t, sc, rec = e4m3
        name = name.replace("k_attn_fwd_wg_", "k_attn_fwd8_wg_")
        args += (ptr(y8), np.uint64(0) if y8t is None else ptr(y8t), np.int64(B * T), ptr(sc), ptr(rec))
    kernel("attention.cu", name)(grid, block, args)


def attn_ds_bytes(T: int, heads: int = 1) -> int:
    """Bytes of the stored dS tiles of the "wgds" backward for ``heads`` (batch x head) pairs: the
    causal 64 x 64 tile pairs of T rows, 16-bit."""
    nt = (T + 63) // 64
    return heads * nt * (nt + 1) // 2 * 64 * 64 * 2


def k_attn_bwd(prec, dqkv, dy, y, lse2, dvec, qkv, B, T, C, H, accumulate: bool, rows=None, impl=None,
               ds=None, e4m3=None):
    """dqkv (B*T, 3C) (+)= d/dqkv; y is the forward output, dvec (B*H, T) scratch. The mma dQ kernel
    computes dvec (sum_d dy y per row) itself, before the dK/dV kernel reads it; simt and "wgds" run a
    dvec kernel first. ``rows``: (dq rows, dkv rows) overriding ATTN_MMA_ROWS; ``impl`` as k_attn_fwd's.
    "wgds" (dQ from the dS tiles the dK/dV kernel stores) needs ``ds``, a scratch device array of any
    dtype, or a pair of them (a head's tiles lie in one or the other): the heads go in as many launches
    as ``attn_ds_bytes`` says fit (None: allocated here).
    ``e4m3`` (fp8, "wgds", bf16, accumulate off): (d8, sc, rec) or (d8, sc, rec, d8t): dqkv is written as
    E4M3 bytes into d8 (B*T, 3C) at scale sc[0] instead, its amax atomicMax-ed into rec[0] (the bytes of
    the bf16 dqkv followed by fp8.cu's cast at that scale), and, d8t given, also transposed into d8t
    (3C, B*T)."""
    D = C // H
    impl = _tensor_impl(prec, D, 3 * C, impl, "bwd")
    s = SUFFIX[prec]
    dq_rows, dkv_rows = rows or (None, None)
    sl2 = math.log2(math.e) / math.sqrt(D)
    scale = 1.0 / math.sqrt(D)
    q, k, v = ptr(qkv), ptr(qkv, C), ptr(qkv, 2 * C)
    acc = i32(1 if accumulate else 0)
    if e4m3 is not None and (impl != "wgds" or prec != "bf16" or accumulate):
        raise AndreaError(f"cuda attention: an E4M3 dqkv needs the \"wgds\" backward in bf16 without accumulate "
                          f"(got {impl}, {prec}, accumulate={accumulate})")
    if impl == "wgds":
        _attn_bwd_ds(prec, dqkv, dy, y, lse2, dvec, q, k, v, B, T, C, H, sl2, scale, acc, dq_rows, dkv_rows, ds,
                     e4m3)
        return
    name, grid, block = _attn_launch(impl, "dq", prec, D, T, B * H, dq_rows)
    if impl != "simt":
        kernel("attention.cu", name)(grid, block, (q, k, v, i32(3 * C), dy, y, i32(C), lse2, dvec, ptr(dqkv), i32(T),
                                                   i32(H), f32(sl2), f32(scale), acc))
    else:
        kernel("attention.cu", f"k_attn_dvec_{s}")((blocks(B * H * T),), (256,),
                                                   (y, dy, i32(C), dvec, i32(B), i32(T), i32(H), i32(D)))
        kernel("attention.cu", name)(grid, block, (q, k, v, i32(3 * C), dy, i32(C), lse2, dvec, ptr(dqkv), i32(T),
                                                   i32(H), f32(sl2), f32(scale), acc))
    name, grid, block = _attn_launch(impl, "dkv", prec, D, T, B * H, dkv_rows)
    kernel("attention.cu", name)(
        grid, block, (q, k, v, i32(3 * C), dy, i32(C), lse2, dvec, ptr(dqkv, C), ptr(dqkv, 2 * C), i32(T), i32(H),
                      f32(sl2), f32(scale), acc))


def _attn_bwd_ds(prec, dqkv, dy, y, lse2, dvec, q, k, v, B, T, C, H, sl2, scale, acc, dq_rows, dkv_rows, ds,
                 e4m3=None):
    """The "wgds" backward: dvec, then per group of heads that fits ``ds`` the dK/dV kernel (storing
    dS) and the dQ kernel (one product per tile, no recomputed S and dP); ``e4m3`` as k_attn_bwd's."""
    D, BH = C // H, B * H
    z = np.uint64(0)
    dq8 = dk8 = dv8 = sc = rec = dq8t = dk8t = dv8t = z
    if e4m3 is not None:
        (dq8, dk8, dv8), sc, rec = (ptr(e4m3[0], o) for o in (0, C, 2 * C)), ptr(e4m3[1]), ptr(e4m3[2])
        if len(e4m3) > 3 and e4m3[3] is not None:             # the transpose (3C, B*T): rows h D + d of each
            dq8t, dk8t, dv8t = (ptr(e4m3[3], o * B * T) for o in (0, C, 2 * C))
    ldt = np.int64(B * T)
    per = attn_ds_bytes(T)
    if ds is None:
        ds = cp().empty(attn_ds_bytes(T, BH), dtype=cp().uint8)
    ds1, ds2 = ds if isinstance(ds, tuple) else (ds, None)
    c1, c2 = ds1.nbytes // per, 0 if ds2 is None else ds2.nbytes // per       # heads each buffer holds
    if c1 + c2 < 1:
        raise AndreaError(f"cuda attention: the dS scratch holds {ds1.nbytes + (ds2.nbytes if c2 else 0)} bytes, "
                          f"one head needs {per}")
    kernel("attention.cu", f"k_attn_dvec16_{SUFFIX[prec]}")((blocks(BH * T),), (256,),
                                                           (y, dy, i32(C), dvec, i32(B), i32(T), i32(H), i32(D)))
    for bh0 in range(0, BH, c1 + c2):       # a launch: its first n1 heads' tiles in ds1, the rest in ds2
        n = min(c1 + c2, BH - bh0)
        n1, p2 = min(c1, n), ptr(ds2) if c2 else z
        name, grid, block = _attn_launch("wgds", "dkv", prec, D, T, n, dkv_rows)
        kernel("attention.cu", name)(grid, block, (q, k, v, i32(3 * C), dy, i32(C), lse2, dvec, ptr(dqkv, C),
                                                   ptr(dqkv, 2 * C), i32(T), i32(H), f32(sl2), f32(scale), acc,
                                                   ptr(ds1), i32(bh0), dk8, dv8, sc, rec, p2, i32(n1), dk8t,
                                                   dv8t, ldt))
        name, grid, block = _attn_launch("wgds", "dq", prec, D, T, n, dq_rows)
        kernel("attention.cu", name)(grid, block, (k, i32(3 * C), ptr(ds1), ptr(dqkv), i32(T), i32(H), f32(scale),
                                                   acc, i32(bh0), dq8, sc, rec, p2, i32(n1), dq8t, ldt))


def _row_ld(op: str, x, N: int, V: int) -> int:
    """Elements between rows of an (N, V) matrix that is contiguous or a row-strided view (the
    engine's padded logits: the first V columns of wider rows)."""
    if x.ndim != 2 or tuple(x.shape) != (N, V) or x.strides[1] != x.itemsize or x.strides[0] % x.itemsize:
        raise AndreaError(f"cuda op {op}: expected an ({N}, {V}) matrix with unit column stride, "
                          f"got shape {tuple(x.shape)} strides {x.strides}")
    return x.strides[0] // x.itemsize if N > 1 else V


LOSS_ROWS = 8                     # k_loss_fwd: rows (one warp each) a block


def k_loss_fwd(prec, lse, losses, logits, targets, N, V):
    """lse, losses (N,) of logits (N, V), contiguous or rows further apart (``_row_ld``)."""
    ld = _row_ld("loss_forward", logits, N, V)
    kernel("loss.cu", f"k_loss_fwd_{SUFFIX[prec]}")((-(-N // LOSS_ROWS),), (32 * LOSS_ROWS,),
                                                    (ptr(logits), targets, lse, losses, i32(N), i32(V), i32(ld)))


def k_loss_bwd(prec, dlogits, logits, targets, lse, dscale, N, V):
    """dlogits (N, V) = (softmax - onehot) * dscale; may be logits itself. The kernel reads and writes
    16-byte vectors at the same offsets, so both buffers must share their alignment mod 16 and
    their row stride."""
    ld = _row_ld("loss_backward", logits, N, V)
    if (dlogits.data.ptr - logits.data.ptr) % 16 or _row_ld("loss_backward", dlogits, N, V) != ld:
        raise AndreaError("cuda op loss_backward: dlogits and logits differ in 16-byte alignment or row stride "
                          f"({dlogits.data.ptr % 16} vs {logits.data.ptr % 16}); pass logits itself or a same-layout buffer")
    kernel("loss.cu", f"k_loss_bwd_{SUFFIX[prec]}")((N,), (512,), (ptr(logits), targets, lse, ptr(dlogits), f32(dscale),
                                                                    i32(N), i32(V), i32(ld)))


def k_loss_bwd_e4m3(d8, inv, logits, targets, lse, dscale, N, V):
    """d8 (N, ld) E4M3 = (softmax - onehot) * 448 of bf16 logits (N, V), rows ld elements apart
    (``_row_ld``; ld % 8 == 0, 16-byte aligned), zero past V; inv[0] = dscale / 448 (loss.cu)."""
    ld = _row_ld("loss_backward", logits, N, V)
    if ld % 8 or logits.data.ptr % 16 or d8.dtype != np.uint8 or d8.size < N * ld or d8.data.ptr % 16:
        raise AndreaError(f"cuda op loss_backward (E4M3): logits rows of {ld} elements at byte {logits.data.ptr % 16} "
                          f"mod 16 and a uint8 output of {d8.size} bytes (need rows a multiple of 8 elements, "
                          f"16-byte aligned, and {N * ld} output bytes)")
    kernel("loss.cu", "k_loss_bwd_e4m3")((N,), (256,), (ptr(logits), targets, lse, d8, inv, f32(dscale), i32(N), i32(V),
                                                        i32(ld)))

def embed_segments(idx_host: np.ndarray):
    """Host side of the deterministic embedding backward: positions sorted by token id (stable),
    segment starts (n_seg + 1,) and the token of each segment. (N,) int32 arrays, padded."""
    flat = np.ascontiguousarray(idx_host, dtype=np.int32).reshape(-1)
    N = flat.size
    # The step waits for this on the host (the GPU idles meanwhile): NumPy's stable argsort is a
    # radix sort for 16-bit keys, 8-14x faster than its int32 merge sort at 32-64K tokens (5.8 ->
    # about 1 ms a step at 12M B=64), same order. Ids past 16 bits keep the int32 sort.
    keys = flat.astype(np.uint16) if N and 0 <= flat.min() and flat.max() < 1 << 16 else flat
    order = np.argsort(keys, kind="stable").astype(np.int32)
    s = flat[order]
    starts = np.flatnonzero(np.concatenate(([True], s[1:] != s[:-1]))).astype(np.int32)
    n_seg = starts.size
    seg_start = np.full(N + 1, N, dtype=np.int32)
    seg_start[:n_seg] = starts
    seg_tok = np.zeros(N, dtype=np.int32)
    seg_tok[:n_seg] = s[starts]
    return order, seg_start, seg_tok, np.array([n_seg], dtype=np.int32)


def k_embed_bwd(dwte, dwpe, dout, seg_bufs, B, T, C):
    order, seg_start, seg_tok, n_seg = seg_bufs
    N = B * T
    kernel("embed.cu", "k_embed_bwd_wte")((N,), (128,), (dout, order, seg_start, seg_tok, n_seg, dwte, i32(C)))
    kernel("embed.cu", "k_embed_bwd_wpe")((blocks(T * C),), (256,), (dout, dwpe, i32(B), i32(T), i32(C)))



def k_embed_fwd(out, idx, wte, wpe, N, T, C, V):
    kernel("embed.cu", "k_embed_fwd")((blocks(N * C),), (256,), (idx, wte, wpe, out, i32(N), i32(T), i32(C), i32(V)))


def k_loss_mean(losses, out, N):
    kernel("loss.cu", "k_loss_mean")((1,), (1024,), (losses, out, i32(N)))


def adam_hyper(t: int, lr: float, beta1: float, beta2: float, eps: float, wd: float) -> np.ndarray:
    """The 8 floats k_adamw reads: [lr, wd, lr / bc1, 1 / sqrt(bc2), beta1, beta2, eps, 0]."""
    bc1 = 1.0 - beta1 ** t
    bc2 = 1.0 - beta2 ** t
    return np.array([lr, wd, lr / bc1, 1.0 / math.sqrt(bc2), beta1, beta2, eps, 0.0], dtype=np.float32)




def k_softmax(probs, logits, lse, N, V):
    kernel("loss.cu", "k_softmax_f32")((N,), (512,), (logits, lse, probs, i32(N), i32(V)))


def k_probs_to_dlogits(probs, targets, dscale, N, V):
    kernel("loss.cu", "k_probs_to_dlogits_f32")((N,), (512,), (probs, targets, f32(dscale), i32(N), i32(V)))


def k_grad_norm_chunks(partials, grads, n, chunk, P):
    """partials (P,) float64: the sum of squares of each chunk of the flat grads (n,)."""
    kernel("optim.cu", "k_grad_norm_partial_chunks")((P,), (1024,), (grads, np.int64(n), np.int64(chunk), partials))


def k_grad_norm(g, n, part, grad_clip, inv, gstate):
    """gstate[:3] = [norm, clip scale, ok] of g (n,) / inv^-1, over NORM_BLOCKS partial sums in part."""
    k_grad_norm_partial(g, n, part)
    k_grad_norm_final(part, NORM_BLOCKS, grad_clip, inv, gstate)


def k_grad_norm_partial(g, n, part, blocks: int = NORM_BLOCKS):
    """part (blocks,) = the sums of squares of g's (n,) ``blocks`` grid-stride slices."""
    kernel("optim.cu", "k_grad_norm_partial")((int(blocks),), (256,), (g, np.int64(n), part))


def k_grad_norm_final(part, G, grad_clip, inv, gstate):
    """gstate[:3] = [norm, clip scale, ok] from the G partial sums in part, in order (the sharded
    step gathers every rank's NORM_BLOCKS partials in rank order: G = world * NORM_BLOCKS)."""
    kernel("optim.cu", "k_grad_norm_final")((1,), (512,), (part, i32(G), f32(grad_clip), f32(inv), gstate))


def k_gate_finite(loss, gstate):
    """gstate[2] (the step's ok) = 0 where loss[0] is NaN or inf: k_adamw then skips the step, as the engines'
    apply_update does on the host for a non-finite loss (its NumPy twin: ``gate_finite``)."""
    kernel("optim.cu", "k_gate_finite")((1,), (32,), (loss, gstate))


def gate_finite(loss: float, gstate: np.ndarray) -> None:
    """k_gate_finite's NumPy twin."""
    if not np.isfinite(loss):
        gstate[2] = 0.0


ADAMW_CHUNK = 1024                # parameters a block of k_adamw4_* (4 a thread): its amax partials' stride


def _aligned(a, to: int) -> bool:
    """Whether device array a (or a raw pointer; 0 for none) starts on a ``to``-byte boundary."""
    ptr = getattr(getattr(a, "data", None), "ptr", None)      # a cupy array's; a NumPy scalar has no .ptr
    return int(a if ptr is None else ptr) % to == 0


def adamw4_ok(w, g, m, v, wlow) -> bool:
    """Whether these buffers take k_adamw4_* (w, g, m, v 16-byte aligned; wlow 8, or none)."""
    return all(_aligned(a, 16) for a in (w, g, m, v)) and _aligned(wlow, 8)


def k_adamw(prec, w, g, m, v, wlow, n, hp, gstate, n_decay, use_gstate, part=None):
    """AdamW over the flat fp32 w, g, m, v (n,) with the 8 floats of ``adam_hyper`` in hp; refreshes
    the 16-bit compute copy wlow (0 for none); skips the update where gstate says the step is bad.
    Four parameters a thread (k_adamw4_*, the same bits as k_adamw_*) where the buffers are aligned
    for it (``adamw4_ok``), else one. ``part`` (fp32, ceil(n / ADAMW_CHUNK); four-a-thread only):
    also the max |wlow| of each ADAMW_CHUNK parameters after the step, for fp8's weight casts."""
    args = (w, g, m, v, wlow, np.int64(n), hp, gstate, np.int64(n_decay), i32(use_gstate))
    if adamw4_ok(w, g, m, v, wlow):
        kernel("optim.cu", f"k_adamw4_{SUFFIX[prec]}")((-(-int(n) // ADAMW_CHUNK),), (ADAMW_CHUNK // 4,),
                                                        args + (np.uint64(0) if part is None else part,))
    elif part is not None:
        raise AndreaError("k_adamw: the amax partials need the four-a-thread kernel (16-byte aligned buffers)")
    else:
        kernel("optim.cu", f"k_adamw_{SUFFIX[prec]}")((blocks(n),), (256,), args)


# ----------------------------------------------------------------------------- the proj dgrad with gelu'
# mm_dgelu.cu (Hopper only): D (M, N) = bf16((A (M, K) B (N, K)^T) * fp16(gelu'(X (M, N)))), bf16 payloads,
# row-major. Its variants are defines; MmDgelu compiles one, encodes the TMA maps of each operand set and
# launches it; mm_dgelu_reference is the NumPy twin. The engine's proj dgrad is still cuBLASLt's DGELU
# GEMM: bench/dgelu_gemm.py measures this kernel against it, which it has to beat to replace it.
#
#     mm = MmDgelu(("MM_CLUSTER=2",)); mm(d, a, b, x)        # d, a, b, x cupy uint16

MM_DGELU = {"MM_BN": 256, "MM_STAGES": 3, "MM_CLUSTER": 1, "MM_CLUSTER_N": 1, "MM_GROUP": 8, "MM_LDSM": 0,
            "MM_XREG": 0, "MM_WATCHDOG": 4_000_000_000, "MM_HANG": 0}          # mm_dgelu.cu's #ifndef values
MM_BN_BUILT = (256, 192)              # the wgmma shapes the file spells out (WG_SS_N256, WG_SS_N192)
MM_BM, MM_BK, MM_THREADS = 128, 64, 384
SMEM_LIMIT = 232448                # sm_90's opt-in dynamic shared memory a block (227 KB)

# cuTensorMapEncodeTiled's enums (cuda.h)
_BFLOAT16, _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_256B, _OOB_FILL_NONE = 9, 0, 3, 3, 0


def mm_dgelu_config(defines: tuple[str, ...] = ()) -> dict[str, int]:
    """MM_DGELU with ``defines`` ("NAME=VALUE", as ``bench/dgelu_gemm.py --configs`` takes them) applied;
    AndreaError names a define the kernel does not have, a value that is not an integer, a tile width it
    has no wgmma for, a cluster other than 1 or 2, or a ring too deep for shared memory."""
    cfg = dict(MM_DGELU)
    for d in defines:
        name, eq, value = d.partition("=")
        if name not in cfg or not eq:
            raise AndreaError(f"mm_dgelu variant {d!r}: expected NAME=VALUE with NAME one of {', '.join(cfg)}")
        try:
            cfg[name] = int(value)
        except ValueError:
            raise AndreaError(f"mm_dgelu variant {d!r}: {name} must be an integer") from None
    if cfg["MM_BN"] not in MM_BN_BUILT:
        raise AndreaError(f"mm_dgelu variant: MM_BN={cfg['MM_BN']}, the kernel has wgmma for {MM_BN_BUILT} only")
    flags_ok = (cfg["MM_CLUSTER"] in (1, 2) and cfg["MM_CLUSTER_N"] in (1, 2) and cfg["MM_LDSM"] in (0, 1)
                and cfg["MM_XREG"] in (0, 1) and cfg["MM_HANG"] in (0, 1))
    if not flags_ok or min(cfg["MM_STAGES"] - 2, cfg["MM_GROUP"] - 1, cfg["MM_WATCHDOG"] - 1) < 0:
        raise AndreaError(f"mm_dgelu variant {cfg}: MM_CLUSTER and MM_CLUSTER_N are 1 or 2, MM_STAGES at least 2, "
                          f"MM_GROUP at least 1, MM_LDSM, MM_XREG and MM_HANG 0 or 1, MM_WATCHDOG at least 1")
    if mm_dgelu_smem(cfg) > SMEM_LIMIT:
        raise AndreaError(f"mm_dgelu variant {cfg}: needs {mm_dgelu_smem(cfg)} bytes of shared memory, more than "
                          f"the {SMEM_LIMIT} a block can have; take fewer MM_STAGES or MM_BN=192")
    return cfg


def mm_dgelu_defines(cfg: dict[str, int]) -> tuple[str, ...]:
    """The "NAME=VALUE" defines that differ from the file's defaults (none for the default build)."""
    return tuple(f"{k}={v}" for k, v in cfg.items() if MM_DGELU[k] != v)


def mm_dgelu_smem(cfg: dict[str, int]) -> int:
    """Dynamic shared memory of a block, as k_mm_dgelu lays it out: the A/B ring, xbuf, 2 MM_STAGES + 3
    mbarriers and up to 1023 bytes to align the tiles to 1024 (128-byte swizzle)."""
    bn, st = cfg["MM_BN"], cfg["MM_STAGES"]
    return st * (MM_BM * MM_BK * 2 + bn * MM_BK * 2) + MM_BM * bn * 2 + 8 * (2 * st + 3) + 1024


def mm_dgelu_fits(M: int, N: int, K: int, cfg: dict[str, int]) -> bool:
    """Whether k_mm_dgelu covers an (M, N, K) problem exactly: whole cluster tiles, whole k steps."""
    return M > 0 and K > 0 and N > 0 and M % (MM_BM * cfg["MM_CLUSTER"]) == 0 \
        and N % (cfg["MM_BN"] * cfg["MM_CLUSTER_N"]) == 0 and K % MM_BK == 0


def mm_dgelu_grid(M: int, N: int, cfg: dict[str, int], sms: int) -> int:
    """CTAs of the persistent launch: one an SM, whole clusters, no more than there are tiles."""
    cl, cn = cfg["MM_CLUSTER"], cfg["MM_CLUSTER_N"]
    units = (M // (MM_BM * cl)) * (N // (cfg["MM_BN"] * cn))
    return max(1, min(units, sms // (cl * cn))) * cl * cn


def gelu_grad(x: np.ndarray) -> np.ndarray:
    """d gelu_tanh / dx in float64: s + x s (1 - s) 2k (1 + 3a x^2), s = sigmoid(2k (x + a x^3)) (common.cuh's
    gelu_grad_f, exactly)."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):
        s = 1.0 / (1.0 + np.exp(-2.0 * GELU_K * (x + GELU_A * x ** 3)))
    return s + x * s * (1.0 - s) * 2.0 * GELU_K * (1.0 + 3.0 * GELU_A * x * x)


def mm_dgelu_reference(a: np.ndarray, b: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The twin of k_mm_dgelu on bf16 payloads a (M, K), b (N, K), x (M, N): the product in float64, g =
    gelu'(x) rounded to fp16 as the gelu' warps store it, bf16(float32(product * g)) -> (M, N) uint16.
    The kernel sums in fp32 in its own order, so it may differ by one bf16 unit."""
    A, B, X = (bf16_to_f32(v).astype(np.float64) for v in (a, b, x))
    g = gelu_grad(X).astype(np.float16).astype(np.float64)
    return f32_to_bf16(((A @ B.T) * g).astype(np.float32))


def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise AndreaError(f"mm_dgelu: the CUDA driver library (libcuda.so.1) does not load ({e})") from None


def tensor_map(lib, addr: int, rows: int, cols: int, box_rows: int) -> bytes:
    """The 128-byte CUtensorMap of a row-major (rows, cols) bf16 matrix at device address ``addr``: boxes
    of box_rows x 64 columns (128 bytes, one swizzle row), 128-byte swizzle, L2 promotion 256 B."""
    out = (ctypes.c_uint64 * 16)()
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(cols * 2)
    box = (ctypes.c_uint32 * 2)(MM_BK, box_rows)
    ones = (ctypes.c_uint32 * 2)(1, 1)
    rc = lib.cuTensorMapEncodeTiled(out, _BFLOAT16, 2, ctypes.c_void_p(addr), dims, strides, box, ones,
                                    _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_256B, _OOB_FILL_NONE)
    if rc != 0:
        raise AndreaError(f"mm_dgelu: cuTensorMapEncodeTiled failed (CUresult {rc}) for a ({rows}, {cols}) bf16 "
                          f"matrix at 0x{addr:x} with boxes of {box_rows} x {MM_BK}")
    return bytes(out)


class MmDgelu:
    """k_mm_dgelu of one variant, compiled for this device, with the TMA maps of every operand set it was
    called with, on the device (512 bytes a set) so that a call inside a CUDA graph reads fixed maps: in
    ``store`` (uint8 (S, 512), e.g. the engine's arena: S sets at most) or else in CuPy allocations."""

    def __init__(self, defines: tuple[str, ...] = (), store=None):
        import cupy  # noqa: PLC0415

        from andrea.cuda import loader  # noqa: PLC0415

        if not hopper():
            raise AndreaError("mm_dgelu: the kernel needs a compute capability 9.0 GPU (TMA, wgmma, clusters)")
        self.cfg = mm_dgelu_config(defines)
        extra = mm_dgelu_defines(self.cfg)
        mod = loader.build("mm_dgelu.cu", extra) if extra else loader.module("mm_dgelu.cu")
        self.fn = mod.get_function("k_mm_dgelu")
        self.smem = mm_dgelu_smem(self.cfg)
        self.fn.max_dynamic_shared_size_bytes = self.smem
        self._lib = _libcuda()
        self.slots = self._cta_slots(cupy.cuda.Device().attributes["MultiProcessorCount"])
        self._store = store
        self._maps: dict[tuple, object] = {}

    def _cta_slots(self, sms: int) -> int:
        """CTAs that run at once: one an SM, or with clusters whole clusters as the driver can place them
        (cuOccupancyMaxActiveClusters: a GPC holds whole clusters only, so 2 x 2 may leave SMs idle). The
        persistent schedule needs every CTA of its grid resident: one that waits for another to finish
        would double the time."""
        cs = self.cfg["MM_CLUSTER"] * self.cfg["MM_CLUSTER_N"]
        if cs == 1:
            return sms

        class LaunchConfig(ctypes.Structure):   # CUlaunchConfig (cuda.h), no attributes: __cluster_dims__ rules
            _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                        ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("n_attrs", ctypes.c_uint)]

        try:
            func = ctypes.c_void_p(int(self.fn.kernel.ptr))
        except Exception as e:  # noqa: BLE001 - CuPy's handle of the compiled function
            raise AndreaError(f"mm_dgelu: no CUfunction handle from CuPy's kernel ({e}) to place clusters with") from None
        cfg = LaunchConfig((ctypes.c_uint * 3)(cs * sms, 1, 1), (ctypes.c_uint * 3)(MM_THREADS, 1, 1), self.smem,
                           None, None, 0)
        n = ctypes.c_int(0)
        rc = self._lib.cuOccupancyMaxActiveClusters(ctypes.byref(n), func, ctypes.byref(cfg))
        if rc != 0 or n.value < 1:
            raise AndreaError(f"mm_dgelu: cuOccupancyMaxActiveClusters failed (CUresult {rc}, {n.value} clusters) "
                              f"for clusters of {cs} with {self.smem} bytes of shared memory")
        return min(n.value, sms // cs) * cs

    def takes(self, d, a, b, x, ta: bool = False, tb: bool = True, beta: float = 0.0) -> bool:
        """Whether a GEMM call with cuBLASLt's DGELU contract (``Lt.mm(d, a, b, ta, tb, beta, aux=x)``) is
        this kernel's: D = A B^T with beta 0, all bf16 payloads, C-contiguous, 16-byte aligned (TMA), the
        problem whole tiles of the variant."""
        arrays = (d, a, b, x)
        if ta or not tb or beta != 0.0 or any(v.ndim != 2 or v.dtype != np.uint16 or not v.flags.c_contiguous
                                              for v in arrays):
            return False
        (M, K), N = a.shape, b.shape[0]
        return b.shape == (N, K) and x.shape == d.shape == (M, N) and mm_dgelu_fits(M, N, K, self.cfg) \
            and all(_aligned(v, 16) for v in arrays)

    def maps(self, d, a, b, x, M: int, N: int, K: int):
        """The device copy of the four maps (A, B, X, D) of these operands, encoded on first use."""
        import cupy  # noqa: PLC0415

        key = (d.data.ptr, a.data.ptr, b.data.ptr, x.data.ptr, M, N, K)
        buf = self._maps.get(key)
        if buf is None:
            enc = np.frombuffer(b"".join((
                tensor_map(self._lib, a.data.ptr, M, K, MM_BM // self.cfg["MM_CLUSTER_N"]),
                tensor_map(self._lib, b.data.ptr, N, K, self.cfg["MM_BN"] // self.cfg["MM_CLUSTER"]),
                tensor_map(self._lib, x.data.ptr, M, N, MM_BM),
                tensor_map(self._lib, d.data.ptr, M, N, MM_BM))), dtype=np.uint8)
            if self._store is None:
                buf = cupy.asarray(enc)                               # a 512-byte aligned allocation
            elif len(self._maps) < self._store.shape[0]:
                buf = self._store[len(self._maps)]
                buf.set(enc)                                          # a synchronous copy, before any launch
            else:
                raise AndreaError(f"mm_dgelu: its map store holds {self._store.shape[0]} operand sets, all taken; "
                                  f"a {M} x {N} x {K} call with new pointers needs one more")
            self._maps[key] = buf
        return buf

    def __call__(self, d, a, b, x, ctas: int | None = None) -> None:
        """D = bf16((A B^T) * fp16(gelu'(X))) on the current stream. ``ctas`` caps the persistent grid (a
        test makes each CTA run several tiles); refusals name the argument and what it needs."""
        if a.ndim != 2 or b.ndim != 2:
            raise AndreaError(f"mm_dgelu: A and B must be matrices (got shapes {a.shape}, {b.shape})")
        (M, K), N = a.shape, b.shape[0]
        need("mm_dgelu", "A", a, np.uint16, (M, K))
        need("mm_dgelu", "B", b, np.uint16, (N, K))
        need("mm_dgelu", "X", x, np.uint16, (M, N))
        need("mm_dgelu", "D", d, np.uint16, (M, N))
        if not mm_dgelu_fits(M, N, K, self.cfg):
            raise AndreaError(f"mm_dgelu: a {M} x {N} x {K} problem does not fit the variant {self.cfg}: M must be a "
                              f"multiple of {MM_BM * self.cfg['MM_CLUSTER']}, "
                              f"N of {self.cfg['MM_BN'] * self.cfg['MM_CLUSTER_N']}, K of {MM_BK}")
        n = mm_dgelu_grid(M, N, self.cfg, self.slots if ctas is None else int(ctas))
        self.fn((n,), (MM_THREADS,), (self.maps(d, a, b, x, M, N, K), np.int32(M), np.int32(N), np.int32(K), x),
                shared_mem=self.smem)
