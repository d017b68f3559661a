"""The CuPy backend of the ANDREA engine: the op pairs of ``andrea/engine/ops_numpy.py`` on the GPU,
and ``GpuEngine``, the fast mixed-precision training step built from the same kernels.

    from andrea.cuda.backend import probe, make_backend
    if probe() is None:                       # None: a CUDA device is usable
        be = make_backend()
        eng = be.make_engine(mc, batch_size=8, precision="bf16")   # GpuEngine
        eng.init_weights(1337); res = eng.train_step([(x, y)], lr=3e-4, t=1, hp=Hyper())

Two ways to run the model on the GPU:
- ``be.ops``: every function of ops_numpy, same names, same arguments, same ``+=`` semantics, fp32,
  so ``andrea.engine.engine.Engine`` runs unchanged on CuPy arrays (the op-for-op mirror the tests
  compare against the NumPy engine). The attention op saves the row log-sum-exp (B, H, T) instead
  of the (B, H, T, T) probabilities, and its backward recomputes the output it needs.
- ``GpuEngine`` (``be.make_engine``): the same model, weights, AdamW and checkpoint layout (fp32 flat
  w, m, v), with activations in fp32 | bf16 | fp16 (fp32 master weights, a 16-bit compute copy
  refreshed by the AdamW kernel), one preallocated arena whose size is the printed plan, clipping
  and the NaN/inf skip on the device, and a CUDA graph of forward+backward. LayerNorm outputs and
  GELU activations are recomputed in the backward (one scratch buffer each, not one per layer).

Python owns launch geometry and checks dtype, shape and contiguity before each launch
(``_need``); the kernels are in ``andrea/cuda/*.cu`` and go through ``andrea.cuda.loader``. Large
matmuls go to cuBLAS (``cublasGemmEx``, fp32 accumulation, no TF32; deterministic for fixed shapes).
Importing this module needs neither CuPy nor a GPU: ``probe()`` says why one is not usable.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from andrea.cuda.loader import cupy_or_none, kernel
from andrea.engine.engine import Engine, Hyper, StepResult, init_params
from andrea.engine.model import ModelConfig, param_layout
from andrea.errors import AndreaError

# cudaDataType / cublas enums (cublas_api.h, library_types.h)
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
LN_EPS = 1e-5
LN_ROWS_PER_CHUNK = 32
NORM_BLOCKS = 512

_SUFFIX = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}
_LOWTYPE = {"fp32": CUDA_R_32F, "bf16": CUDA_R_16BF, "fp16": CUDA_R_16F}


def probe() -> str | None:
    """None when CuPy imports and sees a CUDA device; otherwise the reason, in words."""
    try:
        import cupy  # noqa: F401, PLC0415
    except Exception as e:  # ImportError and friends
        return f"cupy cannot be imported ({type(e).__name__}: {e})"
    if cupy_or_none() is None:
        return "cupy finds no usable CUDA device"
    return None


def _cp():
    import cupy  # noqa: PLC0415

    return cupy


# ----------------------------------------------------------------------------- launch helpers
def _need(op: str, name: str, a, dtype=None, shape=None, size=None) -> None:
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


def _ptr(a, offset_elems: int = 0) -> np.uint64:
    return np.uint64(a.data.ptr + offset_elems * a.dtype.itemsize)


def _i(v) -> np.int32:
    return np.int32(v)


def _f(v) -> np.float32:
    return np.float32(v)


def _blocks(n: int, t: int = 256) -> int:
    return (int(n) + t - 1) // t


class Blas:
    """Row-major GEMM over cuBLAS: C (M, N) = alpha op(A) op(B) + beta C, fp32 accumulation."""

    def __init__(self):
        cp = _cp()
        from cupy.cuda import cublas  # noqa: PLC0415

        self.cublas = cublas
        self.cp = cp
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

def _ln_vec(C: int, *arrays) -> int | None:
    """V (float4 columns per lane / 32) of the vectorized LayerNorm kernels, or None for the scalar ones."""
    if C % 4 or not all(a.data.ptr % 16 == 0 for a in arrays):
        return None
    return next((V for V in (1, 2, 3, 6, 12) if C // 4 <= 32 * V), None)


def k_layernorm_fwd(prec, y, mean, rstd, x, g, b, N, C):
    V = _ln_vec(C, x, g, b, y)
    name = f"k_layernorm_fwd4_{_SUFFIX[prec]}_v{V}" if V else f"k_layernorm_fwd_{_SUFFIX[prec]}"
    kernel("layernorm.cu", name)((_blocks(N, 8),), (256,), (x, g, b, y, mean, rstd, _i(N), _i(C), _f(LN_EPS)))


def k_layernorm_bwd(prec, dx, dg, db, dy, x, mean, rstd, g, part, N, C):
    """dx (N, C) fp32 += ...; dg, db (C,) += ...; part holds >= ceil(N/32)*2*C floats of scratch."""
    s = _SUFFIX[prec]
    n_chunks = (N + LN_ROWS_PER_CHUNK - 1) // LN_ROWS_PER_CHUNK
    if part.size < n_chunks * 2 * C:
        raise AndreaError(f"cuda op layernorm_backward: scratch has {part.size} floats, needs {n_chunks * 2 * C}")
    V = _ln_vec(C, x, g, dy, dx)
    if V and V <= 6:   # V = 12 (C > 768) keeps 144 partial sums per lane: measured slower than 3 kernels
        kernel("layernorm.cu", f"k_layernorm_bwd4_{s}_v{V}")(
            (n_chunks,), (256,), (x, g, mean, rstd, dy, dx, part, _i(N), _i(C), _i(LN_ROWS_PER_CHUNK)))
    else:
        kernel("layernorm.cu", f"k_layernorm_bwd_{s}")((_blocks(N, 8),), (256,),
                                                       (x, g, mean, rstd, dy, dx, _i(N), _i(C)))
        kernel("layernorm.cu", f"k_layernorm_bwd_wpart_{s}")(
            (_blocks(C, 128), n_chunks), (128,), (x, mean, rstd, dy, part, _i(N), _i(C), _i(LN_ROWS_PER_CHUNK)))
    kernel("layernorm.cu", "k_layernorm_bwd_wsum")((_blocks(C, 128),), (128,), (part, dg, db, _i(n_chunks), _i(C)))


def _vec8(n: int, *arrays) -> bool:
    """The 8-wide kernels need n % 8 == 0 and 16-byte aligned buffers."""
    return n % 8 == 0 and all(a.data.ptr % 16 == 0 for a in arrays)


def _ew(name: str, prec: str, n: int, *arrays) -> None:
    """Launch elementwise.cu's k_<name>_<t> over n elements, arrays in kernel order; its 8-wide
    twin k_<name>8_<t> where n and every buffer allow it."""
    if _vec8(n, *arrays):
        kernel("elementwise.cu", f"k_{name}8_{_SUFFIX[prec]}")((_blocks(n // 8),), (256,), (*arrays, np.int64(n // 8)))
    else:
        kernel("elementwise.cu", f"k_{name}_{_SUFFIX[prec]}")((_blocks(n),), (256,), (*arrays, np.int64(n)))


def k_gelu_fwd(prec, y, x, n):
    _ew("gelu_fwd", prec, n, x, y)


def k_gelu_bwd(prec, dx, dy, x, n):
    _ew("gelu_bwd", prec, n, x, dy, dx)


def k_residual_add(prec, out, a, b, n):
    _ew("residual_add", prec, n, a, b, out)


def k_cast(prec, dst, src, n):
    _ew("cast", prec, n, src, dst)


def k_accumulate(da, dout, n):
    kernel("elementwise.cu", "k_residual_add_bwd")((_blocks(n),), (256,), (dout, da, np.int64(n)))


def k_scale(g, n, s):
    kernel("optim.cu", "k_scale")((_blocks(n),), (256,), (g, np.int64(n), _f(s)))


def attn_impl(prec: str, D: int, ld: int) -> str:
    if prec in ("bf16", "fp16") and D in (32, 64) and ld % 8 == 0:
        return "mma"
    if D not in (8, 16, 32, 64, 128):
        raise AndreaError(f"cuda attention: head size D={D} is not supported (8, 16, 32, 64 or 128)")
    return "simt"


def _attn_geom(impl: str, D: int, T: int, BH: int):
    tile = 64 if (impl == "mma" or D <= 64) else 32
    threads = 128 if impl == "mma" else tile
    return ((T + tile - 1) // tile, BH), (threads,)


def k_attn_fwd(prec, y, lse2, qkv, B, T, C, H):
    """qkv (B*T, 3C) -> y (B*T, C), lse2 (B*H, T)."""
    D = C // H
    impl = attn_impl(prec, D, 3 * C)
    grid, block = _attn_geom(impl, D, T, B * H)
    sl2 = math.log2(math.e) / math.sqrt(D)
    kernel("attention.cu", f"k_attn_fwd_{impl}_{_SUFFIX[prec]}_d{D}")(
        grid, block, (_ptr(qkv), _ptr(qkv, C), _ptr(qkv, 2 * C), _i(3 * C), y, _i(C), lse2, _i(T), _i(H), _f(sl2)))


def k_attn_bwd(prec, dqkv, dy, y, lse2, dvec, qkv, B, T, C, H, accumulate: bool):
    """dqkv (B*T, 3C) (+)= d/dqkv; y is the forward output, dvec (B*H, T) scratch."""
    D = C // H
    impl = attn_impl(prec, D, 3 * C)
    s = _SUFFIX[prec]
    grid, block = _attn_geom(impl, D, T, B * H)
    sl2 = math.log2(math.e) / math.sqrt(D)
    scale = 1.0 / math.sqrt(D)
    kernel("attention.cu", f"k_attn_dvec_{s}")((_blocks(B * H * T),), (256,),
                                               (y, dy, _i(C), dvec, _i(B), _i(T), _i(H), _i(D)))
    q, k, v = _ptr(qkv), _ptr(qkv, C), _ptr(qkv, 2 * C)
    acc = _i(1 if accumulate else 0)
    kernel("attention.cu", f"k_attn_bwd_dq_{impl}_{s}_d{D}")(
        grid, block, (q, k, v, _i(3 * C), dy, _i(C), lse2, dvec, _ptr(dqkv), _i(T), _i(H), _f(sl2), _f(scale), acc))
    kernel("attention.cu", f"k_attn_bwd_dkv_{impl}_{s}_d{D}")(
        grid, block, (q, k, v, _i(3 * C), dy, _i(C), lse2, dvec, _ptr(dqkv, C), _ptr(dqkv, 2 * C), _i(T), _i(H),
                      _f(sl2), _f(scale), acc))


def k_loss_fwd(prec, lse, losses, logits, targets, N, V):
    kernel("loss.cu", f"k_loss_fwd_{_SUFFIX[prec]}")((N,), (512,), (logits, targets, lse, losses, _i(N), _i(V)))


def k_loss_bwd(prec, dlogits, logits, targets, lse, dscale, N, V):
    kernel("loss.cu", f"k_loss_bwd_{_SUFFIX[prec]}")((N,), (512,),
                                                     (logits, targets, lse, dlogits, _f(dscale), _i(N), _i(V)))


def embed_segments(idx_host: np.ndarray):
    """Host side of the deterministic embedding backward: positions sorted by token id (stable),
    segment starts (n_seg + 1,) and the token of each segment. (N,) int32 arrays, padded."""
    flat = np.ascontiguousarray(idx_host, dtype=np.int32).reshape(-1)
    N = flat.size
    order = np.argsort(flat, kind="stable").astype(np.int32)
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
    kernel("embed.cu", "k_embed_bwd_wte")((N,), (128,), (dout, order, seg_start, seg_tok, n_seg, dwte, _i(C)))
    kernel("embed.cu", "k_embed_bwd_wpe")((_blocks(T * C),), (256,), (dout, dwpe, _i(B), _i(T), _i(C)))


# ----------------------------------------------------------------------------- the op mirror (fp32)
class _Ops:
    """Every function of andrea.engine.ops_numpy on CuPy fp32 arrays: same names, arguments, semantics."""

    def __init__(self):
        self.blas = Blas()
        self._seg_cache: dict[int, tuple] = {}

    @staticmethod
    def work_elems(B: int, T: int, C: int, H: int, V: int) -> int:
        N = B * T
        n_chunks = (N + LN_ROWS_PER_CHUNK - 1) // LN_ROWS_PER_CHUNK
        return max(n_chunks * 2 * C,          # layernorm_backward partials
                   N * C + 2 * B * H * T,     # attn_backward: recomputed output, lse, dvec
                   N * 4 * C,                 # mlp_backward: dh
                   N)                         # loss_forward: row lse

    # embed
    def embed_forward(self, out, idx, wte, wpe):
        B, T = idx.shape
        V, C = wte.shape
        _need("embed_forward", "out", out, np.float32, size=B * T * C)
        _need("embed_forward", "idx", idx, np.int32)
        _need("embed_forward", "wte", wte, np.float32)
        _need("embed_forward", "wpe", wpe, np.float32)
        kernel("embed.cu", "k_embed_fwd")((_blocks(B * T * C),), (256,),
                                          (idx, wte, wpe, out, _i(B * T), _i(T), _i(C), _i(V)))

    def embed_backward(self, dwte, dwpe, dout, idx):
        cp = _cp()
        B, T = idx.shape
        C = dwte.shape[1]
        N = B * T
        for nm, a in (("dwte", dwte), ("dwpe", dwpe), ("dout", dout)):
            _need("embed_backward", nm, a, np.float32)
        bufs = self._seg_cache.get(N)
        if bufs is None:  # allocated once per shape, reused every step
            bufs = (cp.zeros(N, np.int32), cp.zeros(N + 1, np.int32), cp.zeros(N, np.int32), cp.zeros(1, np.int32))
            self._seg_cache[N] = bufs
        for dst, src in zip(bufs, embed_segments(cp.asnumpy(idx))):
            dst.set(src)
        k_embed_bwd(dwte, dwpe, dout, bufs, B, T, C)

    # layernorm
    def layernorm_forward(self, out, mean, rstd, x, g, b):
        N, C = x.shape
        for nm, a in (("out", out), ("x", x)):
            _need("layernorm_forward", nm, a, np.float32, shape=(N, C))
        for nm, a in (("mean", mean), ("rstd", rstd)):
            _need("layernorm_forward", nm, a, np.float32, size=N)
        for nm, a in (("g", g), ("b", b)):
            _need("layernorm_forward", nm, a, np.float32, size=C)
        k_layernorm_fwd("fp32", out, mean, rstd, x, g, b, N, C)

    def layernorm_backward(self, dx, dg, db, dout, x, mean, rstd, g, work):
        N, C = x.shape
        for nm, a in (("dx", dx), ("dout", dout), ("x", x)):
            _need("layernorm_backward", nm, a, np.float32, shape=(N, C))
        _need("layernorm_backward", "work", work, np.float32)
        k_layernorm_bwd("fp32", dx, dg, db, dout, x, mean, rstd, g, work, N, C)

    # linear layers
    def _lin_fwd(self, op, y, x, w):
        for nm, a in (("out", y), ("x", x), ("w", w)):
            _need(op, nm, a, np.float32)
        self.blas.mm(y, x, w)

    def _lin_bwd(self, op, dx, dw, dout, x, w):
        for nm, a in (("dx", dx), ("dw", dw), ("dout", dout), ("x", x), ("w", w)):
            _need(op, nm, a, np.float32)
        self.blas.mm(dx, dout, w, tb=True, beta=1.0)   # dx += dout @ w.T
        self.blas.mm(dw, x, dout, ta=True, beta=1.0)   # dw += x.T @ dout

    def attn_qkv_forward(self, qkv, x, w_qkv):
        self._lin_fwd("attn_qkv_forward", qkv, x, w_qkv)

    def attn_qkv_backward(self, dx, dw_qkv, dqkv, x, w_qkv, work):
        self._lin_bwd("attn_qkv_backward", dx, dw_qkv, dqkv, x, w_qkv)

    def attn_out_forward(self, out, y, w_o):
        self._lin_fwd("attn_out_forward", out, y, w_o)

    def attn_out_backward(self, dy, dw_o, dout, y, w_o, work):
        self._lin_bwd("attn_out_backward", dy, dw_o, dout, y, w_o)

    # attention
    def attn_forward(self, out, att, qkv, mask, n_head, work):
        """out (B, T, C); att (B, H, T) receives lse2; mask is unused (causality is in the kernel)."""
        B, T, C = out.shape
        H = n_head
        _need("attn_forward", "out", out, np.float32)
        _need("attn_forward", "qkv", qkv, np.float32, size=B * T * 3 * C)
        _need("attn_forward", "att", att, np.float32, size=B * H * T)
        k_attn_fwd("fp32", out, att, qkv, B, T, C, H)

    def attn_backward(self, dqkv, dout, qkv, att, n_head, work):
        B, T, C = dout.shape
        H = n_head
        _need("attn_backward", "dqkv", dqkv, np.float32, size=B * T * 3 * C)
        _need("attn_backward", "dout", dout, np.float32)
        _need("attn_backward", "qkv", qkv, np.float32, size=B * T * 3 * C)
        _need("attn_backward", "att", att, np.float32, size=B * H * T)
        _need("attn_backward", "work", work, np.float32)
        N = B * T
        y = work[:N * C].reshape(N, C)
        lse_tmp = work[N * C:N * C + B * H * T]
        dvec = work[N * C + B * H * T:N * C + 2 * B * H * T]
        k_attn_fwd("fp32", y, lse_tmp, qkv, B, T, C, H)   # same kernel, same bits as the forward
        k_attn_bwd("fp32", dqkv, dout, y, att, dvec, qkv, B, T, C, H, accumulate=True)

    # mlp
    def mlp_forward(self, out, h_pre, h_act, x, w_fc, w_proj):
        for nm, a in (("out", out), ("h_pre", h_pre), ("h_act", h_act), ("x", x), ("w_fc", w_fc), ("w_proj", w_proj)):
            _need("mlp_forward", nm, a, np.float32)
        self.blas.mm(h_pre, x, w_fc)
        k_gelu_fwd("fp32", h_act, h_pre, h_pre.size)
        self.blas.mm(out, h_act, w_proj)

    def mlp_backward(self, dx, dw_fc, dw_proj, dout, x, h_pre, h_act, w_fc, w_proj, work):
        for nm, a in (("dx", dx), ("dw_fc", dw_fc), ("dw_proj", dw_proj), ("dout", dout), ("x", x),
                      ("h_pre", h_pre), ("h_act", h_act), ("w_fc", w_fc), ("w_proj", w_proj), ("work", work)):
            _need("mlp_backward", nm, a, np.float32)
        N, F = h_pre.shape
        dh = work[:N * F].reshape(N, F)
        self.blas.mm(dh, dout, w_proj, tb=True)            # dL/dh_act
        self.blas.mm(dw_proj, h_act, dout, ta=True, beta=1.0)
        k_gelu_bwd("fp32", dh, dh, h_pre, N * F)           # dL/dh_pre, in place
        self.blas.mm(dw_fc, x, dh, ta=True, beta=1.0)
        self.blas.mm(dx, dh, w_fc, tb=True, beta=1.0)

    # residual
    def residual_add_forward(self, out, a, b):
        for nm, t in (("out", out), ("a", a), ("b", b)):
            _need("residual_add_forward", nm, t, np.float32, size=out.size)
        k_residual_add("fp32", out, a, b, out.size)

    def residual_add_backward(self, da, db, dout):
        for nm, t in (("da", da), ("db", db), ("dout", dout)):
            _need("residual_add_backward", nm, t, np.float32, size=dout.size)
        k_accumulate(da, dout, dout.size)
        k_accumulate(db, dout, dout.size)

    # loss
    def loss_forward(self, losses, logits, probs, x, wte, targets, work):
        N, V = logits.shape
        for nm, a in (("logits", logits), ("probs", probs)):
            _need("loss_forward", nm, a, np.float32, shape=(N, V))
        _need("loss_forward", "x", x, np.float32)
        _need("loss_forward", "wte", wte, np.float32)
        self.blas.mm(logits, x, wte, tb=True)
        if targets is None:
            return
        _need("loss_forward", "targets", targets, np.int32, size=N)
        _need("loss_forward", "losses", losses, np.float32, size=N)
        lse = work[:N]
        k_loss_fwd("fp32", lse, losses, logits, targets, N, V)
        kernel("loss.cu", "k_softmax_f32")((N,), (512,), (logits, lse, probs, _i(N), _i(V)))

    def loss_backward(self, dx, dwte, probs, x, wte, targets, dloss, work):
        N, V = probs.shape
        _need("loss_backward", "probs", probs, np.float32)
        _need("loss_backward", "targets", targets, np.int32, size=N)
        for nm, a in (("dx", dx), ("dwte", dwte), ("x", x), ("wte", wte)):
            _need("loss_backward", nm, a, np.float32)
        kernel("loss.cu", "k_probs_to_dlogits_f32")((N,), (512,), (probs, targets, _f(dloss), _i(N), _i(V)))
        self.blas.mm(dx, probs, wte, beta=1.0)               # dx += dlogits @ wte
        self.blas.mm(dwte, probs, x, ta=True, beta=1.0)      # dwte += dlogits.T @ x

    # clipping + AdamW
    def grad_norm_partial(self, partials, grads):
        _need("grad_norm_partial", "partials", partials, np.float64)
        _need("grad_norm_partial", "grads", grads, np.float32)
        P, n = partials.shape[0], grads.shape[0]
        chunk = -(-n // P)
        kernel("optim.cu", "k_grad_norm_partial_chunks")((P,), (1024,), (grads, np.int64(n), np.int64(chunk), partials))

    def grad_norm_final(self, partials) -> float:
        host = _cp().asnumpy(partials)
        return float(math.sqrt(float(np.sum(host)))) if np.isfinite(host).all() else float("nan")

    def grad_scale(self, grads, scale):
        _need("grad_scale", "grads", grads, np.float32)
        k_scale(grads, grads.size, scale)

    def adamw(self, w, g, m, v, n_decay, t, lr, beta1, beta2, eps, weight_decay):
        cp = _cp()
        for nm, a in (("w", w), ("g", g), ("m", m), ("v", v)):
            _need("adamw", nm, a, np.float32, size=w.size)
        hp = cp.asarray(_adam_hyper(t, lr, beta1, beta2, eps, weight_decay))
        gstate = cp.asarray(np.array([0.0, 1.0, 1.0, 0.0], dtype=np.float32))
        kernel("optim.cu", "k_adamw_f32")((_blocks(w.size),), (256,),
                                         (w, g, m, v, np.uint64(0), np.int64(w.size), hp, gstate,
                                          np.int64(n_decay if weight_decay else 0), _i(0)))


def _adam_hyper(t: int, lr: float, beta1: float, beta2: float, eps: float, wd: float) -> np.ndarray:
    """The 8 floats k_adamw reads: [lr, wd, lr / bc1, 1 / sqrt(bc2), beta1, beta2, eps, 0]."""
    bc1 = 1.0 - beta1 ** t
    bc2 = 1.0 - beta2 ** t
    return np.array([lr, wd, lr / bc1, 1.0 / math.sqrt(bc2), beta1, beta2, eps, 0.0], dtype=np.float32)


# ----------------------------------------------------------------------------- the backend object
class CupyBackend:
    name = "cupy"
    precisions = ("fp32", "bf16", "fp16")

    def __init__(self):
        self.xp = _cp()
        self.ops = _Ops()

    @staticmethod
    def att_shape(B: int, H: int, T: int) -> tuple[int, ...]:
        return (B, H, T)

    @staticmethod
    def work_elems(B: int, T: int, C: int, H: int, V: int) -> int:
        return _Ops.work_elems(B, T, C, H, V)

    @staticmethod
    def row_slots(B: int) -> list[tuple[int, int]]:
        """One slice: the device runs the whole batch per launch."""
        return [(0, B)]

    @staticmethod
    def run_parallel(fn, n: int) -> None:
        for i in range(n):
            fn(i)

    def to_host(self, a) -> np.ndarray:
        return self.xp.asnumpy(a)

    def copy_from_host(self, dst, src) -> None:
        src = np.ascontiguousarray(src, dtype=dst.dtype).reshape(dst.shape)
        if dst.flags.c_contiguous:
            dst.set(src)
        else:
            dst[...] = self.xp.asarray(src)

    def synchronize(self) -> None:
        self.xp.cuda.get_current_stream().synchronize()

    def make_engine(self, mc: ModelConfig, batch_size: int, precision: str = "fp32", cuda_graph: bool = True):
        return GpuEngine(mc, batch_size, precision=precision, cuda_graph=cuda_graph, backend=self)


def make_backend() -> CupyBackend:
    reason = probe()
    if reason is not None:
        raise AndreaError(f"cupy backend: {reason}")
    return CupyBackend()


# ----------------------------------------------------------------------------- the fast engine
class GpuEngine:
    """The training step on the GPU in fp32 | bf16 | fp16 with fp32 master weights, m and v.

    Same public surface as andrea.engine.engine.Engine (n_params, layout, w, m, v, init_weights,
    load_state, forward, train_step, describe, planned_bytes, allocated_bytes), so checkpoints
    (fp32 w, m, v in the flat layout) are interchangeable with the NumPy engine's.
    Every buffer lives in one arena allocated at construction; ``planned_bytes`` is its size.
    """

    def __init__(self, mc: ModelConfig, batch_size: int, precision: str = "bf16", cuda_graph: bool = True,
                 backend: CupyBackend | None = None):
        cp = _cp()
        if precision not in _SUFFIX:
            raise AndreaError(f"train.precision: {precision!r} is not supported by the cupy engine "
                              f"(fp32 | bf16 | fp16; fp8 is not implemented)")
        self.cp, self.mc, self.B, self.prec = cp, mc, int(batch_size), precision
        self.be = backend or CupyBackend()
        self.blas = self.be.ops.blas
        self.layout = param_layout(mc)
        self.n_params = self.layout.n_params
        self.T, self.N = mc.context, self.B * mc.context
        B, T, N, C, H, V, L = self.B, self.T, self.N, mc.d_model, mc.n_head, mc.vocab_size, mc.n_layer
        F = 4 * C
        attn_impl(precision, C // H, 3 * C)  # refuse an unsupported head size now, not mid-step
        low = np.float32 if precision == "fp32" else np.uint16
        self.lowtype = _LOWTYPE[precision]
        self.loss_scale = 2.0 ** 12 if precision == "fp16" else 1.0
        self.good_steps = 0
        n, n_chunks = self.n_params, (N + LN_ROWS_PER_CHUNK - 1) // LN_ROWS_PER_CHUNK
        spec = [
            ("w", (n,), np.float32), ("g", (n,), np.float32), ("m", (n,), np.float32), ("v", (n,), np.float32),
            ("res", (2 * L + 1, N, C), np.float32),
            ("ln1", (N, C), low), ("ln1_mean", (L, N), np.float32), ("ln1_rstd", (L, N), np.float32),
            ("qkv", (L, N, 3 * C), low), ("atty", (L, N, C), low), ("lse", (L, B * H, T), np.float32),
            ("ln2", (N, C), low), ("ln2_mean", (L, N), np.float32), ("ln2_rstd", (L, N), np.float32),
            ("h_pre", (L, N, F), low), ("h_act", (N, F), low),
            ("lnf", (N, C), low), ("lnf_mean", (N,), np.float32), ("lnf_rstd", (N,), np.float32),
            ("logits", (N, V), low), ("loss_lse", (N,), np.float32), ("losses", (N,), np.float32),
            ("loss_out", (8,), np.float32), ("branch", (N, C), low),
            ("dres", (N, C), np.float32), ("dln", (N, C), low), ("dqkv", (N, 3 * C), low),
            ("datty", (N, C), low), ("dh", (N, F), low), ("dvec", (B * H * T,), np.float32),
            ("ln_part", (n_chunks * 2 * C,), np.float32), ("norm_part", (NORM_BLOCKS,), np.float32),
            ("gstate", (4,), np.float32), ("hp", (8,), np.float32),
            ("idx", (B, T), np.int32), ("targets", (N,), np.int32),
            ("seg_order", (N,), np.int32), ("seg_start", (N + 1,), np.int32), ("seg_tok", (N,), np.int32),
            ("seg_n", (1,), np.int32),
        ]
        if precision != "fp32":
            spec += [("wlow", (n,), low), ("dbranch", (N, C), low)]
        offs, off = {}, 0
        for name, shape, dt in spec:
            offs[name] = off
            off += -(-math.prod(shape) * np.dtype(dt).itemsize // 256) * 256
        self.planned_bytes = -(-off // 512) * 512
        pool = cp.get_default_memory_pool()
        before = pool.used_bytes()
        self.arena = cp.empty(self.planned_bytes, dtype=np.uint8)
        self.arena_used = pool.used_bytes() - before
        self.a = {}
        for name, shape, dt in spec:
            nb = math.prod(shape) * np.dtype(dt).itemsize
            self.a[name] = self.arena[offs[name]:offs[name] + nb].view(dt).reshape(shape)
        a = self.a
        self.w, self.g, self.m, self.v = a["w"], a["g"], a["m"], a["v"]
        if precision == "fp32":
            a["wlow"], a["dbranch"] = a["w"], a["dres"]
        self.W = {t.name: a["w"][t.offset:t.offset + t.size].reshape(t.shape) for t in self.layout.tensors}
        self.WL = {t.name: a["wlow"][t.offset:t.offset + t.size].reshape(t.shape) for t in self.layout.tensors}
        self.G = {t.name: a["g"][t.offset:t.offset + t.size].reshape(t.shape) for t in self.layout.tensors}
        self.arena.fill(0)
        a["gstate"].set(np.array([0.0, 1.0, 1.0, 0.0], dtype=np.float32))
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.use_graph = bool(cuda_graph) and precision != "fp16"
        self.graph = None
        self.graph_scale = None

    # ------------------------------------------------------------------ bookkeeping
    @property
    def allocated_bytes(self) -> int:
        return int(self.arena.nbytes)

    def describe(self) -> str:
        mc, mib = self.mc, 1 << 20
        return (f"model: {self.n_params:,} parameters (V={mc.vocab_size} C={mc.d_model} H={mc.n_head} "
                f"L={mc.n_layer} T={mc.context}); batch {self.B}x{self.T}; backend cupy {self.prec}"
                f"{' + CUDA graph' if self.use_graph else ''}\n"
                f"planned bytes: {self.planned_bytes:,} ({self.planned_bytes / mib:.1f} MiB; fp32 w+g+m+v "
                f"{16 * self.n_params / mib:.1f} MiB); memory pool grew by {self.arena_used:,} bytes")

    def _low_refresh(self) -> None:
        if self.prec != "fp32":
            k_cast(self.prec, self.a["wlow"], self.a["w"], self.n_params)

    def init_weights(self, seed: int) -> None:
        """The same weights as Engine.init_weights(seed) (``init_params``, drawn on the host)."""
        host = init_params(self.mc, seed)
        self.load_state(host, np.zeros_like(host), np.zeros_like(host))

    def load_state(self, w: np.ndarray, m: np.ndarray, v: np.ndarray) -> None:
        for dst, src in ((self.w, w), (self.m, m), (self.v, v)):
            dst.set(np.ascontiguousarray(src, dtype=np.float32).reshape(-1))
        self.g.fill(0)
        self._low_refresh()
        self.cp.cuda.Device().synchronize()

    # ------------------------------------------------------------------ the step
    def _load_batch(self, x, y) -> None:
        a = self.a
        a["idx"].set(np.ascontiguousarray(x, dtype=np.int32).reshape(self.B, self.T))
        if y is not None:
            a["targets"].set(np.ascontiguousarray(y, dtype=np.int32).reshape(-1))
        for name, arr in zip(("seg_order", "seg_start", "seg_tok", "seg_n"), embed_segments(x)):
            a[name].set(arr)

    def _forward(self, with_loss: bool) -> None:
        a, W, WL, mc, p = self.a, self.W, self.WL, self.mc, self.prec
        B, T, N, C, H, V = self.B, self.T, self.N, mc.d_model, mc.n_head, mc.vocab_size
        mm, lt = self.blas.mm, self.lowtype
        kernel("embed.cu", "k_embed_fwd")((_blocks(N * C),), (256,),
                                          (a["idx"], W["wte"], W["wpe"], a["res"][0], _i(N), _i(T), _i(C), _i(V)))
        for l in range(mc.n_layer):
            q = f"h.{l}."
            x_in, x_mid, x_out = a["res"][2 * l], a["res"][2 * l + 1], a["res"][2 * l + 2]
            k_layernorm_fwd(p, a["ln1"], a["ln1_mean"][l], a["ln1_rstd"][l], x_in, W[q + "ln1.g"], W[q + "ln1.b"], N, C)
            mm(a["qkv"][l], a["ln1"], WL[q + "attn.w_qkv"], lowtype=lt)
            k_attn_fwd(p, a["atty"][l], a["lse"][l], a["qkv"][l], B, T, C, H)
            mm(a["branch"], a["atty"][l], WL[q + "attn.w_o"], lowtype=lt)
            k_residual_add(p, x_mid, x_in, a["branch"], N * C)
            k_layernorm_fwd(p, a["ln2"], a["ln2_mean"][l], a["ln2_rstd"][l], x_mid, W[q + "ln2.g"], W[q + "ln2.b"], N, C)
            mm(a["h_pre"][l], a["ln2"], WL[q + "mlp.w_fc"], lowtype=lt)
            k_gelu_fwd(p, a["h_act"], a["h_pre"][l], N * 4 * C)
            mm(a["branch"], a["h_act"], WL[q + "mlp.w_proj"], lowtype=lt)
            k_residual_add(p, x_out, x_mid, a["branch"], N * C)
        k_layernorm_fwd(p, a["lnf"], a["lnf_mean"], a["lnf_rstd"], a["res"][-1], W["lnf.g"], W["lnf.b"], N, C)
        mm(a["logits"], a["lnf"], WL["wte"], tb=True, lowtype=lt)
        if with_loss:
            k_loss_fwd(p, a["loss_lse"], a["losses"], a["logits"], a["targets"], N, V)
            kernel("loss.cu", "k_loss_mean")((1,), (1024,), (a["losses"], a["loss_out"], _i(N)))

    def _backward(self, dscale: float) -> None:
        a, W, WL, G, mc, p = self.a, self.W, self.WL, self.G, self.mc, self.prec
        B, T, N, C, H, V = self.B, self.T, self.N, mc.d_model, mc.n_head, mc.vocab_size
        mm, lt = self.blas.mm, self.lowtype
        dres, dln, dbranch = a["dres"], a["dln"], a["dbranch"]
        k_loss_bwd(p, a["logits"], a["logits"], a["targets"], a["loss_lse"], dscale, N, V)   # in place
        mm(dln, a["logits"], WL["wte"], lowtype=lt)                       # dx = dlogits @ wte
        mm(G["wte"], a["logits"], a["lnf"], ta=True, beta=1.0, lowtype=lt)  # dwte += dlogits.T @ lnf
        dres.fill(0)
        k_layernorm_bwd(p, dres, G["lnf.g"], G["lnf.b"], dln, a["res"][-1], a["lnf_mean"], a["lnf_rstd"],
                        W["lnf.g"], a["ln_part"], N, C)
        for l in reversed(range(mc.n_layer)):
            q = f"h.{l}."
            # x_out = x_mid + mlp(ln2(x_mid)): the residual passes dres through; the branch gets it too
            # ln2(x_mid) and gelu(h_pre) are recomputed (same kernels, same bits) instead of kept per layer
            k_layernorm_fwd(p, a["ln2"], a["ln2_mean"][l], a["ln2_rstd"][l], a["res"][2 * l + 1], W[q + "ln2.g"],
                            W[q + "ln2.b"], N, C)
            k_gelu_fwd(p, a["h_act"], a["h_pre"][l], N * 4 * C)
            if p != "fp32":
                k_cast(p, dbranch, dres, N * C)
            mm(a["dh"], dbranch, WL[q + "mlp.w_proj"], tb=True, lowtype=lt)
            mm(G[q + "mlp.w_proj"], a["h_act"], dbranch, ta=True, beta=1.0, lowtype=lt)
            k_gelu_bwd(p, a["dh"], a["dh"], a["h_pre"][l], N * 4 * C)
            mm(G[q + "mlp.w_fc"], a["ln2"], a["dh"], ta=True, beta=1.0, lowtype=lt)
            mm(dln, a["dh"], WL[q + "mlp.w_fc"], tb=True, lowtype=lt)
            k_layernorm_bwd(p, dres, G[q + "ln2.g"], G[q + "ln2.b"], dln, a["res"][2 * l + 1], a["ln2_mean"][l],
                            a["ln2_rstd"][l], W[q + "ln2.g"], a["ln_part"], N, C)
            # x_mid = x_in + attn_out(attn(attn_qkv(ln1(x_in))))
            if p != "fp32":
                k_cast(p, dbranch, dres, N * C)
            mm(a["datty"], dbranch, WL[q + "attn.w_o"], tb=True, lowtype=lt)
            mm(G[q + "attn.w_o"], a["atty"][l], dbranch, ta=True, beta=1.0, lowtype=lt)
            k_attn_bwd(p, a["dqkv"], a["datty"], a["atty"][l], a["lse"][l], a["dvec"], a["qkv"][l], B, T, C, H,
                       accumulate=False)
            k_layernorm_fwd(p, a["ln1"], a["ln1_mean"][l], a["ln1_rstd"][l], a["res"][2 * l], W[q + "ln1.g"],
                            W[q + "ln1.b"], N, C)
            mm(G[q + "attn.w_qkv"], a["ln1"], a["dqkv"], ta=True, beta=1.0, lowtype=lt)
            mm(dln, a["dqkv"], WL[q + "attn.w_qkv"], tb=True, lowtype=lt)
            k_layernorm_bwd(p, dres, G[q + "ln1.g"], G[q + "ln1.b"], dln, a["res"][2 * l], a["ln1_mean"][l],
                            a["ln1_rstd"][l], W[q + "ln1.g"], a["ln_part"], N, C)
        k_embed_bwd(G["wte"], G["wpe"], dres, (a["seg_order"], a["seg_start"], a["seg_tok"], a["seg_n"]), B, T, C)

    def _capture(self) -> None:
        """Capture forward + backward of one microbatch as a CUDA graph (the arena's pointers never
        change, so replaying it after loading a new batch runs the new batch). One eager run first
        loads every module and lets cuBLAS set up its workspace outside the capture."""
        with self.stream:
            self._forward(True)
            self._backward(self.loss_scale / self.N)
            self.stream.synchronize()
            try:
                self.stream.begin_capture()
                self._forward(True)
                self._backward(self.loss_scale / self.N)
                self.graph = self.stream.end_capture()
                self.graph_scale = self.loss_scale
            except Exception as e:  # noqa: BLE001 - fall back to eager launches, and say so
                try:
                    self.stream.end_capture()
                except Exception:  # noqa: BLE001
                    pass
                self.use_graph, self.graph = False, None
                print(f"cupy engine: CUDA graph capture failed ({type(e).__name__}: {e}); running eagerly",
                      file=sys.stderr)
            self.g.fill(0)
        self.stream.synchronize()

    def zero_grads(self) -> None:
        with self.stream:
            self.g.fill(0)

    def micro_step(self, x, y) -> float:
        """Forward + backward of one microbatch, accumulating (+=) its mean-loss gradient into g
        (fp32; times the fp16 loss scale). Returns the microbatch's mean loss."""
        with self.stream:
            self._load_batch(x, y)
            if self.use_graph and self.graph is None:
                self._capture()
            if self.graph is not None and self.graph_scale == self.loss_scale:
                self.graph.launch(stream=self.stream)
            else:
                self._forward(True)
                self._backward(self.loss_scale / self.N)
            out = self.a["loss_out"][:1].get(stream=self.stream)
        return float(out[0])

    def apply_update(self, n_micro: int, loss: float, lr: float, t: int, hp: Hyper) -> StepResult:
        """Global norm of the accumulated gradients / n_micro (/ loss scale), clip, AdamW, all on
        the device; a non-finite loss or norm leaves w, m and v untouched (the kernel checks)."""
        if not math.isfinite(loss):
            self._scaler(False)
            return StepResult(loss, float("nan"), False)
        a, n = self.a, self.n_params
        inv = 1.0 / (self.loss_scale * n_micro)
        with self.stream:
            a["hp"].set(_adam_hyper(t, lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay), stream=self.stream)
            kernel("optim.cu", "k_grad_norm_partial")((NORM_BLOCKS,), (256,), (a["g"], np.int64(n), a["norm_part"]))
            kernel("optim.cu", "k_grad_norm_final")((1,), (512,), (a["norm_part"], _i(NORM_BLOCKS),
                                                                 _f(hp.grad_clip), _f(inv), a["gstate"]))
            wlow = a["wlow"] if self.prec != "fp32" else np.uint64(0)
            kernel("optim.cu", f"k_adamw_{_SUFFIX[self.prec]}")(
                (_blocks(n),), (256,), (a["w"], a["g"], a["m"], a["v"], wlow, np.int64(n), a["hp"], a["gstate"],
                                        np.int64(self.layout.n_decay), _i(1)))
            out = a["gstate"][:3].get(stream=self.stream)
        ok = bool(out[2] != 0.0)
        self._scaler(ok)
        return StepResult(loss, float(out[0]) if ok else float("nan"), ok)

    def _scaler(self, ok: bool) -> None:
        """Dynamic loss scale (fp16 only): halve on a bad step, double after 1000 good ones."""
        if self.prec != "fp16":
            return
        if not ok:
            self.loss_scale, self.good_steps = max(1.0, self.loss_scale / 2), 0
        else:
            self.good_steps += 1
            if self.good_steps % 1000 == 0:
                self.loss_scale = min(2.0 ** 24, self.loss_scale * 2)

    # The microbatch loop is the NumPy engine's, over this engine's zero_grads/micro_step/apply_update.
    train_step = Engine.train_step

    def eval_batch(self, x: np.ndarray, y: np.ndarray) -> tuple[float, int]:
        """Summed loss and token count of b <= B rows (b < B is padded with row 0, not counted).
        Touches activations only, never weights or gradients."""
        b = x.shape[0]
        if b < self.B:
            px = np.concatenate([x, np.repeat(x[:1], self.B - b, axis=0)])
            py = np.concatenate([y, np.repeat(y[:1], self.B - b, axis=0)])
        else:
            px, py = x, y
        self.forward(px, py)
        losses = self.cp.asnumpy(self.a["losses"])
        return float(np.asarray(losses[:b * self.T], dtype=np.float64).sum()), b * self.T

    def compute_grads(self, x, y) -> float:
        """Zero the grads, forward + backward of the mean loss on one batch, no optimizer step.
        Returns the loss; the fp32 gradients (times the fp16 loss scale) stay in ``self.g``."""
        self.zero_grads()
        loss = self.micro_step(x, y)
        self.stream.synchronize()
        return loss

    def forward(self, x=None, y=None) -> float | None:
        """Evaluation: run the model on (B, T) ids; with targets return the mean loss (float)."""
        with self.stream:
            if x is not None:
                self._load_batch(x, y)
            elif y is not None:
                self.a["targets"].set(np.ascontiguousarray(y, dtype=np.int32).reshape(-1))
            self._forward(y is not None)
            out = self.a["loss_out"][:1].get(stream=self.stream) if y is not None else None
        self.stream.synchronize()
        return None if out is None else float(out[0])

    def logits_host(self) -> np.ndarray:
        """The last forward's logits (N, V) as float32 on the host."""
        lg = self.a["logits"]
        if self.prec == "fp32":
            return self.cp.asnumpy(lg)
        bits = self.cp.asnumpy(lg)
        if self.prec == "bf16":
            return (bits.astype(np.uint32) << 16).view(np.float32)
        return bits.view(np.float16).astype(np.float32)

    def grads_host(self) -> np.ndarray:
        return self.cp.asnumpy(self.g)

    def state_host(self):
        return tuple(self.cp.asnumpy(x) for x in (self.w, self.m, self.v))
