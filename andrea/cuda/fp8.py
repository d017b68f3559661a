"""The fp8 engine's GEMMs: bf16 operands cast to E4M3 with per-tensor current or delayed scaling
(``fp8.cu``), multiplied on Hopper's FP8 tensor cores (``cublaslt.py``), results in bf16/fp32.

    from andrea.cuda.fp8 import Fp8Gemm, fp8_buffers
    f8 = Fp8Gemm(arena_views, weight_views, plan, bf16_only_ptrs, blas, scaling="delayed", n_sites=12 * L)
    f8.cast_weights()                      # after every weight change: every matmul weight, both orientations
    f8.begin()                             # at the start of each forward: cast sites are numbered in call order
    f8.mm(C, A, B, ta=False, tb=False, beta=0.0)               # Blas.mm's contract
    f8.after_step()                        # delayed: this step's amaxes into the history, new scales

Recipe (docs/FP8.md): E4M3 for activations, weights and gradients alike (no E5M2). Every GEMM
uses cuBLASLt's fast FP8 accumulation (``FAST_ACCUM_BWD``; NVIDIA's Transformer Engine keeps the
split, more exact, accumulation for the backward: measured here, it cost time and no accuracy). A NaN/inf input casts to NaN, the GEMM
output is non-finite and the step guard (GpuEngine.apply_update) skips the step.

Scaling (``train.fp8_scaling``):
- ``current``: each operand's amax is reduced just before its cast (one extra read of the bf16
  tensor), scale = 448 / amax, so nothing saturates and no state outlives a step;
- ``delayed``: every activation and gradient cast of a step is a *site*, numbered in call order
  from ``begin`` (``SITES_PER_LAYER`` per layer, the same sequence every step, so a CUDA graph
  replays it); a site's scale is 448 / the max of its last ``history`` amaxes
  (``andrea.engine.fp8_numpy.AmaxHistory``, on the host); the cast reduces the tensor's amax in
  the same pass (atomicMax into ``f8_cur``), and ``after_step`` pushes those into the history
  (skipped steps too) and writes the new scales. Values beyond 448 / scale saturate at 448; the
  count of sites that clipped is reported (``last_clipped``) and their scales follow next step.
  While the history is empty (a run's first step) every site uses current scaling and records
  its amax. The weights are cast once per weight change, at their current amax, except that under
  ``delayed`` the optimizer step writes them itself at the amax of the weights before the step
  (``ADAMW_E4M3``: ``step_weights``; that amax is ``weight_state``, part of the engine's extra state).

Operand orientation: cuBLASLt FP8 needs both operands K-contiguous, so ``mm`` casts op(A)
as (M, K) and op(B)^T as (N, K): A as is (or transposed when ta), B transposed (or as is
when tb). Weights (the rows of ``wlow``) are cast by ``cast_weights`` into ``w8`` in both
orientations. A gradient operand (the output gradient dY, used by dX = dY W^T and by
dW = X^T dY, which the recipe's backward calls one right after the other) is cast once into
both orientations and the copy the next ``mm`` call needs is reused; the reuse is valid only
for the very next call (``_memo``), which the gpu test checks against casting afresh.

What a step casts, and when (each a bit-exact reorganisation of casting every operand where a GEMM
needs it; the gpu tests compare both ways):
- ``SAVE_TRANSPOSES``: a forward activation (X of X W) is cast in both orientations at once, and
  its transposed copy is kept (``f8_saved``, 7 N C bytes a layer) for the weight gradient X^T dY of
  the backward, which then casts nothing. Delayed scaling keeps its site numbering: the weight
  gradient's site still counts, its amax is the forward site's (``after_step``), as it was.
- ``DGELU_CAST``: the backward's GELU derivative runs inside the cast of dL/dh (``defer_dgelu``):
  bf16(dL/dh_act * gelu'(h_pre)) as k_gelu_bwd rounds it, straight into both E4M3 orientations,
  never stored in bf16.
- ``cast_weights``: every matmul weight in two launches (``k_fp8_wamax``, ``k_fp8_wcast``) from the
  table ``weight_table``, instead of two launches per weight.

The MLP's GELU (engine FUSE_GELU_FP8): ``mm(h_act, x, w_fc, epilogue=EPILOGUE_GELU_AUX, aux=h_pre)``
writes h_act = gelu(P) and h_pre = P (bf16) from the fp32 product P of the E4M3 operands, and
``mm(dh, dout, w_proj, tb=True, epilogue=EPILOGUE_DGELU, aux=h_pre)`` dh = (dout w_proj^T) *
gelu'(h_pre) (``Lt.mm_nt``); only those two weight forms take an epilogue. With ``FC_E4M3`` (delayed
scaling once it has a history, SAVE_TRANSPOSES) the fc GEMM writes h_act in E4M3 itself, at the site's
scale that the proj forward's cast would have used, with cuBLASLt's AMAX_D as the site's amax; the
proj forward takes that copy and the proj weight gradient its transpose (``k_fp8_t_u8``): h_act is
never stored in bf16. Otherwise h_act is bf16 and the proj forward and weight gradient cast it at
their own sites, as without the fusion. With ``HPRE_E4M3`` the same GEMM writes its aux h_pre in E4M3
too, at the fixed scale ``HPRE_SCALE`` (no site, no amax: gelu' is flat beyond the +-448 / HPRE_SCALE
where it saturates), and the GELU-backward cast reads those bytes (``k_fp8_dgelu8_cast_t_bf16``).
"""

from __future__ import annotations

import numpy as np

from andrea.cuda.cublaslt import CUDA_R_8F_E4M3, CUDA_R_16BF, CUDA_R_32F, EPILOGUE_DEFAULT, EPILOGUE_GELU_AUX, Lt
from andrea.cuda.kernels import i32, k_loss_bwd_e4m3, k_residual_add, need
from andrea.cuda.loader import kernel
from andrea.engine.fp8_numpy import WCHUNK, AmaxHistory     # WCHUNK: k_fp8_wamax's elements per block
from andrea.errors import AndreaError

AMAX_BLOCKS = 264                 # 2 per SM on an H100/H200; any count gives the same amax
LT_WORKSPACE = 32 << 20           # cuBLASLt's recommended workspace on Hopper
TILE = 64                         # k_fp8_cast_t_bf16's tile: rows and columns multiples of 64
T_U8_COLS = 256                   # k_fp8_t_u8_s's tile width: wider byte matrices (C % 256) take it
SLOT = 64                         # floats between dequantization factors (256 bytes): cuBLASLt wants aligned scales
SITES_PER_LAYER = 12              # delayed scaling's casts a layer: 4 forward activations, their 4 transposes
                                  # (weight gradients) and 4 output gradients
SAVED_COLS_PER_LAYER = 7          # the columns of a layer's 4 forward activations (C, C, C, 4C): f8_saved's share
SCALINGS = ("current", "delayed")
SAVE_TRANSPOSES = True            # keep each forward activation's transposed E4M3 copy for its weight gradient
DGELU_CAST = True                 # the GELU backward inside the cast of dL/dh (no bf16 dL/dh_pre pass)
# Delayed scaling with a history and SAVE_TRANSPOSES: the fc forward's GELU_AUX GEMM writes h_act in E4M3
# at its site's scale (cuBLASLt's D scale, its AMAX_D the site's amax) instead of bf16 for a cast, and
# k_fp8_t_u8 writes the kept transpose: h_act is never stored in bf16. Not the same bytes as False: E4M3
# is rounded once from cuBLASLt's fp32 gelu, not from bf16(gelu).
FC_E4M3 = True
# With FC_E4M3 and DGELU_CAST: that GEMM writes its aux h_pre in E4M3 at the fixed scale HPRE_SCALE (cuBLASLt's
# aux scale, read from the float AUX_AT of the fc site's slot; satfinite), into the first half of h_pre's bytes,
# and the GELU-backward cast takes gelu' of decode(h_pre) / HPRE_SCALE: 4 N C bytes a layer less written by
# the GEMM and read by the cast. 64 keeps +-7 (448 / 64) unsaturated, where gelu' is 1 or 0 in fp32 beyond,
# and resolves 2^-15 near 0; decode / 64 is a bf16 value, so the cast's codes are those of a bf16 h_pre that
# E4M3-rounded. Not the same bytes as False (h_pre's rounding: 3 mantissa bits instead of 8).
HPRE_E4M3 = True
HPRE_SCALE = 64.0
AUX_AT = 8                        # the float of a delayed site's slot holding HPRE_SCALE (16-byte aligned)
# The same conditions: the LayerNorms before the QKV and fc GEMMs write their output in E4M3 at its site's
# scale with its amax (k_layernorm_fwd_e4m3: bf16 rounding then the cast's own conversion, so the same
# bytes as False), and a byte transpose keeps its copy: the bf16 LayerNorm output is never stored.
LN_E4M3 = True
# cuBLASLt's fast FP8 accumulation in the backward GEMMs too (False: split accumulation there, Transformer
# Engine's choice; the forward is fast either way). H200, session 11: 120M B=32 45.34 vs 45.83 ms, 480M B=8
# 44.07 vs 45.01; held-out loss after 2000 steps (bench/fp8_quality.py) 0.9998x bf16 against 0.9983x split.
FAST_ACCUM_BWD = True
# The same conditions and the memo: the attention backward ("wgds", kernels.k_attn_bwd(e4m3=)) writes
# dqkv in E4M3 at its site's scale with its amax (bf16 rounding then the cast's conversion: the same
# bytes as False), a byte transpose makes the weight gradient's copy: dqkv is never stored in bf16.
ATTN_E4M3 = True
# The same conditions: the attention forward ("wg", kernels.k_attn_fwd(e4m3=)) writes y, the attention-out
# GEMM's input, in E4M3 at its site's scale with its amax, both orientations (the transpose through shared
# memory), besides the bf16 y the backward reads: no cast of y. The same bytes as False. Off: on the H200
# (480M B=8, CUPTI) the forward grew by what the cast took (163 against 147 us a layer; the cast 17 us).
ATTN_FWD_E4M3 = False
# With ATTN_E4M3: the attention backward's kernels also write dqkv's transpose (the qkv weight gradient's
# operand) themselves, staged in shared memory, instead of a byte transpose of dqkv. The same bytes as False.
# H200, 480M B=8 (CUPTI): the byte transposes 0.89 against 1.20 ms a step, the two kernels unchanged.
ATTN_BWD_T = True
# The same for the branch gradient the residual LayerNorm backwards hand to the attention-out and MLP-proj
# backwards (k_layernorm_bwd(e4m3=)): E4M3 at its site's scale instead of bf16 for a cast, same bytes.
LNB_E4M3 = True
# The tied head's three GEMMs (logits = lnf wte^T, dlnf = dlogits wte, dwte += dlogits^T lnf) on E4M3 too
# (``mm`` takes them first, ``_head_mm``; ``head_dlogits`` is the loss backward): lnf is one more
# activation site (its LayerNorm writes it in E4M3 under LN_E4M3, its transpose kept for dwte:
# head_sites()), wte_pad is cast with the weights (current scaling), and the loss backward writes dlogits
# in E4M3 itself at the fixed scale 448 (|softmax - onehot| <= 1: no amax, no site; loss.cu
# k_loss_bwd_e4m3), a byte transpose giving dwte's operand. False: the head stays a bf16 cuBLASLt GEMM
# (``bf16_ptrs``), as before session 15.
FP8_HEAD = True
# With FP8_HEAD: the head's forward (the logits, hence the loss) on E4M3 too. False: the logits stay a bf16
# GEMM of the bf16 lnf, and only the backward's two GEMMs take E4M3 (lnf cast for dwte at one site).
FP8_HEAD_FWD = True
# Delayed scaling with the weight table: the optimizer step writes the matmul weights' E4M3 copies itself
# (k_adamw_w8_bf16, tile by tile, both orientations) at the scale of the weights *before* the step, 448 / their
# amax, instead of an amax pass and a cast of the new weights afterwards (k_fp8_wcast: 4 bytes a parameter read
# and written again). Not the same bytes as False: a weight's scale lags its amax by one step (a value beyond it
# saturates and the weight counts as a clipped cast); the amax the copies were made at is part of the state
# (``weight_amax`` in ``extra_state``), so a resume is bit-exact. Current scaling keeps the current weight casts.
ADAMW_E4M3 = True
# With ADAMW_E4M3: that step leaves the matmul weights' bf16 copy (their rows of ``wlow``) as it was, 2 bytes a
# parameter less written: while they train nothing reads it (their GEMMs take the E4M3 copies; load_state
# refreshes wlow from w before anything casts it). So during fp8 delayed training those rows of wlow hold the
# weights of the last load, not the current ones: read w (fp32) or the E4M3 copies. The same bytes of w, m, v
# and the copies as False. H200, 480M B=8 (bench/fp8_ab.py, 3 rounds): 37.79 against 37.97 ms a step.
W8_ONLY = True


def head_sites() -> int:
    """Delayed scaling's sites of the head: lnf's forward cast and its weight-gradient (shadow) site, or
    only the latter with the bf16 forward (FP8_HEAD_FWD off); none without FP8_HEAD."""
    return (2 if FP8_HEAD_FWD else 1) if FP8_HEAD else 0


DSCALE_AT = 4                     # the float of a site's slot holding its scale again, 16-byte aligned for cuBLASLt
# The transposing casts: "smem" (a 64 x 64 tile per block through shared memory) or "warp" (a tile per
# warp, transposed in registers; the GELU-backward cast keeps "smem", faster for it). The same bytes (gpu
# tests). Alone on the H200 (bench/fp8_casts.py) "warp" moves 0.82-0.83 of a device copy's GB/s against
# 0.74-0.76; the step (`bench/engine_gpu.py --precision fp8:delayed --fp8-cast-t smem warp`, two calls
# of session 11): 120M B=32 45.60 / 45.46 ms against 45.72 / 45.83, 480M B=8 44.63 / 44.26 against
# 44.65 / 45.01.
CAST_T = "warp"


def require_fp8(compute_capability) -> None:
    """Refuse, in one line, a GPU without FP8 tensor cores (compute capability below 8.9)."""
    if int(compute_capability) < 89:
        raise AndreaError(f"train.precision=fp8 needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper); "
                          f"this GPU is sm_{compute_capability}: use train.precision=bf16")


def n_sites_for(n_layer: int, head: bool) -> int:
    """Delayed scaling's cast sites a step: SITES_PER_LAYER a layer, ``head_sites()`` more with the E4M3 head."""
    return SITES_PER_LAYER * n_layer + (head_sites() if head else 0)


def fp8_buffers(n_weight8: int, N: int, C: int, n_slots: int, n_layer: int, vp: int = 0) -> list:
    """(name, shape, dtype) of the arena entries the fp8 path adds: the weights' E4M3 copies in
    both orientations (``n_weight8`` bytes, see ``weight_plan``), four (N x 4C) cast buffers, the
    amax partials, the per-cast dequantization factors (slots ``n_slots`` on are the delayed
    sites': inv, then the scale the kernel reads; then, with ``SAVE_TRANSPOSES``, one slot per saved
    transpose for current scaling; then, with the E4M3 head, its weight's and dlogits' slots, the
    last two), the delayed sites' amaxes of this step, cuBLASLt's workspace, the weight table and
    amaxes of ``cast_weights`` (three rows: ``Fp8Gemm.wamax``) and (``SAVE_TRANSPOSES``) the saved transposed activations. With
    ``FP8_HEAD`` and ``vp`` (the padded vocabulary): the head weight's two E4M3 copies (``w8_head``),
    dlogits in E4M3 (``f8_dlog``, N x vp) and dwte's fp32 product (``f8_dwte``, vp x C). The same for
    both scalings."""
    head = FP8_HEAD and vp > 0
    n_sites, n_w = n_sites_for(n_layer, head), n_slots - 3
    lnf_t = 1 if head and FP8_HEAD_FWD else 0          # lnf's kept transpose (an E4M3 forward keeps it)
    n_saved = (4 * n_layer + lnf_t) if SAVE_TRANSPOSES else 0
    out = [("w8", (n_weight8,), np.uint8), ("f8_a", (N * 4 * C,), np.uint8), ("f8_at", (N * 4 * C,), np.uint8),
           ("f8_g", (N * 4 * C,), np.uint8), ("f8_gt", (N * 4 * C,), np.uint8),
           ("f8_part", (AMAX_BLOCKS,), np.float32),
           ("f8_inv", (SLOT * (n_slots + n_sites + n_saved + (2 if head else 0)),), np.float32),
           ("f8_cur", (max(1, n_sites),), np.float32), ("lt_ws", (LT_WORKSPACE,), np.uint8),
           ("f8_wdesc", (max(1, n_w) * 8,), np.int64), ("f8_wamax", (3 * max(1, n_w),), np.float32)]
    if SAVE_TRANSPOSES:
        out.append(("f8_saved", ((n_layer * SAVED_COLS_PER_LAYER + lnf_t) * N * C,), np.uint8))
    if head:
        out += [("w8_head", (2 * vp * C,), np.uint8), ("f8_dlog", (N * vp,), np.uint8), ("f8_dwte", (vp, C), np.float32)]
    return out


def weight_plan(layout, names) -> tuple[dict, int]:
    """{tensor name: (offset of its (K, N) copy, offset of its (N, K) copy, slot)} in ``w8``,
    each 256-byte aligned, and the bytes ``w8`` needs. Slots 0..2 are the activation casts."""
    out, off = {}, 0
    for i, t in enumerate(x for x in layout.tensors if x.name.split(".", 2)[-1] in names):
        n = -(-t.size // 256) * 256
        out[t.name] = (off, off + n, 3 + i)
        off += 2 * n
    return out, off


def n_slots(plan: dict) -> int:
    return 3 + len(plan)


def weight_table(weights: list, base: int) -> tuple[np.ndarray, int, int]:
    """``k_fp8_wamax`` / ``k_fp8_wcast``'s table (fp8.cu): one row of 8 int64 per weight of
    ``weights`` [(W (R, C) bf16 view, offset of its (R, C) copy in w8, of its (C, R) copy, factor
    slot)], ``base`` the device pointer of the bf16 buffer the views lie in; and the blocks of each
    launch (chunks, tiles)."""
    rows, chunks, tiles = [], 0, 0
    for W, o, ot, slot in weights:
        R, C = W.shape
        first = W.data.ptr - base
        if first % 16 or R % TILE or C % TILE:
            raise AndreaError(f"fp8 weight casts: a ({R}, {C}) weight at byte {first} of wlow "
                              f"(needs 16-byte alignment and dimensions that are multiples of {TILE})")
        rows.append([first // 2, R, C, o, ot, SLOT * slot, chunks, tiles])
        chunks += -(-R * C // WCHUNK)
        tiles += (R // TILE) * (C // TILE)
    return np.asarray(rows, dtype=np.int64).reshape(-1, 8), chunks, tiles


# ----------------------------------------------------------------------------- launchers
def k_fp8_amax(x, part, hp=None) -> None:
    """part[AMAX_BLOCKS] = per-block max |x| over the finite entries of bf16 x (size % 8 == 0);
    with ``hp`` (bf16, x's shape) of bf16(x * gelu'(hp)) instead."""
    n = x.size
    if n % 8 or x.data.ptr % 16 or (hp is not None and (hp.size != n or hp.data.ptr % 16 or hp.dtype != np.uint16)):
        raise AndreaError(f"fp8 cast: a tensor of {n} elements (needs a multiple of 8, 16-byte aligned; "
                          f"a bf16 h_pre: an E4M3 one takes delayed scaling)")
    if hp is None:
        kernel("fp8.cu", "k_fp8_amax_bf16")((AMAX_BLOCKS,), (256,), (x, np.int64(n // 8), part))
    else:
        kernel("fp8.cu", "k_fp8_amax_dgelu_bf16")((AMAX_BLOCKS,), (256,), (x, hp, np.int64(n // 8), part))


def _ptr(x):
    return np.uint64(0) if x is None else x


def k_fp8_cast(out, x, part, inv, scale=None, rec=None) -> None:
    """out (x.size,) E4M3 of x: with ``part`` its scale is 448 / amax of ``part`` and inv[0] = 1 / scale;
    with part None the scale is scale[0] (delayed). ``rec``: amax of x atomicMax-ed into rec[0]."""
    n = x.size
    if part is None and (n % 8 or x.data.ptr % 16):
        raise AndreaError(f"fp8 cast: a tensor of {n} elements (needs a multiple of 8, 16-byte aligned)")
    kernel("fp8.cu", "k_fp8_cast_bf16")((min(4 * AMAX_BLOCKS, -(-n // 2048)),), (256,),
                                        (x, np.int64(n // 8), _ptr(part), i32(AMAX_BLOCKS), _ptr(scale), _ptr(rec),
                                         out, inv))


def k_fp8_cast_t(out, out_t, x, R: int, C: int, part, inv, scale=None, rec=None, hp=None) -> None:
    """out_t (C, R) E4M3 of x (R, C) transposed and, unless out is None, out (R, C) E4M3; the
    scale as in ``k_fp8_cast``; with ``hp`` (bf16 (R, C)) of bf16(x * gelu'(hp)) instead of x; an hp of
    uint8 holds E4M3 codes at the scale HPRE_SCALE (HPRE_E4M3; delayed scaling only)."""
    if R % TILE or C % TILE:
        raise AndreaError(f"fp8 cast: a ({R}, {C}) matrix (rows and columns must be multiples of {TILE})")
    tiles = (R // TILE) * (C // TILE)
    args = (i32(R), i32(C), _ptr(part), i32(AMAX_BLOCKS), _ptr(scale), _ptr(rec), _ptr(out), out_t, inv)
    name, ins = ("k_fp8_cast_t", (x,)) if hp is None else ("k_fp8_dgelu_cast_t", (x, hp))
    if hp is not None and hp.dtype == np.uint8:            # HPRE_E4M3's codes, read with their factor
        if part is not None or hp.size != R * C or hp.data.ptr % 8:
            raise AndreaError(f"fp8 cast: an E4M3 h_pre needs delayed scaling and ({R}, {C}) 8-byte aligned codes "
                              f"(got {hp.size} at {hp.data.ptr % 8} mod 8)")
        name, ins = "k_fp8_dgelu8_cast_t", (x, hp, np.float32(1.0 / HPRE_SCALE))
        if C % (2 * TILE) == 0:                # 64 x 128 tiles: H200 79.5 against 84.3 us at 8192 x 6144
            name, tiles = "k_fp8_dgelu8_cast_t2", tiles // 2
    if CAST_T == "warp" and hp is None:        # 8 tiles a block of 8 warps
        name, grid = name + "_w", min(-(-tiles // 8), 4 * AMAX_BLOCKS)
    else:                                      # a tile a block; the GELU-backward cast measured fastest
        grid = min(tiles, (16 if hp is not None else 8) * AMAX_BLOCKS)   # at 16 blocks an SM (session 13)
    kernel("fp8.cu", name + "_bf16")((grid,), (256,), (*ins, *args))


def k_fp8_t_u8(x8, out_t, R: int, C: int, am, rec) -> None:
    """out_t (C, R) = x8 (R, C)^T, E4M3 bytes (unless out_t is None), and (unless rec is None) am[0] (a
    GEMM's amax) atomicMax-ed into rec[0], a non-finite one as 0."""
    if R % TILE or C % TILE:
        raise AndreaError(f"fp8 transpose: a ({R}, {C}) matrix (rows and columns must be multiples of {TILE})")
    if out_t is not None and C % T_U8_COLS == 0:     # 64 x 256 tiles through shared memory, 16 blocks an SM
        grid = min((R // TILE) * (C // T_U8_COLS), 8 * AMAX_BLOCKS)
        kernel("fp8.cu", "k_fp8_t_u8_s")((grid,), (256,), (x8, i32(R), i32(C), am, _ptr(rec), out_t))
        return
    grid = 1 if out_t is None else min(-(-(R // TILE) * (C // TILE) // 8), 4 * AMAX_BLOCKS)
    kernel("fp8.cu", "k_fp8_t_u8")((grid,), (256,), (x8, i32(R), i32(C), am, _ptr(rec), _ptr(out_t)))


def k_fp8_weights(w, wd, nw: int, chunks: int, tiles: int, amax, w8, inv, part=None, chunk: int = 0,
                  cast_at=None) -> None:
    """Every weight of the table ``wd`` (``weight_table``) cast into its two E4M3 copies in w8
    (current scaling, factors into inv): amax zeroed, one block per chunk, one per tile. With
    ``part`` (the max |w| of each ``chunk`` elements of w, kernels.k_adamw's partials) the amaxes
    come from those instead of a pass over w: one block per weight. ``cast_at``: the casts take
    these amaxes (nw floats) instead of the ones just reduced into ``amax``."""
    if part is None:
        amax.fill(0)                                  # on the current stream, as the launches
        kernel("fp8.cu", "k_fp8_wamax")((chunks,), (256,), (w, wd, i32(nw), amax))
    else:
        kernel("fp8.cu", "k_fp8_wamax_parts")((nw,), (256,), (w, wd, part, np.int64(chunk), amax))
    kernel("fp8.cu", "k_fp8_wcast")((tiles,), (256,), (w, wd, i32(nw), amax if cast_at is None else cast_at,
                                                       w8, inv))


def k_adamw_w8(w, g, m, v, wlow, wd, nw: int, tiles: int, hp, gstate, n_decay: int, amax, w8, inv) -> None:
    """AdamW over the weights of the table ``wd`` with their E4M3 copies written at the amax of the weights
    before the step (amax row 1), the new amaxes into row 2, then the rows moved on and gstate[3] = the
    weights that saturated (fp8.cu k_adamw_w8_bf16, k_fp8_wamax_roll; w, g, m, v fp32 and wlow bf16 flat,
    the table's offsets index them)."""
    kernel("fp8.cu", "k_adamw_w8_bf16")((tiles,), (256,), (w, g, m, v, wlow, wd, i32(nw), hp, gstate,
                                                           np.int64(n_decay), amax, w8, inv))
    kernel("fp8.cu", "k_fp8_wamax_roll")((1,), (256,), (amax, i32(nw), gstate))


def quantize(out, out_t, x, part, inv, R: int | None = None, C: int | None = None, scale=None, rec=None,
             hp=None) -> None:
    """Cast bf16 x: natural layout into ``out``, transposed (x as (R, C)) into ``out_t``.
    Current scaling (``scale`` None): an amax pass into ``part``, then the cast, which writes
    inv[0] = 1 / scale (and, with ``rec``, atomicMax-es the amax into rec[0]). Delayed
    (``scale`` a 1-element fp32 view): the cast alone, at scale[0], atomicMax-ing x's amax into rec[0].
    ``hp``: cast bf16(x * gelu'(hp)) instead (both orientations only; an E4M3 hp: delayed only)."""
    if hp is not None and out_t is None:
        raise AndreaError("fp8 cast: the GELU-backward cast writes both orientations (out_t is required)")
    if scale is None:
        k_fp8_amax(x, part, hp)
        part_arg = part
    else:
        part_arg = None
    if out_t is None:
        k_fp8_cast(out, x, part_arg, inv, scale, rec)
    else:
        k_fp8_cast_t(out, out_t, x, R, C, part_arg, inv, scale, rec, hp)


# ----------------------------------------------------------------------------- the GEMM path
class Fp8Gemm:
    """``mm`` with Blas.mm's contract over E4M3 operands; see the module docstring."""

    def __init__(self, a: dict, WL: dict, plan: dict, bf16_ptrs: set, blas, lt=None, scaling: str = "current",
                 n_sites: int = 0, history: int = 16, ln_ptrs=()):
        """``a``: the arena's views (``fp8_buffers``; one without ``f8_wdesc`` casts the weights one
        by one, one without ``f8_saved`` casts every transpose where the backward needs it);
        ``ln_ptrs``: the LayerNorm output buffers whose next GEMM is an E4M3 one (LN_E4M3)."""
        if scaling not in SCALINGS:
            raise AndreaError(f"train.fp8_scaling: {scaling!r} (expected current | delayed)")
        self.a, self.blas, self.bf16_ptrs = a, blas, bf16_ptrs
        self.lt = lt or Lt(a["lt_ws"])
        self.inv = a["f8_inv"]
        w8 = a["w8"]
        self.weights = {}                          # wlow view ptr -> (W (K, N) bf16, W8 (K, N), W8^T (N, K), slot)
        for name, (o, ot, slot) in plan.items():
            W = WL[name]
            K, N = W.shape
            self.weights[W.data.ptr] = (W, w8[o:o + K * N].reshape(K, N), w8[ot:ot + K * N].reshape(N, K), slot)
        self.table = None                          # (weights, chunks, tiles) of the table in f8_wdesc: cast_weights
        if "f8_wdesc" in a and plan:
            wd, chunks, tiles = weight_table([(WL[n], o, ot, slot) for n, (o, ot, slot) in plan.items()],
                                             a["wlow"].data.ptr)
            a["f8_wdesc"][:wd.size].set(wd.reshape(-1))
            self.table = (len(wd), chunks, tiles)
        self._memo: dict = {}
        self.memo_enabled = True
        self._stream = lambda: blas.cp.cuda.get_current_stream().ptr
        self.scaling, self.n_sites, self.site_base = scaling, int(n_sites), n_slots(plan)
        self.hist = AmaxHistory(self.n_sites, history) if scaling == "delayed" else None
        self.site = 0                              # the next delayed site of this pass (``begin`` resets it)
        self.last_clipped = 0
        self._cur_host = self._fac_host = None     # delayed: pinned amax / factor staging (queue_amax makes them)
        self._cur_event, self._cur_queued = None, False
        self.saved = a.get("f8_saved")             # SAVE_TRANSPOSES: the forward activations' E4M3 transposes
        self.save_t = False                        # this pass saves them (``begin``: a backward follows)
        self._saved: dict = {}                     # activation (ptr, shape) -> stack of (X^T E4M3, slot, site)
        self._saved_off = self._n_saved = 0        # f8_saved bytes and transposes kept this pass
        self._shadow: list = []                    # delayed: (weight-gradient site, forward site) of this pass
        self._dgelu: dict = {}                     # gradient (ptr, shape) -> h_pre: its cast applies gelu'
        self._ready: dict = {}                     # FC_E4M3: activation (ptr, shape) -> (its E4M3 copy, slot)
        self._h8: dict = {}                        # HPRE_E4M3: h_pre's data.ptr -> its E4M3 bytes (M, N) this pass
        self.hpre_to_cast = True                   # the proj dgrad has no DGELU epilogue (FastOps sets it), so h_pre
                                                   # goes to the GELU-backward cast alone (HPRE_E4M3 may apply)
        self._produced: dict = {}                  # ATTN/LNB_E4M3: gradient (ptr, shape) -> the site it took ahead
        self.ln_ptrs = set(ln_ptrs)                # LN_E4M3: the LayerNorm outputs that go to E4M3 GEMMs
        self._inv_end = self.inv.size // SLOT      # the factor slots sites and saved transposes may take
        self.head = None                           # FP8_HEAD: (wte_pad (Vp, C), its E4M3 (Vp, C) and (C, Vp),
        if FP8_HEAD and "w8_head" in a and "wte_pad" in a:    # the weight's slot, dlogits' slot: the last two)
            wp, h8 = a["wte_pad"], a["w8_head"]
            Vp, C = wp.shape
            self._inv_end -= 2
            self.head = (wp, h8[:Vp * C].reshape(Vp, C), h8[Vp * C:2 * Vp * C].reshape(C, Vp), self._inv_end,
                         self._inv_end + 1)
            self.weights[wp.data.ptr] = (wp, self.head[1], self.head[2], self._inv_end)
        self._dlog: dict = {}                      # FP8_HEAD: dlogits (ptr, shape) -> (its E4M3, its transpose)

    @property
    def calibrating(self) -> bool:
        """Delayed scaling with no history yet: every cast uses current scaling and records its amax."""
        return self.hist is not None and self.hist.empty

    def _slot(self, i: int):
        """Device pointer of dequantization factor i (what cuBLASLt reads)."""
        return self.inv.data.ptr + 4 * SLOT * i

    def _inv(self, i: int):
        """Factor i as a 1-element view (what the cast kernels write)."""
        return self.inv[SLOT * i:SLOT * i + 1]

    def cast_weights(self, part=None, chunk: int = 0, at=None) -> None:
        """E4M3 copies of the current ``wlow`` (current scaling); the engine calls it where the weights
        change outside the optimizer (load_state) and after each optimizer step unless the step wrote them
        (``steps_weights``). Two launches for all weights (``k_fp8_weights``); the same bytes as
        ``cast_weights_each``. ``part``: the optimizer's amax partials of wlow (kernels.k_adamw), so the
        amaxes need no pass over wlow. ``at`` (host, one a weight): cast at these amaxes instead (a resumed
        ADAMW_E4M3 run: ``load_weight_state``). ``wamax`` says what the copies were made at."""
        if self.table is None:
            self.cast_weights_each()
            return
        a, am = self.a, self.wamax
        if at is not None:
            am[0].set(np.asarray(at, dtype=np.float32))
        k_fp8_weights(a["wlow"], a["f8_wdesc"], *self.table, am[1], a["w8"], self.inv, part, chunk,
                      cast_at=None if at is None else am[0])
        if at is None:
            am[0][...] = am[1]
        am[2].fill(0)
        self.cast_head()

    def cast_head(self) -> None:
        """FP8_HEAD: wte_pad's two E4M3 copies (current scaling); it is not in wlow nor in the table."""
        if self.head is not None:
            wp, h8, h8t, slot, _ = self.head
            quantize(h8, h8t, wp, self.a["f8_part"], self._inv(slot), *wp.shape)

    @property
    def wamax(self):
        """The weight table's amaxes, (3, nw) fp32 on the device: [0] the amax each weight's E4M3 copies were
        made at, [1] the amax of its bf16 copy, [2] zeros (k_adamw_w8_bf16 reduces the new weights' there)."""
        nw = self.table[0]
        return self.a["f8_wamax"][:3 * nw].reshape(3, nw)

    @property
    def steps_weights(self) -> bool:
        """ADAMW_E4M3 applies: delayed scaling and the weight table, so ``step_weights`` replaces the
        optimizer's step over the matmul weights and ``cast_weights`` after it."""
        return ADAMW_E4M3 and self.hist is not None and self.table is not None

    def step_weights(self, w, g, m, v, wlow, hp, gstate, n_decay: int) -> None:
        """The optimizer step over the weight table's parameters (``k_adamw_w8``: AdamW as kernels.k_adamw,
        and the E4M3 copies at the scale of the weights before the step); the head's copies are left to
        ``cast_head`` once wte_pad is refreshed. The rows of ``wamax`` move on; gstate[3] counts the weights
        that saturated (the engine adds them to the clipped casts)."""
        a = self.a
        nw, _, tiles = self.table
        k_adamw_w8(w, g, m, v, np.uint64(0) if W8_ONLY else wlow, a["f8_wdesc"], nw, tiles, hp, gstate, n_decay,
                   a["f8_wamax"], a["w8"], self.inv)

    def count_weight_clips(self, n: int) -> None:
        """After a good ``step_weights``: the weights whose new values saturated (gstate[3]) count as clipped
        casts, as sites do (``last_clipped``, the history's ``clipped_total``)."""
        if n:
            self.last_clipped += n
            self.hist.clipped_total += n

    def weight_state(self) -> dict:
        """``extra_state``'s part for ADAMW_E4M3: the amax each weight's E4M3 copies were made at ({} otherwise)."""
        return {"weight_amax": self.wamax[0].get().tolist()} if self.steps_weights else {}

    def load_weight_state(self, d: dict) -> None:
        """The copies re-cast at the saved ``weight_amax`` (after load_state cast them at their own amax); a
        state without it (saved before ADAMW_E4M3, or with it off) keeps that cast."""
        if not self.steps_weights or "weight_amax" not in d:
            return
        at = np.asarray(d["weight_amax"], dtype=np.float32)
        if at.shape != (self.table[0],):
            raise ValueError(f"fp8 weight_amax of {at.size} weights, this engine's table has {self.table[0]}")
        self.cast_weights(at=at)

    def cast_weights_each(self, part=None, chunk: int = 0, at=None) -> None:
        """``cast_weights`` weight by weight: an amax pass and a cast per weight (the reference; it
        takes cast_weights' arguments and reads no partials: the amaxes come from wlow itself; it casts
        at those only, so ``at`` is refused)."""
        if at is not None:
            raise AndreaError("fp8: the weight-by-weight casts take each weight's own amax (no weight table: "
                              "ADAMW_E4M3 needs one)")
        part = self.a["f8_part"]
        for W, W8, W8t, slot in self.weights.values():
            K, N = W.shape
            quantize(W8, W8t, W, part, self._inv(slot), K, N)

    # ------------------------------------------------------------------ delayed scaling
    def begin(self, backward: bool = True) -> None:
        """The start of a forward: sites are numbered from 0 again, no gradient cast is reusable;
        ``backward``: one follows, so the activations' transposes are saved for it."""
        self.site, self._memo = 0, {}
        self.save_t = backward and self.saved is not None
        self._saved, self._saved_off, self._n_saved, self._shadow, self._dgelu, self._ready = {}, 0, 0, [], {}, {}
        self._produced, self._dlog, self._h8 = {}, {}, {}

    @property
    def defers_dgelu(self) -> bool:
        """The MLP's GELU backward goes into the next cast of dL/dh (``defer_dgelu``): DGELU_CAST, and
        the cast reuse on (the deferred cast is not in dh's bf16 bytes, so a second cast of dh would miss it)."""
        return DGELU_CAST and self.memo_enabled

    def defer_dgelu(self, G, h_pre) -> None:
        """G holds dL/dh_act; the next GEMM that casts G as a gradient casts bf16(G * gelu'(h_pre))
        (k_gelu_bwd's dL/dh_pre) instead, in both orientations, and the GEMM after it reuses that
        (the memo). G itself is left as it is, so this needs the memo (``memo_enabled``)."""
        if not self.memo_enabled:
            raise AndreaError("fp8: the GELU backward inside the gradient cast needs the cast reuse (memo_enabled)")
        self._dgelu[(G.data.ptr, G.shape)] = h_pre

    def reset_amax(self) -> None:
        """The start of a step (zero_grads): this step's site amaxes start at 0 (maxed over its microbatches)."""
        if self.hist is not None:
            self.a["f8_cur"].fill(0)

    def queue_amax(self, stream) -> None:
        """Delayed, once the step's last backward is queued: its site amaxes start on their way to pinned
        host memory, so ``after_step`` waits for them alone and not for the optimizer queued after this:
        the history's rule then runs on the host while the GPU runs the update, with no sync of its own."""
        if self.hist is None or not self.n_sites:
            return
        cuda = self.blas.cp.cuda
        if self._cur_host is None:
            self._cur_event = cuda.Event(disable_timing=True)
            self._cur_host = np.frombuffer(cuda.alloc_pinned_memory(4 * self.n_sites), np.float32, self.n_sites)
            self._fac_host = np.frombuffer(cuda.alloc_pinned_memory(4 * SLOT * self.n_sites), np.float32,
                                           SLOT * self.n_sites).reshape(self.n_sites, SLOT)
            self._fac_host.fill(0)                 # write_scales sets the same four floats of each slot
        cuda.runtime.memcpyAsync(self._cur_host.ctypes.data, self.a["f8_cur"].data.ptr, 4 * self.n_sites,
                                 cuda.runtime.memcpyDeviceToHost, stream.ptr)
        self._cur_event.record(stream)
        self._cur_queued = True

    def after_step(self, stream) -> int:
        """Delayed: this step's amaxes into the history (a skipped step's too: the scales follow
        what overflowed), the new scales to the device (queued on ``stream``, from pinned memory when
        ``queue_amax`` ran: the host does not wait for the GPU there); returns how many sites clipped."""
        if self.hist is None:
            return 0
        if self._cur_queued:                       # queue_amax's copy: wait for it, not for the stream
            self._cur_event.synchronize()
            cur, self._cur_queued, staged = self._cur_host.copy(), False, True
        else:
            cur, staged = self.a["f8_cur"][:self.n_sites].get(stream=stream), False
        for t, f in self._shadow:                  # a saved transpose's site: its forward cast's amax
            cur[t] = cur[f]
        self.last_clipped = self.hist.push(cur)
        self.write_scales(stream, staged=staged)
        return self.last_clipped

    def write_scales(self, stream=None, staged: bool = False) -> None:
        """Every site's (inv, scale) from the history into its factor slot (inv first, for cuBLASLt);
        ``staged``: through the pinned staging (asynchronous on ``stream``; the caller syncs ``stream``
        before the next step rewrites it), else from pageable memory."""
        if self.hist is None or self.hist.empty or not self.n_sites:
            return
        scale, inv = self.hist.scales()
        host = self._fac_host if staged else np.zeros((self.n_sites, SLOT), dtype=np.float32)
        host[:, 0], host[:, 1], host[:, DSCALE_AT], host[:, AUX_AT] = inv, scale, scale, HPRE_SCALE
        dst = self.inv[SLOT * self.site_base:SLOT * (self.site_base + self.n_sites)]
        dst.set(host.reshape(-1), stream=stream)

    def check_pass(self) -> None:
        """After a forward + backward: the sites numbered must be the planned ones."""
        if self._dlog:
            raise AndreaError("fp8: the head's E4M3 dlogits (head_dlogits) were not taken by its weight gradient")
        if self.hist is not None and self.site != self.n_sites:
            raise AndreaError(f"fp8 delayed scaling: a step cast {self.site} activation/gradient tensors, "
                              f"the plan has {self.n_sites} sites (n_sites_for in andrea/cuda/fp8.py)")
        if self._ready or self._produced:
            raise AndreaError(f"fp8: {len(self._ready) + len(self._produced)} tensors written in E4M3 by their "
                              f"producer were not taken by a GEMM (FC_E4M3 / LN_E4M3 / ATTN_E4M3 in andrea/cuda/fp8.py)")
        left = sum(len(v) for v in self._saved.values())
        if left:
            raise AndreaError(f"fp8: {left} saved activation transposes were not used by the backward "
                              f"(SAVE_TRANSPOSES in andrea/cuda/fp8.py: every X of X W needs its X^T dY)")

    def _untaken(self, site: int) -> int:
        """``site``, or the first site after it that produce_grad has not taken ahead."""
        while site in self._produced.values():
            site += 1
        return site

    def _planned(self, site: int) -> int:
        if site >= self.n_sites:
            raise AndreaError(f"fp8 delayed scaling: more than the {self.n_sites} planned cast sites in one step")
        return site

    def _next_site(self) -> int:
        site = self._planned(self.site)
        self.site = self._untaken(site + 1)
        return site

    def _cast(self, out, out_t, x, R=None, C=None, current_slot: int = 0, site=None, hp=None) -> tuple[int, int]:
        """One activation/gradient cast; returns (its factor slot, its site or -1)."""
        part = self.a["f8_part"]
        if self.hist is None:
            quantize(out, out_t, x, part, self._inv(current_slot), R, C, hp=hp)
            return current_slot, -1
        if site is None:
            site = self._next_site()
        slot, rec = self.site_base + site, self.a["f8_cur"][site:site + 1]
        if self.hist.empty:
            quantize(out, out_t, x, part, self._inv(slot), R, C, rec=rec, hp=hp)
        else:
            quantize(out, out_t, x, part, self._inv(slot), R, C, scale=self.inv[SLOT * slot + 1:SLOT * slot + 2],
                     rec=rec, hp=hp)
        return slot, site

    def _buf(self, name: str, rows: int, cols: int):
        return self.a[name][:rows * cols].reshape(rows, cols)

    def _activation(self, A, transposed: bool):
        """op(A) as a K-contiguous E4M3 (M, K) matrix of an activation: A itself, or A^T. While
        ``save_t``, A is cast in both orientations and A^T kept for the weight gradient, which takes
        it (last saved first) instead of casting; under delayed scaling that gradient's site still
        counts, with the forward site's amax (``after_step``)."""
        key = (A.data.ptr, A.shape)
        if transposed:
            K, M = A.shape
            stack = self._saved.get(key)
            if stack:
                out, slot, site = stack.pop()
                if self.hist is not None:
                    self._shadow.append((self._next_site(), site))
                return out, self._slot(slot)
            out = self._buf("f8_at", M, K)
            slot, _ = self._cast(None, out, A, K, M, current_slot=1)
            return out, self._slot(slot)
        ready = self._ready.pop(key, None)
        if ready is not None:                                 # FC_E4M3: the GEMM that made A wrote it in E4M3
            return ready[0], self._slot(ready[1])
        out = self._buf("f8_a", *A.shape)
        if not self.save_t:
            slot, _ = self._cast(out, None, A, current_slot=0)
            return out, self._slot(slot)
        R, C = A.shape
        out_t, current = self._save_slot(R, C)
        slot, site = self._cast(out, out_t, A, R, C, current_slot=current)
        self._keep(key, out_t, slot, site)
        return out, self._slot(slot)

    def _save_slot(self, R: int, C: int):
        """The next (C, R) transpose in ``f8_saved`` and the factor slot current scaling gives it."""
        o = self._saved_off
        if o + R * C > self.saved.size:
            raise AndreaError(f"fp8: the saved activation transposes need more than f8_saved's {self.saved.size} "
                              f"bytes (SAVED_COLS_PER_LAYER in andrea/cuda/fp8.py)")
        self._saved_off = o + R * C
        current = self.site_base + self.n_sites + self._n_saved    # current scaling: a slot of its own
        if current >= self._inv_end:
            raise AndreaError(f"fp8: more saved activation transposes than f8_inv has slots for ({self._n_saved})")
        return self.saved[o:o + R * C].reshape(C, R), current

    def _keep(self, key, out_t, slot: int, site: int) -> None:
        self._saved.setdefault(key, []).append((out_t, slot, site))
        self._n_saved += 1

    @property
    def _written(self) -> bool:
        """An activation can be written in E4M3 by its producer: delayed scaling with a history (the
        scale is known before) and the kept transposes (the backward never reads the bf16 tensor)."""
        return self.hist is not None and not self.hist.empty and self.saved is not None

    @property
    def e4m3_gelu(self) -> bool:
        """FC_E4M3 applies now."""
        return FC_E4M3 and self._written

    @property
    def attn_e4m3(self) -> bool:
        """ATTN_FWD_E4M3 applies now (the engine also checks that the forward is the bf16 "wg" one)."""
        return ATTN_FWD_E4M3 and self._written

    def ln_e4m3(self, out) -> bool:
        """LN_E4M3 applies now to a LayerNorm writing ``out`` (one of ``ln_ptrs``)."""
        return LN_E4M3 and self._written and out.data.ptr in self.ln_ptrs

    def produce(self, A, write, buf: str = "f8_a", folds: bool = False, transposes: bool = False) -> None:
        """A (R, C), the activation the next GEMM would cast, is written in E4M3 by its producer instead:
        ``write(nat, scale, rec)`` puts it into ``buf`` at the next site's scale (scale: a 1-float view of
        the slot) and its amax into rec (the site's f8_cur entry), or, ``folds``, into f8_part[0] for
        k_fp8_t_u8 to fold; the transpose is kept for the weight gradient when a backward follows
        (``transposes``: the producer writes it too, ``write(nat, out_t, scale, rec)``, out_t None when
        none is kept). The next ``_activation`` of A takes the copy instead of casting (same site, same
        factor)."""
        R, C = A.shape
        site = self._next_site()
        slot, key, rec = self.site_base + site, (A.data.ptr, A.shape), self.a["f8_cur"][site:site + 1]
        nat, am = self._buf(buf, R, C), self.a["f8_part"][:1]
        out_t = None
        if self.save_t:
            out_t, _ = self._save_slot(R, C)
            self._keep(key, out_t, slot, site)
        scale = self.inv[SLOT * slot + 1:SLOT * slot + 2]
        if transposes:
            write(nat, out_t, scale, rec)
        else:
            write(nat, scale, am if folds else rec)
            if out_t is not None or folds:
                k_fp8_t_u8(nat, out_t, R, C, am, rec if folds else None)
        self._ready[key] = (nat, slot)

    def grad_e4m3(self, switch: bool) -> bool:
        """A gradient's producer writes it in E4M3 now (``switch``: ATTN_E4M3 or LNB_E4M3): a history, the
        kept transposes, a backward and the memo (the bf16 gradient is never written, so nothing could
        cast it again)."""
        return switch and self._written and self.save_t and self.memo_enabled

    def produce_grad(self, G, write, after_shadow: bool, transposes: bool = False) -> None:
        """G (R, C), an output gradient whose next two GEMMs are dX = G W^T and the weight gradient
        X^T G, is written in E4M3 by its producer: ``write(nat, scale, rec)`` into f8_g at the site G's
        cast would take, with its amax; k_fp8_t_u8 writes G^T into f8_gt (``transposes``: the producer
        does, ``write(nat, tr, scale, rec)``), and both GEMMs take them as a cast's (the memo).
        ``after_shadow``: the weight gradient comes first (dqkv), and with X^T kept it takes X's shadow
        site before G's, so G's site is the one after the next."""
        R, C = G.shape
        key, site = (G.data.ptr, G.shape), self._planned(self._untaken(self.site + (1 if after_shadow else 0)))
        self._produced[key] = site
        self.site = self._untaken(self.site)           # G's GEMM takes no site of its own: skip it
        slot = self.site_base + site
        nat, tr = self._buf("f8_g", R, C), self._buf("f8_gt", C, R)
        scale, rec = self.inv[SLOT * slot + 1:SLOT * slot + 2], self.a["f8_cur"][site:site + 1]
        if transposes:
            write(nat, tr, scale, rec)
        else:
            write(nat, scale, rec)
            k_fp8_t_u8(nat, tr, R, C, self.a["f8_part"][:1], None)
        self._memo[key] = (nat, tr, slot, site)

    def _gelu_e4m3(self, H, x8, x_inv, y8, y_inv, M: int, N: int, K: int, aux) -> None:
        """FC_E4M3's fc forward: h_act H (M, N) = gelu(x W) straight into E4M3 (``f8_g``, free in the
        forward; ``f8_a`` holds x) at its site's scale (the slot's DSCALE_AT float, 16-byte aligned for
        cuBLASLt), h_pre bf16 into ``aux`` (HPRE_E4M3 with the GELU backward in the cast: E4M3 at
        HPRE_SCALE into aux's first M N bytes, for that cast alone); cuBLASLt's AMAX_D into f8_part[0],
        folded into the site."""
        hp = aux
        if HPRE_E4M3 and self.hpre_to_cast and self.defers_dgelu and aux is not None and aux.flags.c_contiguous:
            hp = aux.view(np.uint8).reshape(-1)[:M * N].reshape(M, N)
            self._h8[aux.data.ptr] = hp

        def gemm(nat, scale, am):
            self.lt.mm_nt(nat, x8, y8, x_inv, y_inv, M, N, K, CUDA_R_8F_E4M3, fast_accum=True,
                          epilogue=EPILOGUE_GELU_AUX, stream=self._stream(), aux=hp,
                          d_scale=scale.data.ptr + 4 * (DSCALE_AT - 1), amax_d=am.data.ptr,
                          **({"aux_scale": scale.data.ptr + 4 * (AUX_AT - 1)} if hp is not aux else {}))

        self.produce(H, gemm, buf="f8_g", folds=True)

    def _gradient(self, G, transposed: bool, prev: dict):
        """G or G^T in E4M3 for a gradient G (rows, cols): both orientations cast at once, the
        other one kept for the next call (with the memo off, cast again at the same site)."""
        key = (G.data.ptr, G.shape)
        hit = prev.get(key)
        claimed = self._produced.pop(key, None)
        if claimed is not None and (hit is None or claimed != self.site - 1):
            raise AndreaError(f"fp8: the gradient written in E4M3 by its producer took site {claimed}, but its GEMM "
                              f"comes at site {self.site - 1} (ATTN_E4M3 / LNB_E4M3 in andrea/cuda/fp8.py: produce_grad's order)")
        if hit is None or not self.memo_enabled:
            R, C = G.shape
            nat, tr = self._buf("f8_g", R, C), self._buf("f8_gt", C, R)
            hp = self._dgelu.pop(key, None)
            if hp is not None:                             # HPRE_E4M3: the GEMM wrote h_pre's E4M3 bytes
                hp = self._h8.pop(hp.data.ptr, hp)
            slot, site = self._cast(nat, tr, G, R, C, current_slot=2, site=None if hit is None else hit[3], hp=hp)
            hit = (nat, tr, slot, site)
        self._memo[key] = hit
        return (hit[1] if transposed else hit[0]), self._slot(hit[2])

    # ------------------------------------------------------------------ the tied head (FP8_HEAD)
    def head_dlogits(self, logits, V: int, targets, lse, dscale: float) -> None:
        """The loss backward of the E4M3 head: from the bf16 logits (N, Vp) (the padded rows), dlogits
        in E4M3 at the fixed scale 448 into ``f8_dlog`` (k_loss_bwd_e4m3, which also writes its factor
        dscale / 448) and its transpose (Vp, N) into the logits' own bytes, which nothing reads again
        this step. The head's next two ``mm`` calls (dgrad, then the weight gradient) take them."""
        if self.head is None:
            raise AndreaError("fp8: the E4M3 head needs the arena's w8_head, f8_dlog and f8_dwte (FP8_HEAD)")
        N, Vp = logits.shape
        d8 = self.a["f8_dlog"][:N * Vp].reshape(N, Vp)
        d8t = logits.view(np.uint8).reshape(-1)[:Vp * N].reshape(Vp, N)
        k_loss_bwd_e4m3(d8, self._inv(self.head[4]), logits[:, :V], targets, lse, dscale, N, V)
        k_fp8_t_u8(d8, d8t, N, Vp, self.a["f8_part"][:1], None)
        self._dlog = {(logits.data.ptr, logits.shape): (d8, d8t)}

    def _head_mm(self, C, A, B, ta: bool, tb: bool, beta: float) -> bool:
        """The tied head's GEMMs on E4M3, when this call is one of them (else False): the forward
        C (N, Vp) = A (N, C) wte_pad^T with A an activation; with A the dlogits of ``head_dlogits``, the
        dgrad C (N, C) = A wte_pad and then the weight gradient C (V, C) += (A^T B)[:V], its product
        (Vp, C) in ``f8_dwte`` (a dimension of 8449 is not an FP8 GEMM's) added into the first V rows."""
        if self.head is None:
            return False
        wp, h8, h8t, wslot, dslot = self.head
        Vp, Cm = wp.shape
        key = (A.data.ptr, A.shape)
        d = self._dlog.get(key)
        st = self._stream()
        if d is None:
            if B.data.ptr != wp.data.ptr or not tb or ta or not FP8_HEAD_FWD:
                return False
            x8, x_inv = self._activation(A, False)
            self.lt.mm_nt(C, x8, h8, x_inv, self._slot(wslot), A.shape[0], Vp, Cm, CUDA_R_16BF, fast_accum=True,
                          stream=st)
        elif not ta:
            if B.data.ptr != wp.data.ptr or tb:
                raise AndreaError("fp8 head: dlogits go to dx = dlogits wte_pad (tb=False), then dwte")
            self.lt.mm_nt(C, d[0], h8t, self._slot(dslot), self._slot(wslot), A.shape[0], Cm, Vp, CUDA_R_16BF,
                          fast_accum=FAST_ACCUM_BWD, stream=st)
        else:
            V = C.shape[0]
            if beta != 1.0 or tb or C.dtype != np.float32 or C.shape != (V, Cm) or V > Vp:
                raise AndreaError(f"fp8 head: the weight gradient accumulates (beta 1) into an fp32 (V <= {Vp}, {Cm}) "
                                  f"matrix, got beta {beta}, C {C.shape} {C.dtype}")
            del self._dlog[key]
            y8, y_inv = self._activation(B, True)
            prod = self.a["f8_dwte"]
            self.lt.mm_nt(prod, d[1], y8, self._slot(dslot), y_inv, Vp, Cm, A.shape[0], CUDA_R_32F,
                          fast_accum=FAST_ACCUM_BWD, stream=st)
            k_residual_add("fp32", C, C, prod[:V], V * Cm)
        return True

    def mm(self, C, A, B, ta: bool = False, tb: bool = False, beta: float = 0.0, lowtype: int = CUDA_R_16BF,
           epilogue: int = EPILOGUE_DEFAULT, aux=None) -> None:
        """Blas.mm's contract; ``epilogue``/``aux``: the fused GELU of X W and dY W^T (module docstring)."""
        prev, self._memo = self._memo, {}
        if int(epilogue) == EPILOGUE_DEFAULT and self._head_mm(C, A, B, ta, tb, beta):
            return
        w = self.weights.get(B.data.ptr)
        is_weight = w is not None and w[0].shape == B.shape        # X @ W (forward) or dY @ W^T (dX)
        if int(epilogue) != EPILOGUE_DEFAULT and not (is_weight and not ta):
            raise AndreaError(f"fp8 gemm: epilogue {int(epilogue)} only on X W or dY W^T with W a block weight "
                              f"(the MLP's fc forward and proj dgrad), not on C {C.shape} = A {A.shape} @ B {B.shape} "
                              f"(ta={ta}, tb={tb}); run that GEMM without it")
        if {A.data.ptr, B.data.ptr, C.data.ptr} & self.bf16_ptrs:     # the tied head stays bf16 (cuBLASLt)
            self.lt.mm(C, A, B, ta=ta, tb=tb, beta=beta, lowtype=lowtype, stream=self._stream())
            return
        for nm, x in (("A", A), ("B", B), ("C", C)):
            need("fp8 gemm", nm, x)
        M, K = (A.shape[1], A.shape[0]) if ta else A.shape
        N = B.shape[0] if tb else B.shape[1]
        if is_weight:
            _, W8, W8t, slot = w
            y8, y_inv = (W8 if tb else W8t), self._slot(slot)
            if tb:                                            # dX = dY W^T: A is a gradient
                x8, x_inv = self._gradient(A, ta, prev)
            else:
                x8, x_inv = self._activation(A, ta)
            fast = FAST_ACCUM_BWD or not tb
        elif ta:                                              # dW = X^T dY
            x8, x_inv = self._activation(A, True)
            y8, y_inv = self._gradient(B, not tb, prev)
            fast = FAST_ACCUM_BWD
        else:
            raise AndreaError(f"fp8 gemm: no fp8 form for C {C.shape} = A {A.shape} @ B {B.shape} "
                              f"(ta={ta}, tb={tb}); the engine's GEMMs are X W, dY W^T and X^T dY")
        d_type = CUDA_R_32F if C.dtype == np.float32 else CUDA_R_16BF
        if beta and d_type != CUDA_R_32F:
            raise AndreaError("fp8 gemm: beta=1 needs an fp32 C")
        if self._dgelu:
            raise AndreaError("fp8: a deferred GELU-backward cast (defer_dgelu) was not taken by the next GEMM")
        if aux is not None and aux.data.ptr in self._h8 and int(epilogue) != EPILOGUE_GELU_AUX:
            raise AndreaError("fp8: h_pre holds E4M3 bytes (HPRE_E4M3) that only the GELU-backward cast reads; "
                              "set fp8.HPRE_E4M3 = False to run the DGELU epilogue")
        if int(epilogue) == EPILOGUE_GELU_AUX and d_type == CUDA_R_16BF and self.e4m3_gelu:
            self._gelu_e4m3(C, x8, x_inv, y8, y_inv, M, N, K, aux)
            return
        self.lt.mm_nt(C, x8, y8, x_inv, y_inv, M, N, K, d_type, beta=beta, fast_accum=fast,
                      epilogue=epilogue, stream=self._stream(), aux=aux)
