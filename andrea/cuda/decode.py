"""One-token decode on the GPU as ONE CUDA graph per token, over a preallocated KV cache.

    from andrea.cuda.decode import GraphDecoder
    dec = GraphDecoder(mc, cp.asarray(flat_fp32_params), precision="bf16")
    ids = dec.greedy(prompt_ids, n_new)                 # arg-max on the device, no host sync per token
    generate(dec, prompt_ids, opts, rng, eot_id=...)    # any sampling: it has InferenceModel's surface

The step is the recipe's block (``andrea/engine/recipe.py``: ln1, qkv, attention, out, residual,
ln2, MLP, residual) run with ``FastOps`` (the GPU engine's op set) on one row, with static
shapes: the token and its position live on the device (``state``), so the embedding, the
cache write and the attention over positions 0..pos read them there (``decode.cu``) and
every launch has the same arguments at every step. Two graphs are captured once: ``logits``
(feed ``state[0]`` at ``state[1]``, write the logits (V,) fp32, advance the position) and
``greedy`` (the same, then the arg-max becomes the next ``state[0]`` and is appended to the
device's id buffer). ``greedy`` copies the ids back once per chunk; other sampling reads the
logits row to the host and uses ``andrea.generate``'s sampler (float64, seeded).

Precision: fp32, bf16 or fp16 as the engine's ``FastOps``: the matmuls read a 16-bit copy of
the weights with fp32 accumulation, the residual stream and LayerNorm statistics are fp32,
the KV cache is in the compute dtype. The NumPy twin is ``InferenceModel`` (tests/test_decode_gpu.py).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from andrea.cuda.engine import FastOps
from andrea.cuda.kernels import SUFFIX, Blas, cp, k_cast
from andrea.cuda.loader import kernel
from andrea.engine import recipe
from andrea.engine.model import ModelConfig, param_layout
from andrea.errors import AndreaError

ATTN_THREADS = 128


class _Backend:
    """What ``andrea.generate.generate`` needs of a backend: ``to_host``."""

    def __init__(self, xp):
        self.xp = xp

    def to_host(self, a) -> np.ndarray:
        return self.xp.asnumpy(a)

    def synchronize(self) -> None:
        self.xp.cuda.get_current_stream().synchronize()


class GraphDecoder:
    """KV-cache inference of ``mc`` on the flat fp32 parameters ``params`` (a CuPy array, kept
    as the fp32 master copy for the embeddings and LayerNorms), one CUDA graph per token."""

    def __init__(self, mc: ModelConfig, params, precision: str = "bf16", use_graph: bool = True):
        xp = cp()
        if precision not in SUFFIX:
            raise AndreaError(f"decode: precision must be one of {sorted(SUFFIX)}, got {precision!r}")
        lay = param_layout(mc)
        if params.shape != (lay.n_params,) or params.dtype != np.float32:
            raise AndreaError(f"decode: expected {lay.n_params} fp32 parameters for {mc}, got {params.shape} {params.dtype}")
        if mc.head_dim > ATTN_THREADS or ATTN_THREADS % mc.head_dim:
            raise AndreaError(f"decode: head size {mc.head_dim} must divide {ATTN_THREADS}")
        self.mc, self.xp, self.prec, self.use_graph = mc, xp, precision, use_graph
        self.be = _Backend(xp)
        self.n_params = lay.n_params
        self.stream = xp.cuda.Stream(non_blocking=True)
        low = np.float32 if precision == "fp32" else np.uint16
        L, H, T, C, V, D = mc.n_layer, mc.n_head, mc.context, mc.d_model, mc.vocab_size, mc.head_dim
        with self.stream:
            self.params = params
            self.wlow = params if precision == "fp32" else xp.empty(lay.n_params, dtype=np.uint16)
            self.W = {t.name: params[t.offset:t.offset + t.size].reshape(t.shape) for t in lay.tensors}
            self.WL = {t.name: self.wlow[t.offset:t.offset + t.size].reshape(t.shape) for t in lay.tensors}
            self.k_cache = xp.zeros((L, H, T, D), dtype=low)
            self.v_cache = xp.zeros((L, H, T, D), dtype=low)
            self.state = xp.zeros(4, dtype=np.int32)           # token, position, n ids out, unused
            self.out_ids = xp.zeros(T + 1, dtype=np.int32)
            self.x = xp.zeros((1, C), dtype=np.float32)         # residual stream
            self.h = xp.zeros((1, C), dtype=low)                # LayerNorm output
            self.mean = xp.zeros(1, dtype=np.float32)
            self.rstd = xp.zeros(1, dtype=np.float32)
            self.qkv = xp.zeros((1, 3 * C), dtype=low)
            self.y = xp.zeros((1, C), dtype=low)
            self.branch = xp.zeros((1, C), dtype=low)
            self.h_pre = xp.zeros((1, 4 * C), dtype=low)
            self.h_act = xp.zeros((1, 4 * C), dtype=low)
            self.lnf = xp.zeros((1, C), dtype=low)
            self.logits = xp.zeros((1, V), dtype=np.float32)
        self.ops = FastOps(precision, Blas(), {})
        self.ops.attn_forward = self._attn                    # the recipe's attention op, on the cache
        self.layers = []
        for l in range(L):
            p = f"h.{l}."
            wts = {k.replace(".", "_"): (self.WL if k in recipe.MATMUL_WEIGHTS else self.W)[p + k]
                   for k in recipe.BLOCK_WEIGHTS}
            self.layers.append(SimpleNamespace(
                x_in=self.x, x_mid=self.x, x_out=self.x, ln1=self.h, ln1_mean=self.mean, ln1_rstd=self.rstd,
                ln2=self.h, ln2_mean=self.mean, ln2_rstd=self.rstd, qkv=self.qkv, qkv3=self.qkv,
                att=(self.k_cache[l], self.v_cache[l]), atty=self.y, atty3=self.y, h_pre=self.h_pre,
                h_act=self.h_act, **wts))
        self._k_embed = kernel("decode.cu", "k_dec_embed")
        self._k_attn = kernel("decode.cu", f"k_dec_attn_{SUFFIX[precision]}")
        self._k_argmax = kernel("decode.cu", "k_dec_argmax")
        self._k_advance = kernel("decode.cu", "k_dec_advance")
        self._scale = np.float32(1.0 / math.sqrt(D))
        self._smem = 4 * (max(T, ATTN_THREADS) + D + 32)
        self.refresh_weights()
        self.pos = 0
        self.graphs = {}
        self._capture()

    # ------------------------------------------------------------------ the step
    def refresh_weights(self) -> None:
        """Re-derive the 16-bit matmul copy from the fp32 parameters (after they change)."""
        if self.prec != "fp32":
            with self.stream:
                k_cast(self.prec, self.wlow, self.params, self.n_params)

    def _attn(self, out, att, qkv, mask, n_head, work) -> None:
        k_cache, v_cache = att
        self._k_attn((n_head,), (ATTN_THREADS,), (qkv, k_cache, v_cache, out, self.state, np.int32(n_head),
                                                  np.int32(self.mc.context), np.int32(self.mc.head_dim), self._scale),
                     shared_mem=self._smem)

    def _step(self, greedy: bool) -> None:
        mc = self.mc
        self._k_embed((max(1, (mc.d_model + 255) // 256),), (256,),
                      (self.W["wte"], self.W["wpe"], self.state, self.x, np.int32(mc.d_model)))
        for s in self.layers:
            recipe.block_forward(self.ops, s, self.branch, None, mc.n_head, None)
        self.ops.layernorm_forward(self.lnf, self.mean, self.rstd, self.x, self.W["lnf.g"], self.W["lnf.b"])
        self.ops.blas.mm(self.logits, self.lnf, self.WL["wte"], tb=True, lowtype=self.ops.lt)
        if greedy:
            self._k_argmax((1,), (1024,), (self.logits, np.int32(mc.vocab_size), self.state, self.out_ids, np.int32(1)))
        else:
            self._k_advance((1,), (32,), (self.state,))

    def _capture(self) -> None:
        """One eager run of each step (modules load, cuBLAS sets up outside the capture), then capture."""
        with self.stream:
            for greedy in (False, True):
                self.state.fill(0)
                self._step(greedy)
            self.stream.synchronize()
            if self.use_graph:
                for greedy in (False, True):
                    self.stream.begin_capture()
                    try:
                        self._step(greedy)
                    finally:
                        graph = self.stream.end_capture()
                    self.graphs[greedy] = graph
            self.state.fill(0)
        self.stream.synchronize()

    def _launch(self, greedy: bool) -> None:
        if self.use_graph:
            self.graphs[greedy].launch(self.stream)
        else:
            self._step(greedy)

    # ------------------------------------------------- InferenceModel's surface
    @property
    def context(self) -> int:
        return self.mc.context

    def reset(self) -> None:
        self.pos = 0

    def forward(self, ids, all_logits: bool = False):
        """Feed ``ids`` at positions pos..; the logits (1, V) fp32 of the last one (a view)."""
        if all_logits:
            raise AndreaError("decode: GraphDecoder gives the last row's logits only")
        ids = np.asarray(ids, dtype=np.int32).reshape(-1)
        if ids.size == 0:
            raise AndreaError("forward: no tokens to feed")
        if self.pos + ids.size > self.mc.context:
            raise AndreaError(f"forward: {self.pos} cached + {ids.size} new tokens exceed the context of {self.mc.context}")
        if ids.min() < 0 or ids.max() >= self.mc.vocab_size:
            raise AndreaError(f"forward: token id outside [0, {self.mc.vocab_size})")
        host = np.zeros(4, dtype=np.int32)
        with self.stream:
            for t in ids.tolist():
                host[:] = (t, self.pos, 0, 0)
                self.state.set(host, stream=self.stream)
                self._launch(False)
                self.pos += 1
            self.stream.synchronize()       # `host` is reused: the copies must have happened
        return self.logits

    def greedy(self, prompt, n: int, eot_id: int | None = None) -> list[int]:
        """``n`` greedy tokens after ``prompt`` (stopping after ``eot_id``, not returned), the
        arg-max on the device; past the context the last ``context // 2`` tokens are re-fed."""
        seq = [int(t) for t in np.asarray(prompt).reshape(-1)]
        T, keep = self.mc.context, max(1, self.mc.context // 2)
        self.reset()
        self.forward(seq if len(seq) <= T else seq[-keep:])
        out: list[int] = []
        while len(out) < n:
            chunk = min(n - len(out), T - self.pos + 1)
            with self.stream:
                self.state[2:3].fill(0)
                self._k_argmax((1,), (1024,), (self.logits, np.int32(self.mc.vocab_size), self.state,
                                               self.out_ids, np.int32(0)))
                for _ in range(chunk - 1):
                    self._launch(True)
                got = self.out_ids[:chunk].get(stream=self.stream).tolist()
            self.stream.synchronize()
            self.pos += chunk - 1
            for t in got:
                if eot_id is not None and t == eot_id:
                    return out
                out.append(int(t))
            seq += got
            if len(out) < n:
                self.reset()
                self.forward(seq[-keep:])
        return out[:n]
