"""One-token decode on the GPU as ONE CUDA graph per token, over a preallocated KV cache.

    from andrea.cuda.decode import GraphDecoder
    dec = GraphDecoder(mc, cp.asarray(flat_fp32_params), precision="bf16")
    ids = dec.greedy(prompt_ids, n_new)                 # arg-max on the device, no host sync per token
    generate(dec, prompt_ids, opts, rng, eot_id=...)    # any sampling: it has InferenceModel's surface

The step is the recipe's model (``andrea/engine/recipe.py``: per block ln1, qkv, attention, out,
residual, ln2, MLP, residual; then lnf and the tied head) on one row, fused into 5 launches per
block (``decode.cu``): LayerNorm + qkv matmul writing k, v straight into the cache; attention over
the cache split into blocks of positions with an in-order combine; out matmul + residual add;
LayerNorm + fc matmul + GELU; proj matmul + residual add. The matmuls read a transposed copy
of the weights in the compute dtype (W^T, one warp per output row, 16-byte loads: decode is a
weight-streaming GEMV). Static shapes: the token and its position live on the device (``state``),
so every launch has the same arguments at every step. Two graphs are captured once: ``logits``
(feed ``state[0]`` at ``state[1]``, write the logits (V,) fp32, advance the position) and
``greedy`` (the same, then the arg-max becomes the next ``state[0]`` and is appended to the
device's id buffer). ``greedy`` copies the ids back once per chunk; other sampling reads the
logits row to the host and uses ``andrea.generate``'s sampler (float64, seeded).

Precision: fp32, bf16 or fp16 storage with fp32 arithmetic, rounded where the engine's ``FastOps``
rounds (LayerNorm outputs, matmul outputs, the GELU output, the KV cache); the residual stream and
LayerNorm statistics are fp32. NumPy twins: the ``ref_*`` functions below, kernel by kernel
(float64 arithmetic on the same rounded inputs), and ``InferenceModel`` for the whole step
(tests/test_generate_decode_gpu.py, tests/test_generate_decode.py).
"""

from __future__ import annotations

import math

import numpy as np

from andrea.cuda.kernels import SUFFIX, cp, k_cast
from andrea.cuda.loader import kernel
from andrea.engine.fp8_numpy import bf16_to_f32, f32_to_bf16
from andrea.engine.model import ModelConfig, param_layout
from andrea.engine.ops_numpy import GELU_A, GELU_K
from andrea.errors import AndreaError

ATTN_THREADS = 128
ATTN_CHUNK = 64            # positions per attention block (DEC_CH of decode.cu)
LN_EPS = 1e-5
MODE_QKV, MODE_GELU, MODE_LOGITS = 0, 1, 2
MODES = ("logits", "greedy", "sample")     # the graphs: what follows the logits (advance / arg-max / draw)
SAMPLE_CHUNK = 32          # tokens drawn on the device per copy back to the host
VEC = {"fp32": 4, "bf16": 8, "fp16": 8}   # elements per 16-byte load


# ------------------------------------------------------------------ NumPy twins of decode.cu
def round_to(prec: str, a) -> np.ndarray:
    """``a`` rounded to the storage type (bf16: round to nearest even), as float64; "fp64" keeps it."""
    if prec == "fp64":
        return np.asarray(a, dtype=np.float64)
    a = np.asarray(a, dtype=np.float32)
    if prec == "fp32":
        return a.astype(np.float64)
    if prec == "fp16":
        return a.astype(np.float16).astype(np.float64)
    return bf16_to_f32(f32_to_bf16(a)).astype(np.float64)


def _gelu(u: np.ndarray) -> np.ndarray:
    return u / (1.0 + np.exp(-2.0 * GELU_K * (u + GELU_A * u ** 3)))


def ref_ln_gemv(prec: str, x, g, b, wT, mode: int) -> np.ndarray:
    """k_dec_ln_gemv: acc = W^T round(LayerNorm(x) g + b); qkv: round(acc), gelu:
    round(gelu(round(acc))), logits: acc (the qkv split into q and the caches is the caller's)."""
    x = np.asarray(x, np.float64)
    mu = x.mean()
    h = round_to(prec, (x - mu) / np.sqrt(((x - mu) ** 2).mean() + LN_EPS) * g + b)
    acc = np.asarray(wT, np.float64) @ h
    if mode == MODE_LOGITS:
        return acc
    if mode == MODE_GELU:
        return round_to(prec, _gelu(round_to(prec, acc)))
    return round_to(prec, acc)


def ref_gemv_res(prec: str, x, a, wT) -> np.ndarray:
    """k_dec_gemv_res: x + round(W^T a)."""
    return np.asarray(x, np.float64) + round_to(prec, np.asarray(wT, np.float64) @ np.asarray(a, np.float64))


def ref_attn(prec: str, q, k, v, n: int, scale: float, chunk: int = ATTN_CHUNK) -> np.ndarray:
    """k_dec_attn for one head: q (D,), k, v (>= n, D) -> y (D,) over positions 0..n-1, computed
    as the kernel does: per chunk of positions its max m, l = sum exp(s - m) and sum exp(s - m) v,
    then the combine in chunk order. Equal to softmax(q k^T scale) v up to rounding."""
    k, v = np.asarray(k[:n], np.float64), np.asarray(v[:n], np.float64)
    s = k @ (np.asarray(q, np.float64) * scale)
    parts = []
    for t0 in range(0, n, chunk):
        sc = s[t0:t0 + chunk]
        m = sc.max()
        e = np.exp(sc - m)
        parts.append((m, e.sum(), e @ v[t0:t0 + chunk]))
    M = max(p[0] for p in parts)
    w = [math.exp(p[0] - M) for p in parts]
    L = sum(wi * p[1] for wi, p in zip(w, parts))
    return round_to(prec, sum(wi * p[2] for wi, p in zip(w, parts)) / L)


GOLDEN = 0x9E3779B97F4A7C15
MASK64 = (1 << 64) - 1


def splitmix64(z: int) -> int:
    """One splitmix64 output for the state ``z`` (the state is first advanced by the golden gamma)."""
    z = (z + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def ref_uniform(seed: int, counter: int) -> float:
    """k_dec_sample's uniform in [0, 1) for draw ``counter`` of the generation seeded ``seed``: a
    counter-based RNG, so the stream depends only on (seed, counter), never on launch order."""
    return (splitmix64((seed + counter * GOLDEN) & MASK64) >> 40) / float(1 << 24)


def _okey(l: np.ndarray) -> np.ndarray:
    """decode.cu's okey: an order-preserving uint32 key of float32 values."""
    u = np.asarray(l, np.float32).view(np.uint32)
    return np.where(u & 0x80000000, ~u, u | 0x80000000).astype(np.uint32)


def ref_sample(logits, temperature: float, top_k: int, top_p: float, u: float, eps: float = 1e-5):
    """k_dec_sample's rule in float64: (the token, whether the draw is ambiguous). The rule is
    andrea.generate's (``draw(next_token_probs(...))`` with the uniform ``u``): temperature 0 the
    first arg-max; top-k keeps logits >= the k-th largest; e = exp((l - max) / temperature); top-p
    keeps the most likely (ties in index order) up to the first reaching top_p sum(e); the first
    index whose prefix sum of the kept e exceeds u sum. ``ambiguous``: a sum the outcome turns on
    lies within ``eps`` (relative) of its threshold, where fp32 on the device may decide otherwise."""
    l = np.asarray(logits, np.float32).copy()
    l[np.isnan(l)] = -np.inf
    V = l.size
    if temperature == 0:
        return int(np.argmax(l)), False
    keep = np.ones(V, dtype=bool)
    if 0 < top_k < V:
        keys = _okey(l)
        keep = keys >= np.sort(keys)[V - top_k]
    l64 = l.astype(np.float64)
    with np.errstate(invalid="ignore"):
        e = np.where(keep, np.exp((l64 - l64.max()) / temperature), 0.0)
    e = np.nan_to_num(e, nan=0.0)
    S = e.sum()
    ambiguous = False
    if top_p < 1.0:
        target = np.float64(np.float32(top_p)) * S
        order = np.argsort(-e, kind="stable")
        csum = np.cumsum(e[order])
        n_keep = int(np.searchsorted(csum, target, side="left")) + 1
        ambiguous |= any(abs(csum[j] - target) <= eps * S for j in (n_keep - 2, n_keep - 1) if 0 <= j < V)
        top = np.zeros(V, dtype=bool)
        top[order[:n_keep]] = True
        e = np.where(top, e, 0.0)
    cdf = np.cumsum(e)
    W = cdf[-1]
    r = u * W
    i = int(np.searchsorted(cdf, r, side="right"))
    if i >= V or e[i] == 0:
        i = int(np.flatnonzero(e)[-1])
    ambiguous |= bool(np.any(np.abs(cdf[e > 0] - r) <= eps * W))
    return i, ambiguous


def ref_decode(mc: ModelConfig, params: np.ndarray, ids, prec: str = "fp32") -> np.ndarray:
    """The logits (n, V) of feeding ``ids`` one by one from position 0 through the twins above,
    wired as ``GraphDecoder._step`` (the CPU check of the step's wiring: tests/test_generate_decode.py)."""
    lay = param_layout(mc)
    w = {t.name: np.asarray(params[t.offset:t.offset + t.size], np.float64).reshape(t.shape) for t in lay.tensors}
    wT = {k: round_to(prec, v.T) for k, v in w.items() if k.endswith(("w_qkv", "w_o", "w_fc", "w_proj"))}
    head = round_to(prec, w["wte"])
    L, H, T, C, D = mc.n_layer, mc.n_head, mc.context, mc.d_model, mc.head_dim
    kc, vc = np.zeros((L, H, T, D)), np.zeros((L, H, T, D))
    out = []
    for pos, tok in enumerate(np.asarray(ids).reshape(-1).tolist()):
        x = np.asarray(w["wte"][tok] + w["wpe"][pos], np.float32).astype(np.float64)
        for l in range(L):
            p = f"h.{l}."
            qkv = ref_ln_gemv(prec, x, w[p + "ln1.g"], w[p + "ln1.b"], wT[p + "attn.w_qkv"], MODE_QKV)
            kc[l, :, pos] = qkv[C:2 * C].reshape(H, D)
            vc[l, :, pos] = qkv[2 * C:].reshape(H, D)
            y = np.concatenate([ref_attn(prec, qkv[h * D:(h + 1) * D], kc[l, h], vc[l, h], pos + 1, 1 / math.sqrt(D))
                                for h in range(H)])
            x = ref_gemv_res(prec, x, y, wT[p + "attn.w_o"])
            a = ref_ln_gemv(prec, x, w[p + "ln2.g"], w[p + "ln2.b"], wT[p + "mlp.w_fc"], MODE_GELU)
            x = ref_gemv_res(prec, x, a, wT[p + "mlp.w_proj"])
        out.append(ref_ln_gemv(prec, x, w["lnf.g"], w["lnf.b"], head, MODE_LOGITS))
    return np.stack(out)


# ------------------------------------------------------------------------------ the decoder
class _Backend:
    """What ``andrea.generate.generate`` needs of a backend: ``to_host``."""

    def __init__(self, xp):
        self.xp = xp

    def to_host(self, a) -> np.ndarray:
        return self.xp.asnumpy(a)

    def synchronize(self) -> None:
        self.xp.cuda.get_current_stream().synchronize()


def launch_geometry(N: int) -> tuple[int, int]:
    """(blocks, threads) of the GEMV kernels: one warp per output row, 4 or 8 warps a block."""
    warps = 4 if N <= 2048 else 8
    return (N + warps - 1) // warps, 32 * warps


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
        ve = VEC[precision]
        if mc.head_dim % ve or mc.d_model % ve or mc.head_dim > ve * ATTN_THREADS:
            raise AndreaError(f"decode: head size {mc.head_dim} and width {mc.d_model} must be multiples of {ve} "
                              f"({precision} 16-byte loads), the head size at most {ve * ATTN_THREADS}")
        if 4 * 4 * mc.d_model > 48 * 1024:
            raise AndreaError(f"decode: width {mc.d_model} > 3072 (the MLP input row is kept in 48 KB of shared memory)")
        self.mc, self.xp, self.prec, self.use_graph = mc, xp, precision, use_graph
        self.be = _Backend(xp)
        self.n_params = lay.n_params
        self.stream = xp.cuda.Stream(non_blocking=True)
        low = np.float32 if precision == "fp32" else np.uint16
        L, H, T, C, V, D = mc.n_layer, mc.n_head, mc.context, mc.d_model, mc.vocab_size, mc.head_dim
        self.n_split = (T + ATTN_CHUNK - 1) // ATTN_CHUNK
        with self.stream:
            self.params = params
            self.W = {t.name: params[t.offset:t.offset + t.size].reshape(t.shape) for t in lay.tensors}
            # the matmul weights transposed, (out, in), in the compute dtype; the tied head wte is (V, C) already
            self.WT = {f"h.{l}.{k}": xp.empty(self.W[f"h.{l}.{k}"].shape[::-1], dtype=low)
                       for l in range(L) for k in ("attn.w_qkv", "attn.w_o", "mlp.w_fc", "mlp.w_proj")}
            self.WT["wte"] = xp.empty((V, C), dtype=low)
            self.k_cache = xp.zeros((L, H, T, D), dtype=low)
            self.v_cache = xp.zeros((L, H, T, D), dtype=low)
            self.state = xp.zeros(4, dtype=np.int32)           # token, position, n ids out, unused
            self.out_ids = xp.zeros(T + 1, dtype=np.int32)
            self.x = xp.zeros((1, C), dtype=np.float32)         # residual stream
            self.q = xp.zeros((1, C), dtype=low)
            self.y = xp.zeros((1, C), dtype=low)
            self.h_act = xp.zeros((1, 4 * C), dtype=low)
            self.logits = xp.zeros((1, V), dtype=np.float32)
            self.part = xp.zeros(H * self.n_split * (D + 2), dtype=np.float32)   # attention partials
            self.ticket = xp.zeros(H, dtype=np.int32)
            self.samp_opts = xp.zeros(4, dtype=np.float32)      # temperature, top_p, top_k, 0
            self.rng_state = xp.zeros(2, dtype=np.uint64)       # seed, draws so far
            self.escratch = xp.zeros(V, dtype=np.float32)
        s = SUFFIX[precision]
        self._k_embed = kernel("decode.cu", "k_dec_embed")
        self._k_ln_gemv = kernel("decode.cu", f"k_dec_ln_gemv_{s}")
        self._k_gemv_res = kernel("decode.cu", f"k_dec_gemv_res_{s}")
        self._k_attn = kernel("decode.cu", f"k_dec_attn_{s}")
        self._k_argmax = kernel("decode.cu", "k_dec_argmax")
        self._k_advance = kernel("decode.cu", "k_dec_advance")
        self._k_sample = kernel("decode.cu", "k_dec_sample")
        self._scale = np.float32(1.0 / math.sqrt(D))
        G = ATTN_THREADS // (D // ve)
        self._attn_smem = 4 * (D + ATTN_CHUNK + G * D + self.n_split + 32)
        self.refresh_weights()
        self.pos = 0
        self.graphs = {}
        self._capture()

    # ------------------------------------------------------------------ the step
    def refresh_weights(self) -> None:
        """Re-derive the transposed compute-dtype matmul copies from the fp32 parameters."""
        xp = self.xp
        with self.stream:
            for name, dst in self.WT.items():
                src = self.W[name] if name == "wte" else xp.ascontiguousarray(self.W[name].T)
                if self.prec == "fp32":
                    dst[...] = src
                else:
                    k_cast(self.prec, dst, xp.ascontiguousarray(src), src.size)
        self.stream.synchronize()

    def ln_gemv(self, x, g, b, wT, mode: int, out, kc=None, vc=None) -> None:
        """One k_dec_ln_gemv launch: LayerNorm(x) (C,) then W^T (N, C), the epilogue ``mode``."""
        N, K = wT.shape
        blocks, threads = launch_geometry(N)
        self._k_ln_gemv((blocks,), (threads,), (x, g, b, wT, np.int32(N), np.int32(K), np.int32(mode), out,
                                                 out if kc is None else kc, out if vc is None else vc, self.state,
                                                 np.int32(self.mc.head_dim), np.int32(self.mc.context),
                                                 np.float32(LN_EPS)), shared_mem=4 * K)

    def gemv_res(self, a, wT, x) -> None:
        """One k_dec_gemv_res launch: x (C,) += round(W^T a)."""
        N, K = wT.shape
        blocks, threads = launch_geometry(N)
        self._k_gemv_res((blocks,), (threads,), (a, wT, np.int32(N), np.int32(K), x), shared_mem=4 * K)

    def attn(self, k_cache, v_cache) -> None:
        """One k_dec_attn launch: self.y = attention of self.q over positions 0..state[1]."""
        mc = self.mc
        self._k_attn((mc.n_head, self.n_split), (ATTN_THREADS,),
                     (self.q, k_cache, v_cache, self.y, self.state, self.part, self.ticket, np.int32(mc.n_head),
                      np.int32(mc.context), np.int32(mc.head_dim), self._scale), shared_mem=self._attn_smem)

    def _step(self, mode: str) -> None:
        mc, W, WT = self.mc, self.W, self.WT
        self._k_embed((max(1, (mc.d_model + 255) // 256),), (256,),
                      (W["wte"], W["wpe"], self.state, self.x, np.int32(mc.d_model)))
        for l in range(mc.n_layer):
            p = f"h.{l}."
            self.ln_gemv(self.x, W[p + "ln1.g"], W[p + "ln1.b"], WT[p + "attn.w_qkv"], MODE_QKV, self.q,
                         self.k_cache[l], self.v_cache[l])
            self.attn(self.k_cache[l], self.v_cache[l])
            self.gemv_res(self.y, WT[p + "attn.w_o"], self.x)
            self.ln_gemv(self.x, W[p + "ln2.g"], W[p + "ln2.b"], WT[p + "mlp.w_fc"], MODE_GELU, self.h_act)
            self.gemv_res(self.h_act, WT[p + "mlp.w_proj"], self.x)
        self.ln_gemv(self.x, W["lnf.g"], W["lnf.b"], WT["wte"], MODE_LOGITS, self.logits)
        if mode == "greedy":
            self._k_argmax((1,), (1024,), (self.logits, np.int32(mc.vocab_size), self.state, self.out_ids, np.int32(1)))
        elif mode == "sample":
            self.draw(advance=1)
        else:
            self._k_advance((1,), (32,), (self.state,))

    def draw(self, advance: int = 0) -> None:
        """One k_dec_sample launch: a token from ``self.logits`` by the options and RNG state set
        with ``set_sampling`` into ``state[0]`` and the id buffer; the position moves by ``advance``."""
        self._k_sample((1,), (1024,), (self.logits, np.int32(self.mc.vocab_size), self.samp_opts, self.rng_state,
                                       self.state, self.out_ids, self.escratch, np.int32(advance)))

    def set_sampling(self, temperature: float, top_k: int, top_p: float, seed: int, counter: int = 0) -> None:
        """The device sampler's options and RNG state (seed, draws so far) for the next draws."""
        with self.stream:
            self.samp_opts.set(np.array([temperature, top_p, top_k, 0], dtype=np.float32), stream=self.stream)
            self.rng_state.set(np.array([int(seed) & MASK64, counter], dtype=np.uint64), stream=self.stream)
        self.stream.synchronize()

    def _capture(self) -> None:
        """One eager run of each step (modules load, cuBLAS sets up outside the capture), then capture."""
        with self.stream:
            self.samp_opts.set(np.array([1.0, 1.0, 0, 0], dtype=np.float32), stream=self.stream)
            for mode in MODES:
                self.state.fill(0)
                self._step(mode)
            self.stream.synchronize()
            if self.use_graph:
                for mode in MODES:
                    self.stream.begin_capture()
                    try:
                        self._step(mode)
                    finally:
                        graph = self.stream.end_capture()
                    self.graphs[mode] = graph
            self.state.fill(0)
            self.rng_state.fill(0)
        self.stream.synchronize()

    def _launch(self, mode: str) -> None:
        if self.use_graph:
            self.graphs[mode].launch(self.stream)
        else:
            self._step(mode)

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
                self._launch("logits")
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
                    self._launch("greedy")
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

    def sample_chunks(self, prompt, opts, seed: int, n: int):
        """Yield the ids of ``n`` tokens after ``prompt`` drawn ON THE DEVICE (k_dec_sample, inside
        the ``sample`` graph: opts' temperature, top_k and top_p; the counter RNG seeded ``seed``),
        ``SAMPLE_CHUNK`` at a time (the caller stops early by not asking for more); past the context
        the last ``context // 2`` tokens are re-fed, as ``andrea.generate.generate`` does."""
        seq = [int(t) for t in np.asarray(prompt).reshape(-1)]
        T, keep = self.mc.context, max(1, self.mc.context // 2)
        self.set_sampling(opts.temperature, opts.top_k, opts.top_p, seed)
        self.reset()
        self.forward(seq if len(seq) <= T else seq[-keep:])
        fresh, made = True, 0                 # fresh: the logits of a re-fed window, no token drawn from them yet
        while made < n:
            if self.pos >= T and not fresh:
                self.reset()
                self.forward(seq[-keep:])
                fresh = True
            k = min(n - made, SAMPLE_CHUNK, T - self.pos + (1 if fresh else 0))
            launches = k - (1 if fresh else 0)
            with self.stream:
                self.state[2:3].fill(0)
                if fresh:
                    self.draw(advance=0)
                for _ in range(launches):
                    self._launch("sample")
                got = self.out_ids[:k].get(stream=self.stream).tolist()
            self.stream.synchronize()
            self.pos += launches
            fresh, made = False, made + k
            seq += got
            yield got
