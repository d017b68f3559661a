"""The GPU training engine: the model of ``andrea/engine/recipe.py`` in fp32 | bf16 | fp16 with
fp32 master weights, m and v, one preallocated arena, and a CUDA graph of forward + backward.

    from andrea.cuda.backend import make_backend
    eng = make_backend().make_engine(mc, batch_size=8, precision="bf16")   # a GpuEngine
    eng.init_weights(1337); res = eng.train_step([(x, y)], lr=3e-4, t=1, hp=Hyper())

Same public surface as ``andrea.engine.engine.Engine`` (n_params, layout, w, m, v, init_weights,
load_state, extra_state, forward, train_step, describe, planned_bytes, allocated_bytes), so
checkpoints (fp32 w, m, v in the flat layout) are interchangeable with the NumPy engine's. The
step is the NumPy engine's loop (``Engine.train_step``) over this engine's micro_step/apply_update.

What this engine chooses (``FastOps`` and ``GpuEngine.policy``), the model being the recipe's:
- dtypes: activations in the compute dtype (uint16 payloads for bf16/fp16), the residual stream,
  its gradient, LayerNorm statistics and the loss in fp32; the matmuls read a 16-bit copy of the
  weights (``WC``) refreshed by the AdamW kernel;
- what it saves: the attention's row log-sum-exp (B, H, T), the loss's row log-sum-exp (N,);
- what it recomputes: fp32 the GELU activations (``RECOMPUTE``), one buffer for all layers;
  bf16/fp16 nothing (``RECOMPUTE_FUSED``: the fc GEMM writes h_pre and h_act in one pass); fp8
  as its fc forward is fused or not (``FUSE_GELU_FP8``, the fc forward by default: RECOMPUTE_FUSED);
- the MLP's GELU (bf16/fp16, ``FUSE_GELU``): in cuBLASLt's epilogues, the fc GEMM writing
  h_act = gelu(acc) and h_pre (GELU_AUX), the proj dgrad writing dL/dh_pre = acc * gelu'(h_pre)
  (DGELU); fp8 the same on its E4M3 GEMMs where ``FUSE_GELU_FP8`` says (bf16 h_act, cast to E4M3
  for the proj GEMMs at its sites as before), else, and fp32 (cuBLAS), the separate k_gelu_fwd /
  k_gelu_bwd passes;
- GEMMs (bf16/fp16): cuBLASLt, one heuristic algorithm per shape kept from its first call, its
  32 MiB workspace in the arena; the logits rows padded to ``LOGITS_PAD`` elements and the head's
  forward and dgrad GEMMs run over those padded columns against a zero-padded copy of wte
  (fp8 too: its head is a bf16 GEMM, on its own cuBLASLt handle in ``Fp8Gemm``);
- attention (``train.attention``): cuDNN's fused SDPA and its deterministic backward at head size 64 on
  Hopper where its frontend is installed (``cudnn_attention.py``, its workspace in the logits' or the
  spent h_pre's bytes), else attention.cu's kernels;
- clipping, the NaN/inf skip and AdamW on the device; the fp16 dynamic loss scale on the host,
  saved and restored with ``extra_state``; the step's last loss read back with the optimizer's state
  (``READ_LOSS_LAST``);
- the arena's placement: the buffers no block backward reads right behind h_pre (``AFTER_H_PRE``, the
  attention backward's scratch), dL/dh over the logits' first bytes (``DH_IN_LOGITS``), and with one
  microbatch a step (``grad_accum=1``) layers 1.. of some saved activations in the gradient rows of the
  layer below, which that layer's backward writes only after them (``ACTS_IN_GRADS``).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from andrea import dist
from andrea.cuda.kernels import (ADAMW_CHUNK, LN_ROWS_PER_CHUNK, LOWTYPE, NORM_BLOCKS, adam_hyper, adamw4_ok,
                                 attn_ds_bytes, attn_impl, cp, embed_segments, hopper, k_adamw, k_attn_bwd, k_attn_fwd,
                                 k_cast, k_embed_bwd, k_embed_fwd, k_gate_finite,
                                 k_gelu_bwd, k_gelu_fwd, k_grad_norm, k_grad_norm_final, k_grad_norm_partial,
                                 k_layernorm_bwd, k_layernorm_fwd, k_layernorm_fwd_e4m3, k_loss_bwd, k_loss_fwd,
                                 k_loss_mean, k_residual_add, k_residual_layernorm_fwd, ln_bwd_vr, ln_e4m3_fits,
                                 MmDgelu)
from andrea.cuda.cublaslt import EPILOGUE_DEFAULT, EPILOGUE_DGELU, EPILOGUE_GELU_AUX, Lt
from andrea.cuda.cudnn_attention import CudnnAttention
from andrea.cuda.cudnn_attention import resolve as resolve_attention
from andrea.cuda import fp8 as fp8_mod
from andrea.cuda.fp8 import (LT_WORKSPACE, SCALINGS, Fp8Gemm, fp8_buffers, n_sites_for, n_slots, require_fp8,
                             weight_plan)
from andrea.engine import recipe
from andrea.engine.engine import Engine, Hyper, StepResult, init_params
from andrea.engine.model import (Buffer, ModelConfig, PlanPolicy, activation_plan, contiguous_span, param_layout,
                                 recompute_set)
from andrea.errors import AndreaError
from andrea.preflight import check_memory

FP16_SCALE0, FP16_GROWTH_EVERY, FP16_SCALE_MAX = 2.0 ** 12, 1000, 2.0 ** 24
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
LT_PRECISIONS = ("bf16", "fp16")    # their GEMMs go to cuBLASLt (fp32 keeps cuBLAS, fp8 its E4M3 path)
PAD_PRECISIONS = ("bf16", "fp16", "fp8")   # the padded vocabulary head (fp8's on E4M3 with fp8.FP8_HEAD)
LOGITS_PAD = 64                     # their logits rows: V rounded up to 64 elements (128-byte aligned rows)
# Saved activations the backward recomputes (PlanPolicy.recompute): the GELU output h_act (N, 4C per
# layer: the largest saved tensor). The LayerNorm outputs are kept per layer (2 N C 16-bit values a
# layer: +1.2 GB at 120M B=32, inside the peak-memory budget of issue 19); bench/engine_gpu.py
# --recompute times the other choices in the same run.
RECOMPUTE = frozenset({"gelu"})
# bf16/fp16 with FUSE_GELU: the fc GEMM's GELU_AUX epilogue writes h_act beside h_pre at no extra pass,
# so h_act is kept per layer (+(L-1) N 4C 16-bit values: 120M B=32 +2.1 GiB, 13329 MiB, still under torch's
# 13770) and the backward does not re-run gelu: H200 120M B=32 53.96 ms/step kept vs 55.69 recomputed
# (main's separate passes 57.62), 480M B=8 54.07 vs 54.80 (55.92); docs/bench/gelu_epilogue_h200.md.
RECOMPUTE_FUSED = frozenset()
# bf16/fp16 (fp8: FUSE_GELU_FP8): GELU and its derivative in the fc forward / proj dgrad GEMM epilogues.
# False: the separate k_gelu_fwd / k_gelu_bwd passes (then RECOMPUTE applies to every precision).
FUSE_GELU = True
# fp8 (with FUSE_GELU): which of its MLP GEMMs carry the epilogue, on the FP8 matmul: "fwd" the fc
# forward (GELU_AUX; h_act then kept per layer, RECOMPUTE_FUSED: +(L-1) N 4C bf16 values, 120M B=32
# +2.1 GiB), "bwd" the proj dgrad (DGELU). H200, one run (`bench/engine_gpu.py --precision bf16 fp8:delayed
# --fp8-gelu fwd,bwd fwd`, docs/bench/fp8_gelu_h200.json), fp8 ms/step separate / fwd / fwd+bwd:
# 120M B=32 54.03 / 53.35 / 58.48, 480M B=8 49.10 / 48.27 / 51.50 (bf16 53.90, 54.12): the fused forward
# pays, FP8 DGELU is slower than the FP8 GEMM + k_gelu_bwd (which now runs inside the cast of dL/dh,
# fp8.DGELU_CAST). With fp8.SAVE_TRANSPOSES h_act is one buffer for all layers whatever this says
# (gpu_policy's ``shared``): the backward reads its kept E4M3 transpose.
FUSE_GELU_FP8 = frozenset({"fwd"})
# bf16 on a compute capability 9.0 device: the proj dgrad with gelu' through our own Hopper GEMM
# (mm_dgelu.cu, kernels.MmDgelu, variant OWN_DGELU_DEFINES) in place of cuBLASLt's DGELU epilogue, which only
# its xmma kernels carry (75-81 us a layer slower than its plain GEMM on the H200, docs/bench/s28_h200.md).
# False until a variant beats that call at the step's shapes (bench/dgelu_gemm.py); True adds one (L, 512)
# byte arena entry for its TMA maps, and a problem the variant does not fit stays with cuBLASLt.
OWN_DGELU = False
OWN_DGELU_DEFINES: tuple[str, ...] = ()
# One GPU, not fp8: the optimizer step runs on a stream of its own, in the order the next forward reads the
# parameters (wte and wpe, then each block's matmul weights and LayerNorms, then lnf), with an event after
# each piece; the next forward waits for each piece just before its first read of it (FastOps._await_update,
# an external event wait node inside the CUDA graph), so the memory-bound AdamW (480M: 3.8 ms of a 47.8 ms
# step) runs beside the compute-bound forward instead of before it. Every element gets the same arithmetic
# as the single launch: the same bytes. Anything else that touches the parameters or g first waits for the
# whole step (zero_grads on the device, state_host / load_state / grads_host on the host). On the H200 it took
# 0.30 ms off 480M B=8 (47.55 -> 47.25), 0.10 ms off 480M B=16 and 0.40 ms off 120M B=32 (bench/engine_ab.py,
# docs/bench/s33_h200.md).
OVERLAP_UPDATE = True
# OVERLAP_UPDATE's pieces of one block, in the forward's order: each (the tensor whose first read in the forward
# waits for the piece, the piece's tensors as runs that lie one after the other in the flat layout). One piece a
# block, waited for at ln1 (committed). Finer pieces let the block's first kernels start while the rest of its
# update runs: HALVES (attention's weights with ln1, the MLP's with ln2) and QUARTERS (one a matrix, waited for at
# its GEMM) in tests/test_cuda_overlap_plan.py, A/B'd as engine_ab flips (docs/bench/s46.md). Only where the
# forward waits changes: the same bytes. OVERLAP_NORM needs each piece opened by a LayerNorm.
UPDATE_BLOCK_PIECES = (("ln1.g", (recipe.MATMUL_WEIGHTS, ("ln1.g", "ln1.b", "ln2.g", "ln2.b"))),)
# One GPU, not fp8: the gradient norm's partial sums are taken piece by piece (update_pieces' pieces: lnf,
# then each block's matmul weights and LayerNorms) on a stream of their own as soon as the backward has
# finished the piece (lnf's after its LayerNorm backward, a block's after its ln1 backward), beside the rest
# of the backward, which joins that stream before it ends; only wte and wpe's partials (final after the
# embedding backward) run after it. So the norm's pass over g (480M: 0.43 ms a step, on the critical path
# between the backward and the next forward; docs/bench/s34_h200.md) mostly leaves it. Each range of the
# flat layout sums into its own NORM_CHUNK-sized slots (norm_slots), k_grad_norm_final adds every slot in
# flat order: deterministic, but another summation order than the single pass, so the bytes differ from
# False in the last bits of the norm. Off: bench/engine_ab.py on an H100 (session 38) timed it 0.32-0.45 ms
# slower at 480M B=8/16 and 120M B=32, every round, alone and beside STREAM_PRIORITY (not yet profiled: the
# partial sums beside the backward cost it more than the single pass they take off the critical path).
OVERLAP_NORM = False
NORM_CHUNK = 1 << 16      # OVERLAP_NORM: gradient elements a partial-sum block covers (NORM_BLOCKS at most a range)
# One GPU: the engine's stream, which the CUDA graphs' forward + backward are launched into (so their kernels
# take its priority), at the greatest priority the device has; OVERLAP_UPDATE's and OVERLAP_NORM's side streams
# keep the default, the least. When an SM frees up, the block scheduler then hands it to a waiting GEMM or
# attention block before an AdamW or partial-sum block, and those fill the gaps instead of holding SMs the
# forward needs: OVERLAP_UPDATE took only 0.30 ms of AdamW's 3.6 ms off 480M B=8 (docs/bench/s33_h200.md),
# so most of the update still delays the forward. Priorities order the scheduling only: the same bytes. CUDA
# clamps a priority to the device's range (cudaDeviceGetStreamPriorityRange), so PRIORITY_HIGH is the greatest
# on any device; describe() prints the priority the stream got. bench/engine_ab.py on an H100 (session 38,
# docs/bench/s38_h100.md): -0.52 ms at 480M B=16, -0.46 at 480M B=8, -0.23 at 120M B=32, every round.
STREAM_PRIORITY = True
PRIORITY_HIGH = -5
# A step's first microbatch: the four block weight-gradient GEMMs write their gradients (beta 0: no read of
# C, no zeroed rows to add onto) and zero_grads clears only the rest of g (wte, wpe, the LayerNorms), as
# torch's zero_grad(set_to_none=True) leaves the first backward to write. The later microbatches add (beta
# 1). The same bytes as False (a product plus +0 is the product); one CUDA graph for each beta. One GPU only.
WGRAD_WRITES = True
# The buffers no block's backward reads (the head's backward is done with the logits, lnf and the loss
# gradient; dh is the MLP backward's scratch, lt_ws cuBLASLt's, branch the forward's), laid out in the arena
# right after h_pre, in this order: with the h_pre of a layer and of the layers above they make one run of
# free bytes in that layer's attention backward, which cuDNN's workspace takes (spare_run). At
# 480M B=8 every layer then runs its backward in one call (the top four took 4, 4, 2, 2). Empty:
# the plan's order, where only the logits and the h_pre run are offered.
AFTER_H_PRE = ("logits", "dh", "lt_ws", "branch", "lnf")
# bf16/fp16 (and fp8 with a bf16 head): the head's weight-gradient GEMM runs over the padded vocabulary,
# dwte (Vp, C) += dlogits (N, Vp)^T lnf, its rows past V being the first Vp - V rows of wpe's gradient,
# which follows wte's in the flat layout: the pad columns of dlogits are zero (the forward's x . 0, never
# rewritten by the loss backward), so those rows get + 0. At V = 8449 cuBLASLt's choice for the odd M was
# an sm80 CUTLASS kernel (H200 480M B=8: 0.54 ms for 213 GFLOP, docs/bench/s23_kernels_h200.json).
PAD_HEAD_WGRAD = True
# The MLP backward's scratch dL/dh (N, 4C) in the first bytes of the logits (N, Vp), where it fits (4C <= Vp:
# every variant) and no one else writes the logits in the backward (not fp8, whose E4M3 head writes its
# dlogits and their transpose there): the head's backward is done with them before the first block's MLP
# backward, and the next forward rewrites them. -N 4C 16-bit values (12M B=8: -24 MiB, 120M B=32: -192 MiB,
# 480M B=8: -96 MiB). The attention backward's run behind h_pre loses dh's separate bytes: at 480M B=8 the
# top layer's cuDNN backward takes 2 calls again.
DH_IN_LOGITS = True
# GpuEngine.train_step (one GPU, not fp8): the last microbatch's loss is read back with the optimizer's state
# once the update is queued, not before it: the device no longer idles while the host reads the loss,
# returns it and queues the update (H200, kernel_profile --gaps: 0.35 + 0.16 ms a step of idle device between
# the graph and the grad-norm kernel, at 480M B=8 and 120M B=32 alike). False: Engine.train_step's loop.
READ_LOSS_LAST = True
# A step of one microbatch (GpuEngine's grad_accum=1: train.grad_accum 1) in bf16/fp16 on one GPU: layer l's
# saved activations of these names (first fit, in this order) lie in the fp32 gradient rows of layer l-1's
# matmul weights. Only layer l-1's backward writes those rows (beta 0, WGRAD_WRITES), after layer l's backward
# has read them; zero_grads leaves them alone and no forward writes a gradient. Layer 0 keeps its own bytes,
# and so does every layer of a step of more microbatches (the next one's forward would overwrite the
# gradients summed so far): such an engine refuses a second microbatch. The arena keeps the fp32 gradients
# for the whole step where torch allocates them in its backward: this gives those bytes back. Planned,
# 480M: B=8 h_act of 15 layers (-1.5 GB), B=16 atty and ln2 (-1.5 GB); H200 peak against torch.compile's:
# 0.97-0.99 at B=8, 0.99 at B=16, was 1.07-1.10 (docs/bench/s25_h200.md). Empty: every layer in its own bytes.
ACTS_IN_GRADS = ("h_act", "qkv", "atty", "ln2", "ln1", "att", "ln1_mean", "ln1_rstd", "ln2_mean", "ln2_rstd")
# One GPU with WGRAD_WRITES: a step's update also clears g outside the block weights' rows once AdamW has read
# it, so the next step's zero_grads has nothing to queue and the device does not idle between steps while the
# host launches those fills (H200, alternating in one process: 480M B=8 47.81 against 48.20 ms a step, 12M B=8
# 3.304 against 3.322; docs/bench/s25_h200.md). The same bytes: that part of g is zero when the next forward
# starts either way.
CLEAR_AFTER_UPDATE = True


def spare_run(span, l: int, n_layer: int) -> tuple[int, int]:
    """[start, end) of the bytes free in layer l's attention backward that start at its h_pre: the h_pre
    of that layer and of the layers above (their MLP backwards ran), then each AFTER_H_PRE buffer that the
    arena placed right behind the run (256-byte aligned entries). ``span(name)``: (first byte, bytes) of
    an arena entry, or None: the pointers of GpuEngine's arrays or the offsets of ``arena_layout``."""
    h0, hn = span("h_pre")
    start, end = h0 + l * (hn // n_layer), h0 + hn
    for name in AFTER_H_PRE:
        s = span(name)
        if s is None or s[0] + s[1] <= end:             # not in this arena (fp32: no lt_ws), or inside the
            continue                                    # run already (dh in the logits: DH_IN_LOGITS)
        if s[0] != -(-end // 256) * 256:
            break
        end = s[0] + s[1]
    return start, end


def fused_gelu(precision: str) -> tuple[bool, bool]:
    """(fc forward, proj dgrad) of this precision carry the GELU epilogue (FUSE_GELU, FUSE_GELU_FP8)."""
    if not FUSE_GELU:
        return False, False
    if precision == "fp8":
        return "fwd" in FUSE_GELU_FP8, "bwd" in FUSE_GELU_FP8
    return (True, True) if precision in LT_PRECISIONS else (False, False)


def recompute_for(precision: str, choice: str = "auto") -> frozenset:
    """The saved activations the backward of this precision recomputes (PlanPolicy.recompute):
    with a fused fc forward h_act comes out of the GEMM beside h_pre and is kept. ``choice``:
    train.recompute ("gelu" recomputes h_act whatever the precision; andrea.engine.model)."""
    return recompute_set(choice, RECOMPUTE_FUSED if fused_gelu(precision)[0] else RECOMPUTE)


class FastOps:
    """The recipe's op set in one precision over this engine's arena: the ops_numpy names and
    arguments (``work`` unused: the scratch is the engine's ``ln_part``, ``dvec``, ``dh``); the
    shapes come from the arrays. Backward outputs follow the op contract (+= into parameter
    gradients and dres, = elsewhere), but for ``wgrad_beta`` 0: then the four block weight-gradient
    GEMMs write their gradient (=), as GpuEngine asks for a step's first microbatch (WGRAD_WRITES)."""

    def __init__(self, prec: str, blas, a: dict, f8=None, lt=None, dnn=None):
        self.p, self.lowtype, self.blas, self.a = prec, LOWTYPE[prec], blas, a
        self.dnn = dnn              # a CudnnAttention: both attention passes through cuDNN (train.attention)
        self.deferred = None        # a list: embed_backward appends its launch there instead of running it
        self.wgrad_beta = 1.0       # the block weight-gradient GEMMs' beta: 1 adds (the op contract), 0 writes
        # the attention backward's scratch besides the logits: a layer's qkv -> the run of bytes free in that
        # layer's attention backward from its h_pre on (_spare_run)
        self._runs = {q.data.ptr: self._spare_run(l) for l, q in enumerate(a.get("qkv", ())[:len(a.get("h_pre", ()))])}
        # cuDNN's backward workspace (dnn): the larger of the logits' bytes and that run
        self._dnn_scratch = {} if dnn is None else {
            p: max((a["logits"], run), key=lambda x: x.nbytes) for p, run in self._runs.items()}
        self.f8 = f8                                            # fp8: the E4M3 GEMM path (andrea/cuda/fp8.py)
        self.lt = lt                                            # bf16/fp16: cuBLASLt (andrea/cuda/cublaslt.py)
        self.dgelu = None                                       # OWN_DGELU: a kernels.MmDgelu (GpuEngine sets it)
        # OVERLAP_UPDATE (GpuEngine sets it): a parameter's pointer -> the event its optimizer step records
        self.update_waits = None
        # OVERLAP_NORM (GpuEngine sets it): a LayerNorm weight gradient's pointer -> what to queue once its
        # backward is queued (the partial norm sums of the piece it completes)
        self.norm_hooks = None
        # GELU in the epilogue of the fc forward (fused) and of the proj dgrad (fused_bwd)
        self.fused, self.fused_bwd = fused_gelu("fp8" if f8 is not None else prec if lt is not None else "fp32")
        if f8 is not None:                                      # fp8.HPRE_E4M3: only without the DGELU epilogue
            f8.hpre_to_cast = not self.fused_bwd

    def _spare_run(self, l: int):
        """spare_run's bytes of layer l over this arena, as a uint8 array."""
        a = self.a
        start, end = spare_run(lambda n: (a[n].data.ptr, a[n].nbytes) if n in a else None, l, len(a["h_pre"]))
        return cp().ndarray((end - start,), dtype=cp().uint8, memptr=a["h_pre"][l].data)

    def _mm(self, C, A, B, ta=False, tb=False, beta=0.0, tag="gemm", epilogue=EPILOGUE_DEFAULT, aux=None):
        """One GEMM (Blas.mm's contract); ``tag`` names it for bench/engine_gpu.py --breakdown (a
        fused epilogue's GEMM says so: "fc fwd+gelu"). ``epilogue``/``aux``: cuBLASLt and fp8 only."""
        if epilogue == EPILOGUE_DGELU and self.dgelu is not None and self.dgelu.takes(C, A, B, aux, ta, tb, beta):
            self.dgelu(C, A, B, aux)                            # OWN_DGELU: the same contract, our Hopper GEMM
        elif self.f8 is not None:
            self.f8.mm(C, A, B, ta=ta, tb=tb, beta=beta, lowtype=self.lowtype, epilogue=epilogue, aux=aux)
        elif self.lt is not None:
            self.lt.mm(C, A, B, ta=ta, tb=tb, beta=beta, lowtype=self.lowtype, stream=cp().cuda.get_current_stream().ptr,
                       epilogue=epilogue, aux=aux)
        else:
            self.blas.mm(C, A, B, ta=ta, tb=tb, beta=beta, lowtype=self.lowtype)

    def _await_update(self, param) -> None:
        """OVERLAP_UPDATE: the current stream waits for the optimizer step of the piece ``param`` opens (in a
        capture, as an external event wait node: the event is recorded outside the graph, every step)."""
        ev = self.update_waits.get(param.data.ptr) if self.update_waits else None
        if ev is not None:
            rt = cp().cuda.runtime
            s = cp().cuda.get_current_stream().ptr
            rt.streamWaitEvent(s, ev.ptr, 1 if rt.streamIsCapturing(s) else 0)   # 1: cudaEventWaitExternal

    def embed_forward(self, out, idx, wte, wpe):
        self._await_update(wte)
        B, T = idx.shape
        V, C = wte.shape
        k_embed_fwd(out, idx, wte, wpe, B * T, T, C, V)

    def embed_backward(self, dwte, dwpe, dout, idx):
        """Reads the token segments GpuEngine._load_segments uploads; with ``deferred`` a list the
        launch is appended there (the engine runs it once the segments are on their way)."""
        a = self.a
        B, T, C = dout.shape

        def run():
            k_embed_bwd(dwte, dwpe, dout, (a["seg_order"], a["seg_start"], a["seg_tok"], a["seg_n"]), B, T, C)

        if self.deferred is None:
            run()
        else:
            self.deferred.append(run)

    def _e4m3(self, out, N, C, *arrays) -> bool:
        """fp8: this LayerNorm output goes to an E4M3 GEMM and is written in E4M3 (fp8.LN_E4M3)."""
        return self.f8 is not None and self.f8.ln_e4m3(out) and ln_e4m3_fits(N, C, *arrays)

    def layernorm_forward(self, out, mean, rstd, x, g, b):
        self._await_update(g)
        N, C = x.shape
        if self._e4m3(out, N, C, x, g, b):
            self.f8.produce(out, lambda y8, sc, rec: k_layernorm_fwd_e4m3(y8, mean, rstd, x, g, b, N, C, sc, rec))
            return
        k_layernorm_fwd(self.p, out, mean, rstd, x, g, b, N, C)

    def _piece_done(self, dg) -> None:
        """OVERLAP_NORM: the backward has queued the last write of the piece whose LayerNorm gradient is dg."""
        hook = self.norm_hooks.get(dg.data.ptr) if self.norm_hooks else None
        if hook is not None:
            hook()

    def layernorm_backward(self, dx, dg, db, dout, x, mean, rstd, g, work):
        N, C = x.shape
        k_layernorm_bwd(self.p, dx, dg, db, dout, x, mean, rstd, g, self.a["ln_part"], N, C)
        self._piece_done(dg)

    def layernorm_residual_backward(self, dx, dbranch, dg, db, dout, x, mean, rstd, g, work):
        """One kernel: the LayerNorm backward also writes the branch gradient's 16-bit cast."""
        N, C = x.shape
        low = None if dbranch.data.ptr == dx.data.ptr else dbranch      # fp32: the branch grad IS dres
        if low is not None and self.f8 is not None and self.f8.grad_e4m3(fp8_mod.LNB_E4M3) and ln_bwd_vr(C):
            self.f8.produce_grad(dbranch, lambda d8, sc, rec: k_layernorm_bwd(
                self.p, dx, dg, db, dout, x, mean, rstd, g, self.a["ln_part"], N, C, e4m3=(d8, sc, rec)),
                after_shadow=False)
            return
        k_layernorm_bwd(self.p, dx, dg, db, dout, x, mean, rstd, g, self.a["ln_part"], N, C, dlow=low)
        self._piece_done(dg)

    def residual_layernorm_forward(self, xo, out, mean, rstd, a, b, g, beta):
        self._await_update(g)
        N, C = xo.shape
        if self._e4m3(out, N, C, a, b, xo, g, beta):
            self.f8.produce(out, lambda y8, sc, rec: k_layernorm_fwd_e4m3(y8, mean, rstd, xo, g, beta, N, C, sc, rec,
                                                                          a=a, br=b))
            return
        k_residual_layernorm_fwd(self.p, xo, out, mean, rstd, a, b, g, beta, N, C)

    def attn_qkv_forward(self, qkv, x, w_qkv):
        self._await_update(w_qkv)
        self._mm(qkv, x, w_qkv, tag="qkv fwd")

    def attn_qkv_backward(self, dx, dw_qkv, dqkv, x, w_qkv, work):
        self._mm(dw_qkv, x, dqkv, ta=True, beta=self.wgrad_beta, tag="qkv wgrad")
        self._mm(dx, dqkv, w_qkv, tb=True, tag="qkv dgrad")

    def attn_forward(self, out, att, qkv, mask, n_head, work):
        """fp8 (ATTN_FWD_E4M3, the bf16 "wg" kernel): y also straight into E4M3, both orientations, for the
        attention-out GEMM and its weight gradient (``Fp8Gemm.produce``)."""
        B, T, C = out.shape
        if self.dnn is not None:                        # its workspace in the logits' bytes, dead until the head
            self.dnn.forward(out, att, qkv, self.a["logits"])
            return
        if self.f8 is not None and self.p == "bf16" and self.f8.attn_e4m3 \
                and attn_impl(self.p, C // n_head, 3 * C, "fwd") == "wg":
            self.f8.produce(out.reshape(B * T, C), lambda y8, y8t, sc, rec: k_attn_fwd(
                self.p, out, att, qkv, B, T, C, n_head, e4m3=(y8, y8t, sc, rec)), transposes=True)
            return
        k_attn_fwd(self.p, out, att, qkv, B, T, C, n_head)

    def attn_backward(self, dqkv, dout, qkv, att, y, n_head, work):
        """The "wgds" backward keeps its dS tiles in the logits' bytes (the head's backward is done
        with them before the blocks' backward starts, and the next forward rewrites them) and, for
        the heads they cannot hold, in the run of free bytes from the layer's h_pre on (``_spare_run``;
        where the arena put the logits inside that run, the run alone): at 480M B=8 the logits alone
        hold 125 of the 192 heads, and a second launch pair cost 0.04 ms a layer (H200). Logits too
        small for one head's tiles (a tiny vocabulary at a long context) run "wg" instead."""
        B, T, C = dout.shape
        if self.dnn is not None:                        # fp8: dqkv in bf16, cast by its GEMMs (no E4M3 producer)
            self.dnn.backward(dqkv, dout, y, att, qkv, self._dnn_scratch.get(qkv.data.ptr, self.a["logits"]))
            return
        lg, impl = self.a["logits"], attn_impl(self.p, C // n_head, 3 * C, "bwd")
        if impl == "wgds" and lg.nbytes < attn_ds_bytes(T):
            impl = "wg"
        ds = None
        if impl == "wgds":
            ds = cp().ndarray((lg.nbytes,), dtype=cp().uint8, memptr=lg.data)
            run = self._runs.get(qkv.data.ptr)
            if lg.nbytes < attn_ds_bytes(T, B * n_head) and run is not None:
                inside = run.data.ptr <= lg.data.ptr < run.data.ptr + run.nbytes
                ds = run if inside else (ds, run)
        if impl == "wgds" and self.f8 is not None and self.f8.grad_e4m3(fp8_mod.ATTN_E4M3):
            t = fp8_mod.ATTN_BWD_T                          # the kernels write dqkv^T too

            def write(d8, *rest):
                d8t, sc, rec = rest if t else (None, *rest)
                k_attn_bwd(self.p, dqkv, dout, y, att, self.a["dvec"], qkv, B, T, C, n_head, accumulate=False,
                           ds=ds, impl=impl, e4m3=(d8, sc, rec, d8t))

            self.f8.produce_grad(dqkv.reshape(B * T, 3 * C), write, after_shadow=True, transposes=t)
            return
        k_attn_bwd(self.p, dqkv, dout, y, att, self.a["dvec"], qkv, B, T, C, n_head, accumulate=False, ds=ds,
                   impl=impl)

    def attn_out_forward(self, out, y, w_o):
        self._await_update(w_o)
        self._mm(out, y, w_o, tag="attn-out fwd")

    def attn_out_backward(self, dy, dw_o, dout, y, w_o, work):
        self._mm(dy, dout, w_o, tb=True, tag="attn-out dgrad")
        self._mm(dw_o, y, dout, ta=True, beta=self.wgrad_beta, tag="attn-out wgrad")

    def gelu_forward(self, out, x):
        k_gelu_fwd(self.p, out, x, x.size)

    def mlp_forward(self, out, h_pre, h_act, x, w_fc, w_proj):
        """Fused (bf16/fp16/fp8): one GEMM writes h_act = gelu(x w_fc) and h_pre = x w_fc, both rounded
        from the fp32 accumulator (h_act is gelu of the unrounded product, not of h_pre)."""
        self._await_update(w_fc)
        if self.fused:
            self._mm(h_act, x, w_fc, epilogue=EPILOGUE_GELU_AUX, aux=h_pre, tag="fc fwd+gelu")
        else:
            self._mm(h_pre, x, w_fc, tag="fc fwd")
            k_gelu_fwd(self.p, h_act, h_pre, h_pre.size)
        self._await_update(w_proj)
        self._mm(out, h_act, w_proj, tag="proj fwd")

    def mlp_backward(self, dx, dw_fc, dw_proj, dout, x, h_pre, h_act, w_fc, w_proj, work):
        """Fused (bf16/fp16/fp8): dh = dL/dh_pre = (dout w_proj^T) * gelu'(h_pre) out of one GEMM."""
        dh = self.a["dh"]
        if self.fused_bwd:
            self._mm(dh, dout, w_proj, tb=True, epilogue=EPILOGUE_DGELU, aux=h_pre, tag="proj dgrad+dgelu")
        else:
            self._mm(dh, dout, w_proj, tb=True, tag="proj dgrad")   # dL/dh_act
        self._mm(dw_proj, h_act, dout, ta=True, beta=self.wgrad_beta, tag="proj wgrad")
        if not self.fused_bwd:
            if self.f8 is not None and self.f8.defers_dgelu:
                self.f8.defer_dgelu(dh, h_pre)                      # fp8: gelu' inside the next GEMM's cast of dh
            else:
                k_gelu_bwd(self.p, dh, dh, h_pre, h_pre.size)       # dL/dh_pre, in place
        self._mm(dw_fc, x, dh, ta=True, beta=self.wgrad_beta, tag="fc wgrad")
        self._mm(dx, dh, w_fc, tb=True, tag="fc dgrad")

    def residual_add_forward(self, out, a, b):
        k_residual_add(self.p, out, a, b, out.size)

    def residual_add_backward(self, db, dout):
        if db.data.ptr != dout.data.ptr:                        # fp32: the branch gradient IS dres
            k_cast(self.p, db, dout, dout.size)

    def _padded_head(self, logits, wte):
        """(the logits' whole padded rows (N, Vp), the zero-row-padded head weight (Vp, C)) when
        the arena has them (bf16/fp16/fp8: ``wte_pad``, refreshed by GpuEngine._weights_changed) and logits
        are its padded rows, else None. The head GEMMs then run on Vp = 64k columns: with V odd
        they ran at ~100 TFLOP/s on the H200 (bench/engine_gpu.py --breakdown). The pad columns
        of the logits are x . 0 = 0 and, being zero, add nothing to dx = dlogits wte."""
        wp = self.a.get("wte_pad")
        N, V = logits.shape
        if wp is None or wte.data.ptr != self.a["wlow"].data.ptr or wte.shape != (V, wp.shape[1]) \
                or logits.strides[0] != wp.shape[0] * logits.itemsize:
            return None
        full = cp().ndarray((N, wp.shape[0]), dtype=logits.dtype, memptr=logits.data)
        return full, wp

    def loss_forward(self, losses, logits, probs, x, wte, targets, work):
        """probs is the row log-sum-exp (N,); the mean loss lands in the engine's loss_out[0].
        logits (N, V) may be a row-strided view (the padded rows of ``PlanPolicy.logits_pad``)."""
        N, V = logits.shape
        pad = self._padded_head(logits, wte)
        if pad is None:
            self._mm(logits, x, wte, tb=True, tag="head fwd")
        else:
            self._mm(pad[0], x, pad[1], tb=True, tag="head fwd")
        if targets is not None:
            k_loss_fwd(self.p, probs, losses, logits, targets, N, V)
            k_loss_mean(losses, self.a["loss_out"], N)

    def loss_backward(self, dx, dwte, logits, probs, x, wte, targets, dloss, work):
        """dlogits is rebuilt in place in logits from the saved log-sum-exp ``probs`` (fp8 with its E4M3
        head: in E4M3 by Fp8Gemm.head_dlogits, the GEMMs then on E4M3, the same calls)."""
        N, V = logits.shape
        pad = self._padded_head(logits, wte)
        if pad is not None and self.f8 is not None and self.f8.head is not None:
            self.f8.head_dlogits(pad[0], V, targets, probs, dloss)
            self._mm(dx, pad[0], pad[1], tag="head dgrad")
            self._mm(dwte, pad[0], x, ta=True, beta=1.0, tag="head wgrad")
            return
        k_loss_bwd(self.p, logits, logits, targets, probs, dloss, N, V)
        if pad is None:
            self._mm(dx, logits, wte, tag="head dgrad")         # dx = dlogits @ wte
            self._mm(dwte, logits, x, ta=True, beta=1.0, tag="head wgrad")   # dwte += dlogits.T @ x
            return
        self._mm(dx, pad[0], pad[1], tag="head dgrad")          # the zero pad columns add nothing
        g, vp = self.a["g"], pad[0].shape[1]
        if PAD_HEAD_WGRAD and dwte.data.ptr == g.data.ptr and g.size >= vp * dwte.shape[1]:
            # (Vp, C): wte's gradient, then + 0 onto the first Vp - V rows of wpe's (PAD_HEAD_WGRAD)
            self._mm(g[:vp * dwte.shape[1]].reshape(vp, dwte.shape[1]), pad[0], x, ta=True, beta=1.0,
                     tag="head wgrad")
        else:
            self._mm(dwte, logits, x, ta=True, beta=1.0, tag="head wgrad")


def gpu_policy(mc: ModelConfig, B: int, precision: str, recompute: str = "auto") -> PlanPolicy:
    """The GPU engine's plan choices, and its ops' own scratch and optimizer buffers."""
    T, C, H = mc.context, mc.d_model, mc.n_head
    N = B * T
    n_chunks = (N + LN_ROWS_PER_CHUNK - 1) // LN_ROWS_PER_CHUNK
    n_part = max(NORM_BLOCKS, norm_slots(update_pieces(param_layout(mc), mc.n_layer))[1]) if OVERLAP_NORM \
        else NORM_BLOCKS
    scratch = (
        Buffer("dh", (N, 4 * C), "work"), Buffer("dvec", (B * H * T,), "work", "acc"),
        Buffer("ln_part", (n_chunks * 2 * C,), "work", "acc"), Buffer("loss_out", (8,), "stat", "acc"),
        Buffer("norm_part", (n_part,), "stat", "acc"), Buffer("gstate", (4,), "stat", "acc"),
        Buffer("hp", (8,), "stat", "acc"),
        Buffer("seg_order", (N,), "index", "int32"), Buffer("seg_start", (N + 1,), "index", "int32"),
        Buffer("seg_tok", (N,), "index", "int32"), Buffer("seg_n", (1,), "index", "int32"),
    )
    # fp8 keeping the E4M3 transposes of the GEMM inputs (fp8.SAVE_TRANSPOSES): the backward reads
    # neither the LayerNorm outputs nor h_act, so one buffer each serves every layer (120M B=32: -3.3 GB)
    shared = frozenset({"ln", "gelu"}) if precision == "fp8" and fp8_mod.SAVE_TRANSPOSES else frozenset()
    return PlanPolicy(att_shape=(B, H, T), loss_saved=(N,), recompute=recompute_for(precision, recompute) - shared,
                      shared=shared, cast_branch=precision != "fp32", scratch=scratch,
                      logits_pad=LOGITS_PAD if precision in PAD_PRECISIONS else 1)


@dataclass(frozen=True)
class Arena:
    """The GPU engine's one allocation, planned: ``spec`` lists (name, shape, dtype) of w, g, m, v,
    every buffer of ``plan`` and (bf16/fp16) the 16-bit weight copy ``wlow``; ``offsets`` are
    byte offsets (each entry 256-byte aligned); ``nbytes`` the arena's size (512-byte rounded)."""

    policy: PlanPolicy
    plan: list
    spec: list
    offsets: dict
    nbytes: int
    aliases: tuple = ()      # (name, shape, dtype, host, byte offset): a buffer laid over another's bytes
    layers: tuple = ()       # per-layer buffers whose spec entry holds layer 0; layer l is the alias "name.l"


def fp8_plan(mc: ModelConfig) -> tuple[dict, int]:
    """The fp8 engine's E4M3 weight copies (``andrea.cuda.fp8.weight_plan``) and their bytes."""
    return weight_plan(param_layout(mc), recipe.MATMUL_WEIGHTS)


def block_weight_spans(layout, n_layers: int) -> list[tuple[int, int]]:
    """The flat [lo, hi) of each of the first ``n_layers`` blocks' matmul weights (recipe.MATMUL_WEIGHTS)."""
    return [contiguous_span(layout, [f"h.{l}.{k}" for k in recipe.MATMUL_WEIGHTS]) for l in range(n_layers)]


def grads_room(mc: ModelConfig, spec: list, precision: str, world: int, grad_accum: int | None) -> tuple[list, list]:
    """ACTS_IN_GRADS: (the aliases (``name.l``, shape, dtype, "g", byte offset) of layers 1..L-1, the names
    moved): a name is moved where its layer fits every layer's room after the names before it, each
    start 256-byte aligned; none where a step may hold more than one microbatch (``grad_accum``)."""
    L = mc.n_layer
    if grad_accum != 1 or world != 1 or precision not in LT_PRECISIONS or not WGRAD_WRITES or L < 2:
        return [], []
    layout, entries = param_layout(mc), {e[0]: e for e in spec}
    spans = block_weight_spans(layout, L - 1)
    at, ends = [4 * lo for lo, _ in spans], [4 * hi for _, hi in spans]     # bytes into g of layer l-1's rows
    aliases, moved = [], []
    for name in ACTS_IN_GRADS:
        e = entries.get(name)
        if e is None or e[1][0] != L:                 # not planned, or one buffer for every layer (recompute)
            continue
        nb = math.prod(e[1][1:]) * np.dtype(e[2]).itemsize
        starts = [-(-s // 256) * 256 for s in at]
        if any(s + nb > end for s, end in zip(starts, ends)):
            continue
        at = [s + nb for s in starts]
        moved.append(name)
        aliases += [(f"{name}.{l + 1}", e[1][1:], e[2], "g", s) for l, s in enumerate(starts)]
    return aliases, moved


def arena_layout(mc: ModelConfig, batch_size: int, precision: str, world: int = 1, recompute: str = "auto",
                 grad_accum: int | None = None) -> Arena:
    """The arena GpuEngine(mc, batch_size, precision) allocates, computed without CuPy or a GPU
    (andrea/memory.py itemises it; the memory preflight searches batch sizes with it). With
    ``world`` > 1 ranks (ZeRO-1, andrea/dist.py) w and g are padded to world shards, m and v are
    one shard, and the gathered norm partials and losses get their buffers. fp8 is bf16's arena
    plus the entries of ``andrea.cuda.fp8.fp8_buffers``. ``grad_accum`` 1 (one microbatch a step):
    layers 1.. of the ACTS_IN_GRADS buffers lie in g (``grads_room``); None: any number."""
    B, n = int(batch_size), param_layout(mc).n_params
    shard = dist.shard_size(n, world)
    policy = gpu_policy(mc, B, precision, recompute)
    plan = activation_plan(mc, B, policy)
    low = np.float32 if precision == "fp32" else np.uint16
    dtypes = {"act": low, "acc": np.float32, "int32": np.int32, "float64": np.float64}
    spec = [("w", (world * shard,), np.float32), ("g", (world * shard,), np.float32), ("m", (shard,), np.float32),
            ("v", (shard,), np.float32)]
    spec += [(b.name, b.shape, dtypes[b.dtype]) for b in plan]
    if world > 1:
        spec += [("norm_all", (world * NORM_BLOCKS,), np.float32), ("loss_all", (world,), np.float32)]
    if precision != "fp32":
        spec.append(("wlow", (n,), low))
    if precision in LT_PRECISIONS:
        spec.append(("lt_ws", (LT_WORKSPACE,), np.uint8))     # cuBLASLt's workspace (fp8's is in fp8_buffers)
    if OWN_DGELU and precision == "bf16":
        spec.append(("dgelu_maps", (mc.n_layer, 512), np.uint8))   # MmDgelu's TMA maps, one set a layer
    if precision in PAD_PRECISIONS:
        vp = -(-mc.vocab_size // LOGITS_PAD) * LOGITS_PAD
        spec.append(("wte_pad", (vp, mc.d_model), low))       # the head's wte, zero rows to Vp (FastOps._padded_head)
    if precision == "fp8":
        plan8, n8 = fp8_plan(mc)
        spec += fp8_buffers(n8, B * mc.context, mc.d_model, n_slots(plan8), mc.n_layer, vp=vp)
    if AFTER_H_PRE and any(e[0] == "h_pre" for e in spec):     # the free run behind h_pre (AFTER_H_PRE)
        moved = sorted((e for e in spec if e[0] in AFTER_H_PRE), key=lambda e: AFTER_H_PRE.index(e[0]))
        rest = [e for e in spec if e[0] not in AFTER_H_PRE]
        at = next(i for i, e in enumerate(rest) if e[0] == "h_pre") + 1
        spec = rest[:at] + moved + rest[at:]
    aliases, moved = grads_room(mc, spec, precision, world, grad_accum)      # layers 1.. in g (ACTS_IN_GRADS)
    spec = [(n, (1, *shape[1:]), dt) if n in moved else (n, shape, dt) for n, shape, dt in spec]
    if DH_IN_LOGITS and precision != "fp8":                   # dL/dh in the logits' bytes (DH_IN_LOGITS)
        dh, lg = (next(e for e in spec if e[0] == name) for name in ("dh", "logits"))
        if dh[2] == lg[2] and math.prod(dh[1]) <= math.prod(lg[1]):
            spec = [e for e in spec if e[0] != "dh"]
            aliases.append((*dh, "logits", 0))
    offs, off = {}, 0
    for name, shape, dt in spec:
        offs[name] = off
        off += -(-math.prod(shape) * np.dtype(dt).itemsize // 256) * 256
    return Arena(policy, plan, spec, offs, -(-off // 512) * 512, tuple(aliases), tuple(moved))


def stream_priority(world: int) -> int | None:
    """The engine stream's priority (STREAM_PRIORITY, one GPU), or None: the default."""
    return PRIORITY_HIGH if STREAM_PRIORITY and world == 1 else None


def update_pieces(layout, n_layer: int) -> list:
    """OVERLAP_UPDATE's pieces of the flat parameters in the order the forward reads them, each (its flat
    [lo, hi) ranges, the parameter whose first read in the forward waits for it): wte and wpe (the
    embedding), then each block's UPDATE_BLOCK_PIECES, then lnf (the head). They cover
    every parameter once; AndreaError if the layout says otherwise."""
    pieces = [([(0, layout.by_name["h.0.attn.w_qkv"].offset)], "wte")]
    for l in range(n_layer):
        for opens, runs in UPDATE_BLOCK_PIECES:
            pieces.append(([contiguous_span(layout, [f"h.{l}.{t}" for t in run]) for run in runs], f"h.{l}.{opens}"))
    pieces.append(([contiguous_span(layout, ["lnf.g", "lnf.b"])], "lnf.g"))
    covered = sorted(r for rs, _ in pieces for r in rs)
    if covered[0][0] != 0 or covered[-1][1] != layout.n_params or any(a[1] != b[0] for a, b in zip(covered, covered[1:])):
        raise AndreaError("cupy engine: OVERLAP_UPDATE's pieces do not cover the flat parameters once")
    return pieces


def norm_slots(pieces) -> tuple[list, int]:
    """OVERLAP_NORM's partial sums: for each piece of ``update_pieces``, its ranges as (lo, hi, first slot,
    blocks), a range's k_grad_norm_partial blocks being one per NORM_CHUNK elements (1 to NORM_BLOCKS); the
    slots laid out in the flat order of the ranges, whatever order the backward finishes them in. And the
    number of slots. AndreaError for a piece no LayerNorm backward ends."""
    for _, opens in pieces:
        if opens != "wte" and not opens.endswith(("ln1.g", "ln2.g", "lnf.g")):
            raise AndreaError(f"cupy engine: OVERLAP_NORM needs each of UPDATE_BLOCK_PIECES' pieces opened by a "
                              f"LayerNorm's g (its backward ends the piece), not by {opens}; turn one of them off")
    at, slot = {}, 0
    for lo, hi in sorted(r for rs, _ in pieces for r in rs):
        blocks = min(NORM_BLOCKS, max(1, -(-(hi - lo) // NORM_CHUNK)))
        at[lo, hi], slot = (slot, blocks), slot + blocks
    return [[(lo, hi, *at[lo, hi]) for lo, hi in rs] for rs, _ in pieces], slot


class GpuEngine:
    """The training step on the GPU in fp32 | bf16 | fp16 with fp32 master weights, m and v.
    Every buffer lives in one arena allocated at construction; ``planned_bytes`` is its size."""

    def __init__(self, backend, mc: ModelConfig, batch_size: int, precision: str = "bf16", cuda_graph: bool = True,
                 comm=None, fp8_scaling: str = "current", fp8_amax_history: int = 16, recompute: str = "auto",
                 attention: str = "auto", grad_accum: int | None = None):
        """``backend``: the CupyBackend whose cuBLAS handle and host copies this engine uses.
        ``fp8_scaling`` / ``fp8_amax_history``: train.fp8_scaling and train.fp8_amax_history (fp8 only).
        ``recompute``: train.recompute (``recompute_for``). ``attention``: train.attention (auto | cudnn |
        kernels: andrea/cuda/cudnn_attention.py's ``resolve``; ``self.attention`` says which runs).
        ``grad_accum``: the microbatches of every step (train.grad_accum), None for any number; with 1 the
        arena lays activations in the gradients' bytes (ACTS_IN_GRADS) and a second microbatch is refused.
        A plan larger than the device's free memory (``backend.free_memory()``, with the
        preflight's headroom) is refused before CuPy allocates anything (andrea/preflight.py)."""
        if precision not in PRECISIONS:
            raise AndreaError(f"train.precision: {precision!r} is not supported by the cupy engine "
                              f"(fp32 | bf16 | fp16 | fp8)")
        if precision == "fp8" and (mc.d_model % 64 or (int(batch_size) * mc.context) % 64):
            raise AndreaError(f"train.precision=fp8: d_model ({mc.d_model}) and batch x context "
                              f"({int(batch_size) * mc.context}) must be multiples of 64 (the E4M3 casts' tiles); "
                              f"use train.precision=bf16 for this model")
        if fp8_scaling not in SCALINGS or int(fp8_amax_history) < 1:
            raise AndreaError(f"train.fp8_scaling={fp8_scaling!r}, train.fp8_amax_history={fp8_amax_history!r}: "
                              f"expected current | delayed and a history of at least 1 step")
        self.comm, world = comm, 1 if comm is None else comm.size     # comm: andrea.dist.NcclComm (ZeRO-1)
        if precision == "fp8" and fp8_scaling == "delayed" and world > 1:
            raise AndreaError(f"train.fp8_scaling=delayed runs on one GPU (its amax history is per rank; "
                              f"train.gpus={world}): use train.fp8_scaling=current with more than one GPU")
        arena = arena_layout(mc, batch_size, precision, world, recompute, grad_accum)
        lighter = None                                 # the refusal names train.recompute=gelu where it plans less
        if recompute == "auto" and recompute_for(precision, "gelu") != recompute_for(precision):
            lighter = ("train.recompute=gelu",
                       lambda b: arena_layout(mc, b, precision, world, "gelu", grad_accum).nbytes)
        check_memory(lambda b: arena_layout(mc, b, precision, world, recompute, grad_accum).nbytes, int(batch_size),
                     backend.free_memory(), f"cupy {precision} engine", lighter,
                     lambda b: arena_layout(mc, b, precision, world, recompute).nbytes)
        xp = cp()
        if precision == "fp8":
            require_fp8(xp.cuda.Device().compute_capability)
        self.cp, self.mc, self.B, self.prec = xp, mc, int(batch_size), precision
        self.kp = "bf16" if precision == "fp8" else precision      # the storage type of every non-GEMM kernel
        self.be = backend
        self.blas = self.be.ops.blas
        self.layout = param_layout(mc)
        self.n_params = self.layout.n_params
        self.T, self.N = mc.context, self.B * mc.context
        attn_impl(self.kp, mc.d_model // mc.n_head, 3 * mc.d_model)  # refuse an unsupported head size now
        self.lowtype = LOWTYPE[self.kp]
        self.loss_scale = FP16_SCALE0 if precision == "fp16" else 1.0
        self.good_steps = 0
        self.policy, self.plan, spec, offs = arena.policy, arena.plan, arena.spec, arena.offsets
        self.planned_bytes = arena.nbytes
        pool = xp.get_default_memory_pool()
        before = pool.used_bytes()
        self.arena = xp.empty(self.planned_bytes, dtype=np.uint8)
        self.arena_used = pool.used_bytes() - before
        self.a = {}
        for name, shape, dt in spec:
            nb = math.prod(shape) * np.dtype(dt).itemsize
            self.a[name] = self.arena[offs[name]:offs[name] + nb].view(dt).reshape(shape)
        for name, shape, dt, host, at in arena.aliases:
            start = offs[host] + at
            self.a[name] = self.arena[start:start + math.prod(shape) * np.dtype(dt).itemsize].view(dt).reshape(shape)
        for name in arena.layers:                      # layer 0 in its entry, the others in g (ACTS_IN_GRADS)
            self.a[name] = [self.a[name][0], *(self.a.pop(f"{name}.{l}") for l in range(1, mc.n_layer))]
        self.acts_in_grads = arena.layers
        a = self.a
        self.w, self.g, self.m, self.v = a["w"], a["g"], a["m"], a["v"]
        if world > 1:                                  # the real n of the padded flat buffers
            self.w, self.g = a["w"][:self.n_params], a["g"][:self.n_params]
        if precision == "fp32":
            a["wlow"] = a["w"]
        views = lambda flat: {t.name: flat[t.offset:t.offset + t.size].reshape(t.shape) for t in self.layout.tensors}
        self.W, self.WL, self.G = views(a["w"]), views(a["wlow"]), views(a["g"])
        self.arena.fill(0)
        a["gstate"].set(np.array([0.0, 1.0, 1.0, 0.0], dtype=np.float32))
        f8 = None
        if precision == "fp8":
            # the head's GEMMs stay bf16 unless fp8.FP8_HEAD (Fp8Gemm.head: its calls are taken first)
            head = {self.WL["wte"].data.ptr, self.G["wte"].data.ptr, a["wte_pad"].data.ptr}
            e4m3_head = "w8_head" in a
            f8 = Fp8Gemm(a, self.WL, fp8_plan(mc)[0], head, self.blas, scaling=fp8_scaling,
                         n_sites=n_sites_for(mc.n_layer, e4m3_head), history=int(fp8_amax_history),
                         ln_ptrs=(a["ln1"].data.ptr, a["ln2"].data.ptr)
                         + ((a["lnf"].data.ptr,) if e4m3_head and fp8_mod.FP8_HEAD_FWD else ()))
        self.f8 = f8
        # the block matmul weights' flat range: their weight-gradient GEMMs write it whole (WGRAD_WRITES), and
        # fp8 ADAMW_E4M3's step covers it (_w8_range)
        self._block_span = contiguous_span(self.layout, [f"h.{l}.{k}" for l in range(mc.n_layer)
                                                         for k in recipe.MATMUL_WEIGHTS])
        self._wgrad_span = self._block_span if WGRAD_WRITES and world == 1 and precision != "fp32" else None
        self._writes_wgrad = False         # the next micro_step is a step's first (zero_grads sets it)
        # g outside the block weights' rows (what zero_grads fills), and whether it is zero now (CLEAR_AFTER_UPDATE)
        self._rest = () if self._wgrad_span is None else (self.g[:self._wgrad_span[0]], self.g[self._wgrad_span[1]:])
        self._rest_clear = False
        self.lt = Lt(a["lt_ws"]) if precision in LT_PRECISIONS else None
        self.attention, self.dnn = self._attention(attention)
        self.ops = FastOps(self.kp, self.blas, a, f8, self.lt, self.dnn)
        if "dgelu_maps" in a and hopper():
            self.ops.dgelu = MmDgelu(OWN_DGELU_DEFINES, store=a["dgelu_maps"])
        self.z = recipe.views(a, self.W, self.WL, self.G, mc, (0, self.B))
        self._upd = None                     # OVERLAP_UPDATE: its stream, pieces and events (_update_plan)
        if OVERLAP_UPDATE and f8 is None and world == 1:
            self._upd = self._update_plan(xp)
        self._norm = None                    # OVERLAP_NORM: its stream, slots and events (_norm_plan)
        if OVERLAP_NORM and f8 is None and world == 1:
            self._norm = self._norm_plan(xp)
        self.priority = stream_priority(world)           # STREAM_PRIORITY: None = the default
        self.stream = xp.cuda.Stream(non_blocking=True, priority=self.priority)
        self.use_graph = bool(cuda_graph) and precision != "fp16"
        self.graph = None                  # (forward + backward up to the embedding's, the embedding backward)
        self.graph_scale = None
        # pinned staging for the batch's uploads: copies that do not hold the host, so the host
        # sorts the next segments while the GPU runs (_load_segments)
        self.staged = {}
        for name in ("idx", "targets", "seg_order", "seg_start", "seg_tok", "seg_n", "hp"):
            dst = self.a[name]
            mem = xp.cuda.alloc_pinned_memory(dst.nbytes)
            self.staged[name] = np.frombuffer(mem, dtype=dst.dtype, count=dst.size).reshape(dst.shape)
        # pinned read-back of the last loss and the optimizer's gstate (_read_back)
        self._back = {name: np.frombuffer(xp.cuda.alloc_pinned_memory(4 * k), dtype=np.float32, count=k)
                      for name, k in (("loss_out", 1), ("gstate", 4))}

    # ------------------------------------------------------------------ bookkeeping
    @property
    def allocated_bytes(self) -> int:
        return int(self.arena.nbytes)

    @property
    def fp8_clipped_total(self) -> int | None:
        """fp8 delayed scaling: casts so far whose tensor's amax exceeded 448 / its scale (they
        saturated at 448; the history raised the scale's divisor the next step). None otherwise.
        The trainer logs it in .loss.json's train records as ``fp8_clipped``."""
        return None if self.f8 is None or self.f8.hist is None else int(self.f8.hist.clipped_total)

    def _attention(self, choice: str):
        """("cudnn", its CudnnAttention) or ("kernels", None) for train.attention = ``choice``: cuDNN's
        workspace must fit the logits' bytes (``CudnnAttention``); where it does not, auto keeps the
        kernels and an explicit cudnn is refused in one line."""
        mc = self.mc
        pick = resolve_attention(choice, self.kp, mc.d_model // mc.n_head, hopper())
        if pick == "kernels":
            return pick, None
        try:
            return pick, CudnnAttention(self.B, self.T, mc.d_model, mc.n_head, self.a["logits"].nbytes)
        except AndreaError:
            if choice == "cudnn":
                raise
            return "kernels", None

    def describe(self) -> str:
        mc, mib = self.mc, 1 << 20
        return (f"model: {self.n_params:,} parameters (V={mc.vocab_size} C={mc.d_model} H={mc.n_head} "
                f"L={mc.n_layer} T={mc.context}); batch {self.B}x{self.T}; backend cupy {self.prec}"
                f"{' + CUDA graph' if self.use_graph else ''}\n"
                + (f"{self.dnn.describe()}\n" if self.dnn is not None else "")
                + (f"proj dgrad + gelu': mm_dgelu.cu {self.ops.dgelu.cfg} (OWN_DGELU)\n" if self.ops.dgelu else "")
                + (f"optimizer: AdamW in {len(self._upd.pieces)} pieces beside the next forward (OVERLAP_UPDATE)\n"
                   if self._upd is not None else "")
                + ("gradient norm: piece by piece beside the backward (OVERLAP_NORM)\n" if self._norm is not None else "")
                + (f"engine stream priority {self.stream.priority} (STREAM_PRIORITY)\n"
                   if self.priority is not None else "")
                + f"planned bytes: {self.planned_bytes:,} ({self.planned_bytes / mib:.1f} MiB; fp32 w+g+m+v "
                f"{16 * self.n_params / mib:.1f} MiB); memory pool grew by {self.arena_used:,} bytes"
                + ("" if self.comm is None or self.comm.size == 1 else
                   f"\nZeRO-1 rank {self.comm.rank} of {self.comm.size}: m and v hold one shard of {self.m.size:,} "
                   f"({8 * self.m.size / mib:.1f} MiB)"))

    def _low_refresh(self) -> None:
        if self.prec != "fp32":
            k_cast(self.kp, self.a["wlow"], self.a["w"], self.n_params)

    def _weights_changed(self, part=None, stepped: bool = False) -> None:
        """Where the weights change (load_state, every optimizer step), not at every forward: the
        fp8 E4M3 copies of ``wlow`` and the padded head's copy of wte (``wte_pad``), on the current
        stream. A skipped step recasts unchanged weights: the same bytes. ``part``: the optimizer's
        amax partials of wlow (``_amax_part``); ``stepped``: the step wrote the matmul weights' E4M3
        copies itself (``_w8_range``), so only the head's are left."""
        if "wte_pad" in self.a:                        # first: the fp8 head's casts read it
            src, dst = self.WL["wte"], self.a["wte_pad"]
            dst.data.copy_from_device_async(src.data, src.nbytes, self.cp.cuda.get_current_stream())
        if self.f8 is not None:
            if stepped:
                self.f8.cast_head()
            else:
                self.f8.cast_weights(part, ADAMW_CHUNK)

    def _w8_range(self):
        """fp8 ``ADAMW_E4M3`` (Fp8Gemm.steps_weights, one GPU): [first, end) of the flat matmul weights (the
        weight table's, recipe.MATMUL_WEIGHTS), whose optimizer step also writes their E4M3 copies
        (Fp8Gemm.step_weights); else None."""
        if self.f8 is None or self.comm is not None or not self.f8.steps_weights:
            return None
        return self._block_span

    def init_weights(self, seed: int) -> None:
        """The same weights as Engine.init_weights(seed) (``init_params``, drawn on the host)."""
        host = init_params(self.mc, seed)
        self.load_state(host, np.zeros_like(host), np.zeros_like(host))

    def load_state(self, w: np.ndarray, m: np.ndarray, v: np.ndarray) -> None:
        """The whole flat w, m, v (host); with a comm this rank keeps its shard of m and v."""
        self.settle()
        if self.comm is not None and self.comm.size > 1:
            m, v = self._my_shard(m), self._my_shard(v)
        for dst, src in ((self.w, w), (self.m, m), (self.v, v)):
            dst.set(np.ascontiguousarray(src, dtype=np.float32).reshape(-1))
        self.g.fill(0)
        self._low_refresh()
        self._weights_changed()
        self.cp.cuda.Device().synchronize()

    def extra_state(self) -> dict:
        """What later steps depend on beyond w, m, v: the fp16 dynamic loss scale and its count of
        good steps; fp8 with delayed scaling: every cast site's amax history, the steps pushed and
        the count of clipped casts (andrea.engine.fp8_numpy.AmaxHistory.state), and the amax the
        matmul weights' E4M3 copies were made at (``weight_amax``, fp8.ADAMW_E4M3). {} in fp32/bf16 and
        in fp8 with current scaling (every scale comes from the tensor being cast). The CUDA graph
        is rebuilt from the fp16 scale (it bakes it in); fp8's scales live on the device."""
        if self.f8 is not None and self.f8.hist is not None:
            return {"fp8_scaling": "delayed", **self.f8.hist.state(), **self.f8.weight_state()}
        if self.prec != "fp16":
            return {}
        return {"loss_scale": float(self.loss_scale), "good_steps": int(self.good_steps)}

    def load_extra_state(self, d: dict) -> None:
        want, optional = set(self.extra_state()), {"weight_amax"}   # fp8 ADAMW_E4M3's: absent before it
        if set(d) - optional != want - optional:
            hint = " (saved under another train.fp8_scaling? set it to the run's)" if self.prec == "fp8" else ""
            raise AndreaError(f"cupy {self.prec} engine state: expected keys {sorted(want)}, got {sorted(d)}{hint}")
        if self.f8 is not None and self.f8.hist is not None:
            self.f8.hist.load(d)                               # ValueError on a shape that does not fit
            with self.stream:
                self.f8.load_weight_state(d)
                self.f8.write_scales(self.stream)
            self.stream.synchronize()
        elif want:
            self.loss_scale, self.good_steps = float(d["loss_scale"]), int(d["good_steps"])
            self.graph, self.graph_scale = None, None          # recaptured with this scale if graphs are on

    # ------------------------------------------------------------------ the step
    def _upload(self, name: str, arr) -> None:
        """arr (host) into the arena buffer ``name`` through its pinned staging, asynchronously on the
        engine's stream. The staging is rewritten only by the next upload, after the step's sync."""
        dst, view = self.a[name], self.staged[name]
        src = np.asarray(arr)
        if src.size != dst.size:
            raise AndreaError(f"cupy engine: a batch of {src.size} values for {name} (the plan holds {dst.size})")
        np.copyto(view, src.reshape(view.shape), casting="unsafe")
        dst.set(view, stream=self.stream)                       # from pinned memory: cudaMemcpyAsync

    def _load_ids(self, x, y) -> None:
        """The token ids (and targets) the forward reads."""
        self._upload("idx", x)
        if y is not None:
            self._upload("targets", y)

    def _load_segments(self, x) -> None:
        """The embedding backward's token segments (kernels.embed_segments: a host sort), computed
        while the GPU runs the forward and the rest of the backward, which do not read them."""
        for name, arr in zip(("seg_order", "seg_start", "seg_tok", "seg_n"), embed_segments(x)):
            self._upload(name, arr)

    def _pass(self, x, graph: bool = False) -> None:
        """Forward + backward of the loaded ids: everything but the embedding backward is queued
        (``graph``: the captured graphs' first part, else eager launches) before the host sorts x's
        segments, then the embedding backward. The same launches in the same order as one pass."""
        if graph:
            main, tail = self.graph[self.ops.wgrad_beta]
            main.launch(stream=self.stream)
            self._load_segments(x)
            tail.launch(stream=self.stream)
            return
        self.ops.deferred = []
        try:
            self._forward(True)
            self._backward(self.loss_scale / self.N)
            tail = self.ops.deferred
        finally:
            self.ops.deferred = None
        self._load_segments(x)
        for run in tail:
            run()

    def _forward(self, with_loss: bool, backward: bool = True) -> None:
        """The weights' fp8 and padded-head copies are already current (``_weights_changed``);
        ``backward``: a backward follows (fp8 then keeps the activations' transposes for it)."""
        if self.f8 is not None:
            self.f8.begin(backward)
        recipe.forward(self.ops, self.z, self.mc.n_head, with_loss)

    def _backward(self, dscale: float) -> None:
        recipe.backward(self.ops, self.z, self.mc.n_head, dscale, self.policy.recompute)
        if self._norm is not None:                           # OVERLAP_NORM: the partial sums' stream joins here
            self._norm.done.record(self._norm.stream)
            self.cp.cuda.get_current_stream().wait_event(self._norm.done)
        if self.f8 is not None:
            self.f8.check_pass()

    def _capture(self, x) -> None:
        """Capture forward + backward of one microbatch as two CUDA graphs, all but the embedding
        backward and then that (``_pass`` uploads the segments between them); the arena's pointers
        never change, so replaying them after loading a new batch runs the new batch. One pair for
        each weight-gradient beta the steps use (``_wgrad_span``: 0 for a step's first microbatch,
        1 after). One eager run (of the loaded batch x) first loads every module and lets cuBLAS set
        up its workspace outside the capture; g is zeroed after it, so call this at a step's first
        microbatch."""
        with self.stream:
            self._pass(x)
            self.stream.synchronize()
            beta = self.ops.wgrad_beta
            try:
                graphs = {}
                for b in ((0.0,) if self.acts_in_grads else (0.0, 1.0) if self._wgrad_span else (1.0,)):
                    self.ops.wgrad_beta, self.ops.deferred = b, []
                    self.stream.begin_capture()
                    self._forward(True)
                    self._backward(self.loss_scale / self.N)
                    main = self.stream.end_capture()
                    tail, self.ops.deferred = self.ops.deferred, None
                    self.stream.begin_capture()
                    for run in tail:
                        run()
                    graphs[b] = (main, self.stream.end_capture())
                self.graph, self.ops.wgrad_beta = graphs, beta
                self.graph_scale = self.loss_scale
            except Exception as e:  # noqa: BLE001 - fall back to eager launches, and say so
                try:
                    self.stream.end_capture()
                except Exception:  # noqa: BLE001
                    pass
                self.use_graph, self.graph, self.ops.deferred, self.ops.wgrad_beta = False, None, None, beta
                print(f"cupy engine: CUDA graph capture failed ({type(e).__name__}: {e}); running eagerly",
                      file=sys.stderr)
            self.g.fill(0)
        self.stream.synchronize()

    def zero_grads(self) -> None:
        """The start of a step: g = 0, but for the block weights' rows when the first microbatch writes them
        (WGRAD_WRITES, ``_wgrad_span``); nothing to queue where the last update cleared them
        (CLEAR_AFTER_UPDATE)."""
        with self.stream:
            if self._wgrad_span is None or not self._rest_clear:
                self._await_step()                           # OVERLAP_UPDATE: its AdamW reads g
            if self._wgrad_span is None:
                self.g.fill(0)
            elif not self._rest_clear:
                self._clear_rest()
            self._writes_wgrad, self._rest_clear = self._wgrad_span is not None, False
            if self.f8 is not None:
                self.f8.reset_amax()

    def _clear_rest(self) -> None:
        """g = 0 outside the block weights' rows (``_rest``), on the current stream."""
        for rows in self._rest:
            rows.fill(0)

    def micro_step(self, x, y) -> float:
        """Forward + backward of one microbatch, accumulating (+=) its mean-loss gradient into g
        (fp32; times the fp16 loss scale); the first one after zero_grads writes the block weights'
        rows instead (WGRAD_WRITES). Returns the microbatch's mean loss."""
        with self.stream:
            self._queue_micro(x, y)
            if self.comm is not None and self.comm.size > 1:     # the microbatch's loss over every rank's rows
                self.comm.all_gather(self.a["loss_out"][:1], self.a["loss_all"])
                return dist.global_mean(self.a["loss_all"].get(stream=self.stream))
            out = self.a["loss_out"][:1].get(stream=self.stream)
        return float(out[0])

    def _queue_micro(self, x, y) -> None:
        """micro_step's launches, on the engine's stream; its loss lands in loss_out[0]."""
        self._rest_clear = False
        if self.acts_in_grads and not self._writes_wgrad:
            raise AndreaError(f"cupy engine: a second microbatch in one step, but this engine was built for one "
                              f"(grad_accum=1: layers 1.. keep {', '.join(self.acts_in_grads)} in the gradients' "
                              f"bytes); build it with the step's number of microbatches (train.grad_accum)")
        self.ops.wgrad_beta, self._writes_wgrad = (0.0 if self._writes_wgrad else 1.0), False
        self._load_ids(x, y)
        calibrating = self.f8 is not None and self.f8.calibrating   # fp8 delayed, first step: current casts
        if self.use_graph and self.graph is None and not calibrating:
            self._capture(x)
        self._pass(x, self.graph is not None and self.graph_scale == self.loss_scale and not calibrating)

    def train_step(self, batches, lr: float, t: int, hp: Hyper, n_micro: int | None = None,
                   on_loss=None) -> StepResult:
        """Engine.train_step (its contract and its bytes), waiting for the device once a step instead of
        twice (READ_LOSS_LAST): the last microbatch's loss is read back with the update's state, after the
        update is queued, and a non-finite one makes the update's kernels skip the step (k_gate_finite), as
        apply_update skips it on the host. Its ``on_loss`` call comes then, before the step returns. fp8
        and several ranks keep Engine.train_step's loop."""
        if not READ_LOSS_LAST or self.f8 is not None or self.comm is not None:
            return Engine.train_step(self, batches, lr, t, hp, n_micro, on_loss)
        n = len(batches) if n_micro is None else int(n_micro)
        self.zero_grads()
        loss, queued = 0.0, False
        for i, (x, y) in enumerate(batches):
            if queued:                                   # more batches than n_micro: read the last one's loss
                loss, queued = loss + self._observe(on_loss) / n, False
            if i == n - 1 and math.isfinite(loss):
                with self.stream:
                    self._queue_micro(x, y)
                queued = True
            else:
                li = self.micro_step(x, y)
                if on_loss is not None:
                    on_loss(li)
                loss += li / n
        if not queued:
            return self.apply_update(n, loss, lr, t, hp)
        stepped = self._queue_update(n, lr, t, hp, gate=True)
        last, out = self._read_back("loss_out", "gstate")
        loss += self._observe(on_loss, last) / n
        if not math.isfinite(loss):                      # the kernels skipped the step (k_gate_finite)
            self._scaler(False)
            return StepResult(loss, float("nan"), False)
        return self._result(loss, out, stepped)

    def _observe(self, on_loss, last=None) -> float:
        """The queued microbatch's loss (``last``: as read back already), given to ``on_loss``."""
        li = float((self._read_back("loss_out")[0] if last is None else last)[0])
        if on_loss is not None:
            on_loss(li)
        return li

    def _read_back(self, *names) -> list:
        """The first entries of these stat buffers (``_back``), copied to the host after what the stream
        holds, with one wait for them all."""
        rt = self.cp.cuda.runtime
        for name in names:
            host = self._back[name]
            rt.memcpyAsync(host.ctypes.data, self.a[name].data.ptr, host.nbytes, rt.memcpyDeviceToHost,
                           self.stream.ptr)
        self.stream.synchronize()
        return [self._back[name].copy() for name in names]

    def apply_update(self, n_micro: int, loss: float, lr: float, t: int, hp: Hyper) -> StepResult:
        """Global norm of the accumulated gradients / n_micro (/ loss scale), clip, AdamW, all on
        the device; a non-finite loss or norm leaves w, m and v untouched (the kernel checks)."""
        if not math.isfinite(loss):
            self._scaler(False)
            if self.f8 is not None:
                with self.stream:
                    self.f8.after_step(self.stream)
            return StepResult(loss, float("nan"), False)
        stepped = self._queue_update(n_micro, lr, t, hp)
        return self._result(loss, self._read_back("gstate")[0], stepped)

    def _queue_update(self, n_micro: int, lr: float, t: int, hp: Hyper, gate: bool = False):
        """apply_update's launches; returns ``stepped`` (``_w8_range``) for ``_result``. ``gate``: the step is
        also skipped where the last microbatch's loss (loss_out[0]) is not finite."""
        a, n = self.a, self.n_params
        inv = 1.0 / (self.loss_scale * n_micro * (1 if self.comm is None else self.comm.size))
        with self.stream:
            if self.f8 is not None:
                self.f8.queue_amax(self.stream)              # delayed: the amaxes' copy, before the update
            self._upload("hp", adam_hyper(t, lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay))
            part = None                                      # the sharded step keeps the amax pass
            stepped = self._w8_range()                       # fp8 ADAMW_E4M3: the matmul weights' step writes
            if self.comm is not None:                        # their E4M3 copies
                dist.zero1_update(self.comm, _Zero1Kernels(self, hp.grad_clip, inv), n, self.layout.n_decay)
            else:
                self._grad_norm(hp.grad_clip, inv)
                if gate:
                    k_gate_finite(a["loss_out"], a["gstate"])
                if self._upd is not None:                    # OVERLAP_UPDATE: beside the next forward
                    self._queue_update_overlapped()
                    return stepped
                wlow = a["wlow"] if self.prec != "fp32" else np.uint64(0)
                if stepped is None:
                    part = self._amax_part()
                    k_adamw(self.kp, a["w"], a["g"], a["m"], a["v"], wlow, n, a["hp"], a["gstate"],
                            self.layout.n_decay, 1, part=part)
                else:
                    self._adamw_around(stepped)
                    self.f8.step_weights(a["w"], a["g"], a["m"], a["v"], wlow, a["hp"], a["gstate"],
                                         self.layout.n_decay)
                if CLEAR_AFTER_UPDATE and self._rest:        # the next zero_grads' fills, now (CLEAR_AFTER_UPDATE)
                    self._clear_rest()
                    self._rest_clear = True
            self._weights_changed(part, stepped=stepped is not None)
            if self.f8 is not None:
                self.f8.after_step(self.stream)
        return stepped

    def _grad_norm(self, grad_clip: float, inv: float) -> None:
        """gstate[:3] = [norm, clip scale, ok] of g / inv^-1 on the current stream: one pass over g, or with
        OVERLAP_NORM the slots the backward filled plus wte and wpe's, final only now."""
        a = self.a
        if self._norm is None:
            k_grad_norm(a["g"], self.n_params, a["norm_part"], grad_clip, inv, a["gstate"])
            return
        self._norm_sums(self._norm.last)
        k_grad_norm_final(a["norm_part"], self._norm.slots, grad_clip, inv, a["gstate"])

    def _norm_sums(self, ranges) -> None:
        """OVERLAP_NORM: the partial sums of squares of these (lo, hi, first slot, blocks) ranges of g into
        their slots of norm_part, on the current stream."""
        part = self.a["norm_part"]
        for lo, hi, slot, blocks in ranges:
            k_grad_norm_partial(self.g[lo:hi], hi - lo, part[slot:slot + blocks], blocks)

    def _update_plan(self, xp) -> SimpleNamespace:
        """OVERLAP_UPDATE: the update's ``stream``, its ``pieces`` (``update_pieces``, each with the event
        recorded after it), ``after_norm`` (the event the update waits for) and ``done`` (the last piece's
        event: the whole update); the forward's ops learn which parameter opens which piece
        (FastOps.update_waits)."""
        pieces = [(ranges, xp.cuda.Event(disable_timing=True), opens)
                  for ranges, opens in update_pieces(self.layout, self.mc.n_layer)]
        # the fp32 master (LayerNorms; every tensor in fp32) and the 16-bit copy the GEMMs read
        self.ops.update_waits = {v[opens].data.ptr: e for _, e, opens in pieces for v in (self.W, self.WL)}
        return SimpleNamespace(stream=xp.cuda.Stream(non_blocking=True), pieces=[(rs, e) for rs, e, _ in pieces],
                               after_norm=xp.cuda.Event(disable_timing=True), done=pieces[-1][1])

    def _norm_plan(self, xp) -> SimpleNamespace:
        """OVERLAP_NORM: the partial sums' ``stream``, the ``slots`` they fill, the ranges the update sums itself
        (``last``: wte and wpe's) and ``done`` (recorded on the stream at the end of the backward); the
        LayerNorm backwards learn which gradient completes which piece (FastOps.norm_hooks)."""
        pieces = update_pieces(self.layout, self.mc.n_layer)
        ranges, slots = norm_slots(pieces)
        plan = SimpleNamespace(stream=xp.cuda.Stream(non_blocking=True), slots=slots, done=xp.cuda.Event(disable_timing=True),
                               last=())
        hooks = {}
        for (_, opens), rs in zip(pieces, ranges):
            if opens == "wte":                       # its gradient is final after the embedding backward only
                plan.last = tuple(rs)
            else:                                    # lnf.g / h.l.ln1.g / h.l.ln2.g: its LayerNorm backward ends it
                hooks[self.G[opens].data.ptr] = (lambda rs=rs, ev=xp.cuda.Event(disable_timing=True):
                                                 self._norm_piece(rs, ev))
        self.ops.norm_hooks = hooks
        return plan

    def _norm_piece(self, ranges, fork) -> None:
        """OVERLAP_NORM: the partial sums of one piece's ranges on the norm's stream, after what the current
        stream has queued (inside a capture, a branch of the graph that _backward joins)."""
        side = self._norm.stream
        fork.record(self.cp.cuda.get_current_stream())
        side.wait_event(fork)
        with side:
            self._norm_sums(ranges)

    def _queue_update_overlapped(self) -> None:
        """OVERLAP_UPDATE's AdamW: on the update stream after the norm (and the gate) the current stream has
        queued, piece by piece, each followed by its event; wte's padded copy after the first piece, the
        gradients outside the block rows cleared (CLEAR_AFTER_UPDATE) before the last event."""
        upd = self._upd
        stream, pieces = upd.stream, upd.pieces
        upd.after_norm.record(self.cp.cuda.get_current_stream())
        stream.wait_event(upd.after_norm)
        with stream:
            for i, (ranges, ev) in enumerate(pieces):
                for lo, hi in ranges:
                    self._adamw_range(lo, hi)
                if i == 0:
                    self._weights_changed()
                if i == len(pieces) - 1 and CLEAR_AFTER_UPDATE and self._rest:
                    self._clear_rest()
                    self._rest_clear = True
                ev.record(stream)

    def _await_step(self) -> None:
        """OVERLAP_UPDATE: the engine's stream waits for the whole queued optimizer step (no host wait)."""
        if self._upd is not None:
            self.stream.wait_event(self._upd.done)

    def settle(self) -> None:
        """Engine.settle: with OVERLAP_UPDATE the host waits for the queued optimizer step (before anything
        reads or writes w, m, v or g from outside the engine's stream)."""
        if self._upd is not None:
            self._upd.stream.synchronize()

    def _adamw_range(self, lo: int, hi: int) -> None:
        """k_adamw over the flat parameters [lo, hi) with their share of the decayed prefix [0, n_decay)."""
        if hi <= lo:
            return
        a, nd = self.a, self.layout.n_decay
        wlow = a["wlow"][lo:hi] if self.prec != "fp32" else np.uint64(0)
        k_adamw(self.kp, a["w"][lo:hi], a["g"][lo:hi], a["m"][lo:hi], a["v"][lo:hi], wlow, hi - lo,
                a["hp"], a["gstate"], min(max(nd - lo, 0), hi - lo), 1)

    def _result(self, loss: float, out, stepped) -> StepResult:
        """The StepResult of a queued update: ``out`` its gstate as read back, ``stepped`` _queue_update's."""
        ok = bool(out[2] != 0.0)
        if stepped is not None and ok:
            self.f8.count_weight_clips(int(out[3]))
        self._scaler(ok)
        return StepResult(loss, float(out[0]) if ok else float("nan"), ok)

    def _adamw_around(self, span) -> None:
        """k_adamw over the flat parameters outside ``span`` (wte and wpe before it, the LayerNorms after),
        each piece with its share of the decayed prefix [0, n_decay)."""
        for lo, hi in ((0, span[0]), (span[1], self.n_params)):
            self._adamw_range(lo, hi)

    def _amax_part(self):
        """fp8 (one weight table, buffers aligned for k_adamw4_*): where AdamW leaves the max |wlow| of
        each ADAMW_CHUNK parameters for the weight casts, so their amaxes need no pass over wlow: the
        head of the f8_a cast buffer, free between a step's last GEMM and the next forward. Else None."""
        a = self.a
        if self.f8 is None or self.f8.table is None or not adamw4_ok(a["w"], a["g"], a["m"], a["v"], a["wlow"]):
            return None
        k = -(-self.n_params // ADAMW_CHUNK)
        buf = a["f8_a"]
        return buf[:4 * k].view(np.float32) if buf.nbytes >= 4 * k and buf.data.ptr % 16 == 0 else None

    def _scaler(self, ok: bool) -> None:
        """Dynamic loss scale (fp16 only): halve on a bad step, double after 1000 good ones."""
        if self.prec != "fp16":
            return
        if not ok:
            self.loss_scale, self.good_steps = max(1.0, self.loss_scale / 2), 0
        else:
            self.good_steps += 1
            if self.good_steps % FP16_GROWTH_EVERY == 0:
                self.loss_scale = min(FP16_SCALE_MAX, self.loss_scale * 2)

    def eval_batch(self, x: np.ndarray, y: np.ndarray) -> tuple[float, int]:
        """Summed loss and token count of b <= B rows (b < B is padded with row 0, not counted).
        Touches activations only, never weights; gradients only where activations lie in their bytes
        (ACTS_IN_GRADS: between steps, where g is dead)."""
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
                self._load_ids(x, y)
            elif y is not None:
                self._upload("targets", y)
            self._forward(y is not None, backward=False)
            out = self.a["loss_out"][:1].get(stream=self.stream) if y is not None else None
        self.stream.synchronize()
        return None if out is None else float(out[0])

    def logits_host(self) -> np.ndarray:
        """The last forward's logits (N, V) as float32 on the host (after a forward: a backward turns
        the buffer into dlogits, then into dL/dh (DH_IN_LOGITS) and attention's scratch)."""
        bits = self.cp.asnumpy(self.a["logits"][:, :self.mc.vocab_size])
        if self.prec == "fp32":
            return bits
        if self.kp == "bf16":
            return (bits.astype(np.uint32) << 16).view(np.float32)
        return bits.view(np.float16).astype(np.float32)

    def grads_host(self) -> np.ndarray:
        self.settle()
        return self.cp.asnumpy(self.g)

    def state_host(self):
        """The whole fp32 w, m, v on the host. With a comm of more than one rank this is a collective
        (every rank calls it): the m and v shards are gathered through g, which is free between steps."""
        self.settle()
        if self.comm is None or self.comm.size == 1:
            return tuple(self.cp.asnumpy(x) for x in (self.w, self.m, self.v))
        out = [self.cp.asnumpy(self.w)]
        with self.stream:
            for x in (self.m, self.v):
                self.comm.all_gather(x, self.a["g"])
                out.append(self.a["g"][:self.n_params].get(stream=self.stream))
            self.a["g"].fill(0)
        self.stream.synchronize()
        return tuple(out)

    def _my_shard(self, full: np.ndarray) -> np.ndarray:
        """This rank's shard (zero-padded to shard_size) of a whole host flat buffer."""
        n, s = self.n_params, self.m.size
        off, length = dist.shard_range(n, self.comm.size, self.comm.rank)
        out = np.zeros(s, dtype=np.float32)
        out[:length] = np.asarray(full, dtype=np.float32).reshape(-1)[off:off + length]
        return out


class _Zero1Kernels:
    """The GPU engine's buffers and kernels in the shape andrea.dist.zero1_update drives them
    (its NumPy twin is in tests/test_dist.py)."""

    def __init__(self, eng: GpuEngine, clip: float, inv: float):
        a = eng.a
        self.e, self.clip, self.inv = eng, clip, inv
        self.g, self.w, self.m, self.v = a["g"], a["w"], a["m"], a["v"]
        self.part = a["norm_part"]
        self.part_all = a.get("norm_all", a["norm_part"])     # one rank: its own partials are all of them

    def sumsq(self, g_shard, length: int) -> None:
        k_grad_norm_partial(g_shard, length, self.part)

    def finish(self) -> None:
        k_grad_norm_final(self.part_all, self.part_all.size, self.clip, self.inv, self.e.a["gstate"])

    def adamw(self, w_shard, g_shard, length: int, n_decay: int) -> None:
        e = self.e
        off = dist.shard_range(e.n_params, self.e.comm.size, self.e.comm.rank)[0]
        wlow = e.a["wlow"][off:off + length] if e.prec != "fp32" else np.uint64(0)
        if length:                               # a shard wholly in the padding has nothing to update
            k_adamw(e.kp, w_shard, g_shard, self.m, self.v, wlow, length, e.a["hp"], e.a["gstate"], n_decay, 1)

    def refresh(self) -> None:
        if self.e.comm.size > 1:               # every rank casts the gathered weights itself: the same bits
            self.e._low_refresh()
