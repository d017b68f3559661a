"""cuBLASLt through ctypes: the 16-bit GEMMs of the bf16/fp16 engine (``mm``) and the FP8 GEMM
of the fp8 engine (``mm_nt``, used by ``andrea/cuda/fp8.py``).

    from andrea.cuda.cublaslt import Lt, CUDA_R_16BF
    lt = Lt(workspace)                                   # a CuPy uint8 buffer (the engine's arena)
    lt.mm(C, A, B, ta=False, tb=True, beta=0.0, lowtype=CUDA_R_16BF, stream=s)   # Blas.mm's contract
    lt.mm_nt(D, X8, Y8, x_inv, y_inv, M, N, K, CUDA_R_16BF, beta=0.0)

``mm``: row-major C (M, N) = op(A) op(B) + beta C (beta 0 or 1), A and B 16-bit (uint16 payloads
of ``lowtype``), C 16-bit or fp32, fp32 accumulation and scale. With ``epilogue`` and ``aux`` (a
matrix of C's shape and type, row stride a multiple of 8 elements) it fuses the MLP's GELU:
- ``EPILOGUE_GELU_AUX``: aux = P = op(A) op(B) and C = gelu(P), both rounded from the fp32
  accumulator (gelu of the unrounded P, not of aux); the forward's h_pre and h_act in one GEMM;
- ``EPILOGUE_DGELU``: C = (op(A) op(B)) * gelu'(aux), the fp32 product times the derivative at the
  saved pre-activation, rounded once; the backward's dL/dh_pre straight out of the proj dgrad.
cuBLASLt's GELU is the tanh form 0.5 u (1 + tanh(sqrt(2/pi) (u + 0.044715 u^3))), the recipe's
(andrea/engine/ops_numpy.py ``_gelu``) and as torch's approximate="tanh": cuBLASLt's documentation
names no formula, so tests/test_cuda_kernels.py measures it (pre-activations in [-4, -1.5], where
the tanh and erf forms differ by up to 4.7e-4 and the outputs are small enough for 16-bit rounding
to be below that). Unlike ``kernels.Blas`` a matrix
may be a row-strided view (unit column stride, rows ``strides[0]`` apart): the engine's logits are
the first V columns of rows padded to a multiple of 64 elements, so every row of the head GEMMs
starts 128-byte aligned.

``mm_nt``: row-major D (M, N) = (x_inv X8) (M, K) @ ((y_inv Y8) (N, K))^T + beta D, X8 and Y8
E4M3 (uint8 payloads), both K-contiguous: the "TN" form Hopper's FP8 tensor cores require.
x_inv / y_inv are device pointers to one float each (per-tensor dequantization factors). D is
bf16 (beta 0), fp32 (beta 0 or 1: the weight-gradient accumulation) or E4M3 (beta 0, with a D scale
and an AMAX_D pointer: D = E4M3(d_scale * result), satfinite on the H200, amax of the result before
the scale; its C is a bf16 layout, unread; fp16 beside an E4M3 aux). Compute and scale type fp32. In cuBLASLt's column-major terms D^T (N, M) = op(A) op(B) with A = Y8 (K x N, transa T),
B = X8 (K x M, transb N). With a bf16 D, beta 0, ``epilogue`` GELU_AUX or DGELU and ``aux`` (bf16,
D's shape, row stride a multiple of 8 elements) it fuses the GELU as ``mm`` does, from the fp32
product of the dequantized E4M3 operands (the fp8 engine's fc forward and proj dgrad). cuBLAS's
documentation (cublasLtMatmul, the FP8 table: E4M3 x E4M3 with C/D bf16, footnote: ReLU, dReLU,
GELU, dGELU and bias epilogues, column-major D) lists both; the aux type is left unset, which is
D's type (CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE may differ from it only for an E4M3 D). With an
E4M3 D and GELU_AUX the aux is bf16, or E4M3 (a uint8 aux) at the fixed scale ``aux_scale`` points
to: aux = E4M3(aux_scale * P), satfinite (the fp8 engine's h_pre, fp8.HPRE_E4M3); cuBLASLt takes that
aux type only beside an fp16 C (the H200 returned no algorithm with a bf16 one; C is unread at beta 0).

One algorithm per problem (shape, types, beta, accumulation mode, epilogue, alignments) is
picked on first use and kept, so a given shape always runs the same kernel (cuBLAS is
bit-reproducible for a fixed algorithm on one GPU model): the candidate ``lt_choices.json`` names
for this GPU model and cuBLASLt version (measured by ``bench/lt_algos.py --write-table``: the
fastest of the heuristic's candidates, where it beat the first by 2% or more), else the first of
cuBLASLt's heuristic candidates that runs. The table is data in git, so the same GPU model and
library give the same choice, and the same bytes, on every run (``USE_CHOICES = False``: the
heuristic's first everywhere). An entry may also be "w0:i", candidate i of the heuristic asked for
algorithms that need no workspace, whose calls then get none (``table_choice``; bench/lt_algos.py
--no-workspace times those for the 16-bit problems). The committed table holds the H200's choices for the 120M B=32
problems (the step measured 49.72 ms against 50.81 bf16, 44.58 against 44.77 fp8;
docs/bench/lt_choices_s11_h200.json), the 480M B=8 ones (bf16 and fp8, added from a later
``lt_algos.py`` pass) and the 12M B=8 and B=64 bf16 ones (session 24: the step 3.34 against 3.43 ms at
B=8, 20.33 against 20.45 at B=64, the tables alternating in one process; docs/bench/s24_h200.md), and
from session 25 the 480M B=16 ones (the step 92.14 against 93.04 ms, alternating) and the 480M B=8
weight-gradient GEMMs as they run since WGRAD_WRITES (beta 0: their beta-1 entries no longer matched;
docs/bench/s25_h200.md). Session 26 re-timed the 480M B=8 and B=16 problems with ``lt_algos.py
--sustain-ms 200``, each candidate at the card's power limit as in the step (docs/bench/s26_h200.md): 11
entries changed; the step, the tables alternating, 47.19 against 47.41 ms at B=8 (four rounds) and 91.22
against 91.32 at B=16 (three). Session 27 re-timed the 12M and 120M problems the same way
(docs/bench/s27_h200.md) and kept the new choices for 12M and 120M B=8 (the step 12.57 against 12.64
ms at 120M B=8, 19.91 against 20.10 at 12M B=64, alternating) but not for 120M B=32, whose entries stay as
they were (re-chosen, the step measured 44.12 against 43.96). Session 42 added the H100's 480M B=8 and
B=16 bf16 choices, timed the same way (the step 50.18 against 50.80 ms at B=8, 96.06 against 96.87 at B=16,
alternating; docs/bench/s42.md). The
epilogue (a cublasLtEpilogue_t; default 1 = none), its aux buffer's leading dimension and
alignment are part of the problem; the aux pointer is set on the problem's descriptor at each call
(the engine's layers differ only in it). The calls are legal inside a CUDA graph capture (no allocation; the heuristic
runs on the host). Importing this module needs neither CuPy nor a GPU.
"""

from __future__ import annotations

import ctypes
import json
from functools import lru_cache
from pathlib import Path

import numpy as np

from andrea.errors import AndreaError

# library_types.h / cublasLt.h enums
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF, CUDA_R_8F_E4M3, CUDA_R_8F_E5M2 = 0, 2, 14, 28, 29
CUBLAS_COMPUTE_32F = 68
OP_N, OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE = 3, 4, 7
DESC_EPILOGUE_AUX_POINTER, DESC_EPILOGUE_AUX_LD, DESC_EPILOGUE_AUX_DATA_TYPE = 11, 12, 22
DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER, DESC_FAST_ACCUM = 17, 18, 25
DESC_D_SCALE_POINTER, DESC_AMAX_D_POINTER, DESC_EPILOGUE_AUX_SCALE_POINTER = 20, 21, 23
PREF_MAX_WORKSPACE_BYTES = 1
PREF_MIN_ALIGNMENT = {"A": 5, "B": 6, "C": 7, "D": 8}
EPILOGUE_DEFAULT = 1
EPILOGUE_GELU_AUX, EPILOGUE_DGELU = 160, 192   # GELU | AUX (32 | 128); DGELU (64 | 128): read the aux
AUX_EPILOGUES = (EPILOGUE_GELU_AUX, EPILOGUE_DGELU)
HEURISTIC_RESULT_BYTES = 96          # cublasLtMatmulAlgo_t (64) + size_t + status + float + int[4]
N_ALGOS = 8                          # heuristic candidates kept; the first that runs is used from then on
STATUS_NOT_SUPPORTED = 15
CHOICES = Path(__file__).with_name("lt_choices.json")   # {"<GPU> | cuBLASLt <version>": {problem: candidate}}
USE_CHOICES = True


@lru_cache(maxsize=None)
def load_choices(path: str = str(CHOICES)) -> dict:
    """The committed algorithm table (module docstring); {} when there is none."""
    p = Path(path)
    return json.loads(p.read_text()) if p.exists() else {}


def problem_id(kind: str, key: tuple) -> str:
    """A problem's name in the table: its GEMM kind (fp8 | 16) and its plan key."""
    return f"{kind}:{key!r}"


def table_choice(value, where: str = "") -> tuple[int | None, int | None]:
    """A table entry -> (the candidate to try first, the workspace bytes its call gets: None for the
    engine's workspace). An int i is candidate i of the heuristic asked with the engine's workspace;
    "w0:i" candidate i of the heuristic asked for none (an algorithm that needs no workspace, so cuBLASLt
    clears none before the kernel: bench/graph_nodes.py); None (no entry) the heuristic's order."""
    if value is None:
        return None, None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value, None
    if isinstance(value, str) and value.startswith("w0:") and value[3:].isdigit():
        return int(value[3:]), 0
    raise AndreaError(f"{CHOICES}: {where} = {value!r} is neither a candidate index (0, 1, ...) nor \"w0:<index>\" "
                      f"(a candidate asked for with no workspace); rewrite it with bench/lt_algos.py --write-table")


def try_order(n: int, preferred) -> list:
    """The candidates to try on first use: the table's choice first, then the heuristic's order."""
    if preferred is None or not 0 <= int(preferred) < n:
        return list(range(n))
    return [int(preferred)] + [i for i in range(n) if i != int(preferred)]

_P, _I, _U64, _I64, _SZ = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t


def _load():
    for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
        try:
            lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        sig = {
            "cublasLtCreate": [_P],
            "cublasLtMatmulDescCreate": [_P, _I, _I],
            "cublasLtMatmulDescSetAttribute": [_P, _I, _P, _SZ],
            "cublasLtMatrixLayoutCreate": [_P, _I, _U64, _U64, _I64],
            "cublasLtMatmulPreferenceCreate": [_P],
            "cublasLtMatmulPreferenceSetAttribute": [_P, _I, _P, _SZ],
            "cublasLtMatmulAlgoGetHeuristic": [_P, _P, _P, _P, _P, _P, _P, _I, _P, _P],
            "cublasLtMatmul": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _SZ, _P],
        }
        for fn, args in sig.items():
            f = getattr(lib, fn)
            f.argtypes, f.restype = args, _I
        lib.cublasLtGetVersion.argtypes, lib.cublasLtGetVersion.restype = [], _SZ
        return lib
    raise AndreaError("cupy engine: libcublasLt (cuBLASLt, part of the CUDA toolkit's cuBLAS; the bf16, fp16 and "
                      "fp8 GEMMs use it) could not be loaded; install the CUDA 12/13 cuBLAS libraries or use "
                      "train.precision=fp32")


def _align(ptr: int) -> int:
    """The largest power of two <= 256 dividing the address."""
    a = 256
    while ptr % a:
        a //= 2
    return a


class Lt:
    """One cuBLASLt handle, a fixed workspace and the cached plan (descriptors + algorithm) of
    every problem seen."""

    def __init__(self, workspace):
        self.lib = _load()
        self.ws = workspace
        self.ws_bytes = int(workspace.nbytes)
        h = _P()
        self._check(self.lib.cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
        self.h = h
        self.plans: dict[tuple, tuple] = {}
        self.plans16: dict[tuple, list] = {}
        self.plan_ws: dict[str, int] = {}      # problem -> workspace bytes its calls get, where not ws_bytes
        from andrea.cuda.kernels import cp
        props = cp().cuda.runtime.getDeviceProperties(cp().cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.table_key = f"{name} | cuBLASLt {int(self.lib.cublasLtGetVersion())}"
        self.prefer = load_choices(str(CHOICES)).get(self.table_key, {}) if USE_CHOICES else {}
        self._alpha = np.ones(1, dtype=np.float32)
        self._beta = {0.0: np.zeros(1, dtype=np.float32), 1.0: np.ones(1, dtype=np.float32)}

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc:
            raise AndreaError(f"cuBLASLt: {what} returned status {rc}")

    def _set(self, setter, obj, attr: int, value, ctype) -> None:
        v = ctype(value)
        self._check(setter(obj, attr, ctypes.byref(v), ctypes.sizeof(v)), f"set attribute {attr}")

    @staticmethod
    def _epilogue_aux(epilogue: int, aux, fits: bool, what: str, need) -> tuple[int, int, int]:
        """(aux pointer, aux row stride, aux alignment) of one call: GELU_AUX / DGELU take an aux
        matrix, which the caller's ``fits`` says is the right one (else ``what: epilogue E needs
        <need()>``, the message built only then); no epilogue takes none (0, 0, 0); anything else
        is refused."""
        if epilogue in AUX_EPILOGUES:
            if not fits:
                raise AndreaError(f"{what}: epilogue {epilogue} needs {need()}")
            return aux.data.ptr, aux.strides[0] // aux.itemsize, _align(aux.data.ptr)
        if epilogue == EPILOGUE_DEFAULT and aux is None:
            return 0, 0, 0
        raise AndreaError(f"{what}: epilogue {epilogue} is not one of none (1), GELU_AUX (160), DGELU (192) "
                          f"or takes no aux matrix")

    def _set_aux(self, desc, epilogue: int, aux_ptr: int, ld_aux: int, aux_type: int | None = None) -> None:
        """A new plan's aux attributes, before the heuristic, which reads the aux pointer's alignment
        (``aux_type`` None: unset, which is D's type)."""
        if epilogue not in AUX_EPILOGUES:
            return
        sd = self.lib.cublasLtMatmulDescSetAttribute
        self._set(sd, desc, DESC_EPILOGUE_AUX_POINTER, aux_ptr, ctypes.c_void_p)
        self._set(sd, desc, DESC_EPILOGUE_AUX_LD, ld_aux, ctypes.c_int64)
        if aux_type is not None:
            self._set(sd, desc, DESC_EPILOGUE_AUX_DATA_TYPE, aux_type, ctypes.c_int32)

    def _point_aux(self, plan: list, aux_ptr: int) -> None:
        """This call's aux into a kept plan (the problem's other layers share the plan)."""
        if aux_ptr:
            self._set(self.lib.cublasLtMatmulDescSetAttribute, plan[0], DESC_EPILOGUE_AUX_POINTER, aux_ptr,
                      ctypes.c_void_p)

    def _layout(self, dtype: int, rows: int, cols: int, ld: int):
        lay = _P()
        self._check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dtype, rows, cols, ld), "layout")
        return lay

    def _plan(self, key: tuple, x_inv: int, y_inv: int, aux_ptr: int = 0, d_scale: int = 0, amax_d: int = 0,
              aux_scale: int = 0):
        """Descriptors and up to N_ALGOS heuristic candidates of a problem (scale and aux pointers
        set first: an FP8 problem with scales is another problem to the heuristic)."""
        plan = self.plans.get(key)
        if plan is not None:
            return plan
        M, N, K, d_type, beta, fast, epilogue, aligns, ld_aux = key[:9]
        aux8 = key[-1] == "aux8"                                   # an E4M3 aux (mm_nt's key ends in "aux8")
        L = self.lib
        desc = _P()
        self._check(L.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc")
        sd = L.cublasLtMatmulDescSetAttribute
        self._set(sd, desc, DESC_TRANSA, OP_T, ctypes.c_int32)
        self._set(sd, desc, DESC_TRANSB, OP_N, ctypes.c_int32)
        self._set(sd, desc, DESC_EPILOGUE, epilogue, ctypes.c_uint32)
        self._set(sd, desc, DESC_FAST_ACCUM, 1 if fast else 0, ctypes.c_int8)
        self._set(sd, desc, DESC_A_SCALE_POINTER, int(y_inv), ctypes.c_void_p)
        self._set(sd, desc, DESC_B_SCALE_POINTER, int(x_inv), ctypes.c_void_p)
        e4m3 = d_type == CUDA_R_8F_E4M3
        if e4m3:                                                   # D's scale and amax, set per call (site)
            self._set(sd, desc, DESC_D_SCALE_POINTER, int(d_scale), ctypes.c_void_p)
            self._set(sd, desc, DESC_AMAX_D_POINTER, int(amax_d), ctypes.c_void_p)
        # the aux type: unset beside a bf16 D (D's), set beside an E4M3 D: E4M3 (with its scale) or bf16
        self._set_aux(desc, epilogue, aux_ptr, ld_aux, CUDA_R_8F_E4M3 if aux8 else CUDA_R_16BF if e4m3 else None)
        if aux8:
            self._set(sd, desc, DESC_EPILOGUE_AUX_SCALE_POINTER, int(aux_scale), ctypes.c_void_p)
        a_l = self._layout(CUDA_R_8F_E4M3, K, N, K)
        b_l = self._layout(CUDA_R_8F_E4M3, K, M, K)
        d_l = self._layout(d_type, N, M, N)
        # an E4M3 D takes a 16-bit C (beta 0: unread): fp16 beside an E4M3 aux (cuBLASLt allows that aux type
        # only with an fp16 C), else bf16
        c_l = self._layout(CUDA_R_16F if aux8 else CUDA_R_16BF, N, M, N) if e4m3 else d_l
        plan = self._table_plan(problem_id("fp8", key), desc, a_l, b_l, d_l, aligns,
                                f"FP8 D {M}x{N} (type {d_type}) K={K} beta={beta} epilogue {epilogue}",
                                "; M, N, K must be multiples of 16", c_l=c_l)
        self.plans[key] = plan
        return plan

    def _table_plan(self, pid: str, desc, a_l, b_l, d_l, aligns, what: str, hint: str = "", c_l=None) -> list:
        """The plan of problem ``pid`` (``_candidates``, its table name appended), the heuristic asked with the
        workspace its table entry names (``table_choice``): for a "w0:i" entry none, and its calls then get
        none (``plan_ws``)."""
        ws = table_choice(self.prefer.get(pid), pid)[1]
        plan = self._candidates(desc, a_l, b_l, d_l, aligns, what, hint, c_l=c_l, ws_bytes=ws)
        plan.append(pid)
        if ws is not None:
            self.plan_ws[pid] = ws
        return plan

    def _candidates(self, desc, a_l, b_l, d_l, aligns, what: str, hint: str = "", c_l=None,
                    ws_bytes: int | None = None) -> list:
        """The plan of a problem whose descriptor and layouts are made: [desc, a_l, b_l, d_l, the
        heuristic's result buffer, the addresses of up to N_ALGOS candidate algorithms, None, C's
        layout (``c_l``, default D's)]; entry 6 becomes the index of the candidate that ran (``_run``);
        the caller appends the problem's table name (``problem_id``). The heuristic is asked for
        algorithms that fit ``ws_bytes`` of workspace (None: the engine's)."""
        c_l = d_l if c_l is None else c_l
        L = self.lib
        pref = _P()
        self._check(L.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        sp = L.cublasLtMatmulPreferenceSetAttribute
        self._set(sp, pref, PREF_MAX_WORKSPACE_BYTES, self.ws_bytes if ws_bytes is None else ws_bytes, ctypes.c_uint64)
        for name, a in zip("ABCD", aligns):
            self._set(sp, pref, PREF_MIN_ALIGNMENT[name], a, ctypes.c_uint32)
        res = (ctypes.c_ubyte * (HEURISTIC_RESULT_BYTES * N_ALGOS))()
        n = _I(0)
        rc = L.cublasLtMatmulAlgoGetHeuristic(self.h, desc, a_l, b_l, c_l, d_l, pref, N_ALGOS, res, ctypes.byref(n))
        if rc or n.value < 1:
            raise AndreaError(f"cuBLASLt: no algorithm for {what} (status {rc}){hint}")
        algos = [ctypes.addressof(res) + i * HEURISTIC_RESULT_BYTES for i in range(n.value)]
        return [desc, a_l, b_l, d_l, res, algos, None, c_l]

    def _run(self, plan: list, a_ptr: int, b_ptr: int, d_ptr: int, beta: float, stream: int, what,
             c_ptr: int | None = None) -> None:
        """cublasLtMatmul of a plan (D = alpha op(A) op(B) + beta C, C = D in place unless ``c_ptr``;
        cuBLASLt's column-major A and B): its kept candidate, or on first use each in turn (the table's
        choice first, ``try_order``) until one runs (kept from then on). ``what()`` names the problem
        in the refusal, built only then."""
        desc, a_l, b_l, d_l, _, algos, chosen, c_l, pid = plan
        c_ptr = d_ptr if c_ptr is None else c_ptr
        ws_bytes = self.plan_ws.get(pid, self.ws_bytes)
        statuses = []
        first = None if chosen is not None else table_choice(self.prefer.get(pid), pid)[0]
        for i in ([chosen] if chosen is not None else try_order(len(algos), first)):
            rc = self.lib.cublasLtMatmul(self.h, desc, self._alpha.ctypes.data, a_ptr, a_l, b_ptr, b_l,
                                         self._beta[float(beta)].ctypes.data, c_ptr, c_l, d_ptr, d_l,
                                         algos[i], self.ws.data.ptr, ws_bytes, stream)
            if rc == 0:
                plan[6] = i                                     # this problem runs this candidate from now on
                return
            statuses.append(rc)
            if rc != STATUS_NOT_SUPPORTED:
                break
        raise AndreaError(f"cuBLASLt: cublasLtMatmul {what()} failed with status {statuses} over {len(statuses)} "
                          "candidate algorithm(s)")

    def mm_nt(self, D, X8, Y8, x_inv, y_inv, M: int, N: int, K: int, d_type: int, beta: float = 0.0,
              fast_accum: bool = False, epilogue: int = EPILOGUE_DEFAULT, stream: int = 0, aux=None,
              d_scale=None, amax_d=None, aux_scale=None) -> None:
        """D (M, N) = (x_inv X8) @ (y_inv Y8)^T + beta D; x_inv / y_inv device pointers (ints); with
        ``epilogue`` GELU_AUX or DGELU and ``aux`` (bf16, D's shape) the fused GELU (module docstring).
        ``d_type`` CUDA_R_8F_E4M3 (D uint8, beta 0; ``d_scale`` and ``amax_d`` device pointers to one
        float each): D = E4M3(d_scale[0] * result), cuBLASLt's rounding, and amax_d[0] = max |result|
        (before the scale, after the epilogue), overwritten; the aux stays bf16 (the fp8 engine's
        fc forward under delayed scaling), or, a uint8 aux with GELU_AUX and ``aux_scale`` (a 16-byte
        aligned device pointer to one float), aux = E4M3(aux_scale[0] * P), saturating."""
        if beta not in (0.0, 1.0):
            raise AndreaError("cuBLASLt fp8 gemm: beta must be 0 or 1")
        if K % 16 or M % 16 or N % 16:
            raise AndreaError(f"cuBLASLt fp8 gemm: {M}x{N}x{K} is not a multiple of 16 in every dimension")
        e4m3 = d_type == CUDA_R_8F_E4M3
        if e4m3 and (beta != 0.0 or d_scale is None or amax_d is None or D.dtype != np.uint8
                     or int(d_scale) % 16 or int(amax_d) % 16):
            raise AndreaError(f"cuBLASLt fp8 gemm: an E4M3 D needs beta 0, a uint8 D and 16-byte aligned d_scale "
                              f"and amax_d pointers (got beta {beta}, D {D.dtype}, d_scale {d_scale}, amax_d {amax_d})")
        epilogue = int(epilogue)
        aux8 = aux is not None and aux.dtype == np.uint8       # an E4M3 aux: E4M3 D, GELU_AUX, its scale
        fits = aux is not None and aux.ndim == 2 and aux.shape == (M, N) and aux.dtype in (np.uint16, np.uint8) \
            and aux.strides[1] == aux.itemsize and aux.strides[0] % 16 == 0 \
            and aux.data.ptr % 16 == 0 and d_type in (CUDA_R_16BF, CUDA_R_8F_E4M3) and beta == 0.0 \
            and (not aux8 or (e4m3 and epilogue == EPILOGUE_GELU_AUX and aux_scale is not None
                              and int(aux_scale) % 16 == 0))
        aux_ptr, ld_aux, aux_align = self._epilogue_aux(
            epilogue, aux, fits, "cuBLASLt fp8 gemm",
            lambda: f"a bf16 or E4M3 D, beta 0 and a bf16 aux matrix of D's shape ({M}, {N}) (or, with an E4M3 D and "
                    f"GELU_AUX, a uint8 one and a 16-byte aligned aux_scale), unit column stride, row stride a "
                    f"multiple of 16 bytes, 16-byte aligned (got D type {d_type}, beta {beta}, aux "
                    f"{None if aux is None else (aux.shape, aux.dtype, aux.strides)}, aux_scale {aux_scale})")
        # an E4M3 D's C (bf16, unread at beta 0) is pointed at the aux, or at D when there is none
        c_ptr = aux_ptr if e4m3 and aux_ptr else D.data.ptr
        ptrs = (Y8.data.ptr, X8.data.ptr, c_ptr, D.data.ptr)
        aligns = tuple(_align(p) for p in ptrs)
        if min(aligns) < 16 or int(x_inv) % 16 or int(y_inv) % 16:
            raise AndreaError(f"cuBLASLt fp8 gemm: buffers and scale pointers must be 16-byte aligned "
                              f"(alignments {aligns}, scales at {int(x_inv) % 16} and {int(y_inv) % 16} mod 16)")
        key = (M, N, K, d_type, float(beta), bool(fast_accum), epilogue, aligns, ld_aux, aux_align) \
            + (("aux8",) if aux8 else ())
        plan = self._plan(key, x_inv, y_inv, aux_ptr, d_scale or 0, amax_d or 0, aux_scale or 0)
        sd = self.lib.cublasLtMatmulDescSetAttribute
        self._set(sd, plan[0], DESC_A_SCALE_POINTER, int(y_inv), ctypes.c_void_p)
        self._set(sd, plan[0], DESC_B_SCALE_POINTER, int(x_inv), ctypes.c_void_p)
        if e4m3:
            self._set(sd, plan[0], DESC_D_SCALE_POINTER, int(d_scale), ctypes.c_void_p)
            self._set(sd, plan[0], DESC_AMAX_D_POINTER, int(amax_d), ctypes.c_void_p)
        if aux8:
            self._set(sd, plan[0], DESC_EPILOGUE_AUX_SCALE_POINTER, int(aux_scale), ctypes.c_void_p)
        self._point_aux(plan, aux_ptr)
        self._run(plan, Y8.data.ptr, X8.data.ptr, D.data.ptr, beta, stream,
                  lambda: f"{M}x{N}x{K} (D type {d_type}, beta {beta}, fast accumulation {fast_accum}, "
                          f"epilogue {epilogue})", c_ptr=c_ptr)

    # ------------------------------------------------------------------ 16-bit GEMM
    def _plan16(self, key: tuple, aux_ptr: int = 0):
        """Descriptors and up to N_ALGOS heuristic candidates of a 16-bit problem (row-major
        C = op(A) op(B) as column-major C^T = op(B)^T op(A)^T, as kernels.Blas calls cublasGemmEx)."""
        plan = self.plans16.get(key)
        if plan is not None:
            return plan
        M, N, K, ta, tb, ab_type, c_type, lda, ldb, ldc, beta, epilogue, aligns, ld_aux, _ = key
        L = self.lib
        desc = _P()
        self._check(L.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc")
        sd = L.cublasLtMatmulDescSetAttribute
        self._set(sd, desc, DESC_TRANSA, OP_T if tb else OP_N, ctypes.c_int32)
        self._set(sd, desc, DESC_TRANSB, OP_T if ta else OP_N, ctypes.c_int32)
        self._set(sd, desc, DESC_EPILOGUE, epilogue, ctypes.c_uint32)
        self._set_aux(desc, epilogue, aux_ptr, ld_aux, c_type)
        a_l = self._layout(ab_type, *((K, N) if tb else (N, K)), ldb)     # B's storage, column-major
        b_l = self._layout(ab_type, *((M, K) if ta else (K, M)), lda)     # A's storage
        d_l = self._layout(c_type, N, M, ldc)
        plan = self._table_plan(problem_id("16", key), desc, a_l, b_l, d_l, aligns,
                                f"C {M}x{N} K={K} (ta={ta}, tb={tb}, types {ab_type}/{c_type}, ld {lda}/{ldb}/{ldc}, "
                                f"alignments {aligns}, epilogue {epilogue})")
        self.plans16[key] = plan
        return plan

    def mm(self, C, A, B, ta: bool = False, tb: bool = False, beta: float = 0.0, lowtype: int = CUDA_R_16BF,
           stream: int = 0, epilogue: int = EPILOGUE_DEFAULT, aux=None) -> None:
        """C (M, N) = op(A) op(B) + beta C, row-major, A and B 16-bit, C 16-bit or fp32; with
        ``epilogue`` GELU_AUX or DGELU and ``aux`` (C's shape and type) the fused GELU forward /
        backward (module docstring). One algorithm per problem, kept from its first call: fixed
        bits per shape."""
        if beta not in (0.0, 1.0):
            raise AndreaError("cuBLASLt gemm: beta must be 0 or 1")
        mats = (("A", A), ("B", B), ("C", C)) + ((("aux", aux),) if aux is not None else ())
        for nm, x in mats:
            if x.ndim != 2 or x.strides[1] != x.itemsize or x.strides[0] % x.itemsize \
                    or x.strides[0] < x.shape[1] * x.itemsize:
                raise AndreaError(f"cuBLASLt gemm: {nm} must be a row-major matrix with unit column stride "
                                  f"(shape {x.shape}, strides {x.strides})")
        if A.dtype != np.uint16 or B.dtype != np.uint16 or C.dtype not in (np.uint16, np.float32):
            raise AndreaError(f"cuBLASLt gemm: A and B must be 16-bit payloads and C 16-bit or fp32 "
                              f"(got {A.dtype}, {B.dtype}, {C.dtype})")
        M, K = (A.shape[1], A.shape[0]) if ta else A.shape
        Kb, N = (B.shape[1], B.shape[0]) if tb else B.shape
        if K != Kb or C.shape != (M, N):
            raise AndreaError(f"cuBLASLt gemm: shapes do not chain: op(A) {M}x{K}, op(B) {Kb}x{N}, C {C.shape}")
        ld = lambda x: x.strides[0] // x.itemsize
        ptrs = (B.data.ptr, A.data.ptr, C.data.ptr, C.data.ptr)
        c_type = CUDA_R_32F if C.dtype == np.float32 else int(lowtype)
        epilogue = int(epilogue)
        fits = aux is not None and aux.shape == C.shape and aux.dtype == C.dtype and ld(aux) % 8 == 0 and beta == 0.0
        aux_ptr, ld_aux, aux_align = self._epilogue_aux(
            epilogue, aux, fits, "cuBLASLt gemm",
            lambda: f"beta 0 and an aux matrix of C's shape {C.shape} and type {C.dtype} with a row stride a "
                    f"multiple of 8 elements (got {None if aux is None else (aux.shape, aux.dtype, ld(aux))}, "
                    f"beta {beta})")
        key = (M, N, K, bool(ta), bool(tb), int(lowtype), c_type, ld(A), ld(B), ld(C), float(beta), epilogue,
               tuple(_align(p) for p in ptrs), ld_aux, aux_align)
        plan = self._plan16(key, aux_ptr)
        self._point_aux(plan, aux_ptr)
        self._run(plan, B.data.ptr, A.data.ptr, C.data.ptr, beta, stream,
                  lambda: f"{M}x{N}x{K} (ta={ta}, tb={tb}, C {C.dtype}, beta {beta}, epilogue {epilogue})")
