"""Text generation from an ANDREA model: a KV-cache forward, sampling, and ``andrea sample``.

    andrea sample runs/tiny/main --prompt "The list type" --max-new-tokens 64 --temperature 0.8 --top-k 40 --seed 1

(the profile and tokenizer come from the run folder: its model.state.json's config, and
data/tokenizer/<variant>/tokenizer.json checked by the recorded sha256; --profile and
--tokenizer override them).

In code (the curriculum's coherence check calls this on the training weights):

    from andrea.generate import InferenceModel, SamplingOptions, generate
    im = InferenceModel(model_config, flat_params)            # views into the SAME flat buffer
    out = generate(im, tok.encode("Hello"), SamplingOptions(max_new_tokens=48, temperature=0.8, top_k=40),
                   rng=np.random.default_rng(1), eot_id=tok.eot_id)
    tok.decode(out.ids)

``InferenceModel`` runs the model of ``andrea.engine.model`` (pre-LN GPT, tied
embeddings, learned positions, GELU-tanh MLP) on top of the flat fp32 parameter buffer
the engine trains, one view per tensor (no copy: new weights are seen at once). It keeps
a key/value cache per layer, so the prompt costs one forward over its tokens and each
new token costs one position. It runs the model of ``andrea/engine/recipe.py`` (the same
``block_forward`` and ``head_forward`` as training) with the backend's own op functions
(``backend.ops``); only the attention op is its own, against the cache. It runs on whatever
array module the backend has (NumPy, or CuPy on the GPU); sampling runs on the host in
float64 with a seeded ``numpy.random.Generator``, so the same seed gives the same text. On
the GPU decoder (``fast_model``: ``andrea.cuda.decode.GraphDecoder``) the same rule runs on the
device inside the token's CUDA graph, its counter RNG seeded by one draw of that Generator.
``generate_batch`` decodes many prompts together, each getting the tokens it gets alone.

When a sequence outgrows the context (learned positions stop there), the cache is
rebuilt from the last ``context // 2`` tokens and generation goes on from there.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Sequence

import numpy as np

from andrea.engine import pool, recipe
from andrea.engine.backend import NumpyBackend
from andrea.engine.model import ModelConfig, param_layout
from andrea.errors import AndreaError


# ------------------------------------------------------------------------- sampling
@dataclass(frozen=True)
class SamplingOptions:
    """How to pick tokens. temperature 0 means greedy; top_k 0 and top_p 1 mean no cut."""

    max_new_tokens: int = 64
    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    stop_at_eot: bool = True
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self):
        if int(self.max_new_tokens) < 0:
            raise AndreaError(f"max_new_tokens: must be >= 0, got {self.max_new_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise AndreaError(f"temperature: must be a finite number >= 0, got {self.temperature}")
        if int(self.top_k) < 0:
            raise AndreaError(f"top_k: must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise AndreaError(f"top_p: must be in (0, 1], got {self.top_p}")


def next_token_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Sampling distribution (V,) float64 from one row of logits (V,).

    Temperature divides the logits (0: all mass on the arg-max, first on ties); top-k keeps
    the k largest logits (ties at the k-th value are all kept); top-p then keeps the
    smallest set of most likely tokens whose mass reaches p. The result sums to 1.
    """
    logits = np.asarray(logits, dtype=np.float64).reshape(-1)
    V = logits.size
    if not np.isfinite(logits).any():
        raise AndreaError("sampling: every logit is NaN or infinite (the model weights are broken)")
    logits = np.where(np.isnan(logits), -np.inf, logits)
    if temperature == 0:
        p = np.zeros(V)
        p[int(np.argmax(logits))] = 1.0
        return p
    z = logits / temperature
    if 0 < top_k < V:
        kth = np.partition(z, V - top_k)[V - top_k]
        z = np.where(z < kth, -np.inf, z)
    z = z - np.max(z)
    p = np.exp(z)
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        csum = np.cumsum(p[order])
        n_keep = int(np.searchsorted(csum, top_p * csum[-1], side="left")) + 1
        keep = np.zeros(V, dtype=bool)
        keep[order[:n_keep]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """One id from the distribution ``p`` (V,), by inverse CDF with one ``rng.random()`` draw."""
    cdf = np.cumsum(p)
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    if i >= p.size or p[i] == 0:          # float edge at the very top of the CDF
        i = int(np.flatnonzero(p)[-1])
    return i


# ---------------------------------------------------------------- KV-cache forward
class _CachedAttention:
    """The backend's op set with ``attn_forward`` replaced by the KV-cache attention."""

    def __init__(self, ops, attn_forward):
        self._ops, self.attn_forward = ops, attn_forward

    def __getattr__(self, name):
        return getattr(self._ops, name)


class _RowExact(_CachedAttention):
    """NumPy ops for n independent one-token rows that give each row the bits of a one-row call:
    the matmuls on (n, 1, .) stacked views (NumPy runs one BLAS gemv per row, as for one row),
    LayerNorm and the tied head one row at a time (their row reductions are gemv/gemm over all
    rows at once, whose bits depend on the row count); the rest is elementwise."""

    def layernorm_forward(self, out, mean, rstd, x, g, b):
        for i in range(x.shape[0]):
            self._ops.layernorm_forward(out[i:i + 1], mean[i:i + 1], rstd[i:i + 1], x[i:i + 1], g, b)

    def residual_layernorm_forward(self, xo, out, mean, rstd, a, b, g, beta):
        self._ops.residual_add_forward(xo, a, b)
        self.layernorm_forward(out, mean, rstd, xo, g, beta)

    def attn_qkv_forward(self, qkv, x, w_qkv):
        self._ops.attn_qkv_forward(qkv[:, None], x[:, None], w_qkv)

    def attn_out_forward(self, out, y, w_o):
        self._ops.attn_out_forward(out[:, None], y[:, None], w_o)

    def mlp_forward(self, out, h_pre, h_act, x, w_fc, w_proj):
        self._ops.mlp_forward(out[:, None], h_pre[:, None], h_act[:, None], x[:, None], w_fc, w_proj)

    def loss_forward(self, losses, logits, probs, x, wte, targets, work):
        for i in range(x.shape[0]):
            self._ops.loss_forward(losses[i:i + 1], logits[i:i + 1], probs[i:i + 1], x[i:i + 1], wte, targets, work)


class InferenceModel:
    """The engine's model for inference, one position at a time, with a key/value cache.

    ``params`` is the flat fp32 parameter buffer (n_params,) in the layout of
    ``andrea.engine.model.param_layout`` (the engine's training weights, or a loaded
    checkpoint); this object only takes views of it. ``backend`` supplies ``xp`` and the
    op functions (default: NumPy). Every buffer is allocated here, once.
    """

    def __init__(self, mc: ModelConfig, params, backend=None, slots: int = 1):
        self.mc = mc
        self.be = backend if backend is not None else NumpyBackend()
        xp, ops = self.be.xp, self.be.ops
        self.xp, self.ops = xp, ops
        self.cached_ops = _CachedAttention(ops, self.attn_forward)   # the recipe's ops, attention on the cache
        layout = param_layout(mc)
        if params.ndim != 1 or params.shape[0] != layout.n_params:
            raise AndreaError(f"model weights: expected a flat buffer of {layout.n_params} parameters for "
                              f"{mc}, got shape {tuple(params.shape)}")
        self.dtype = params.dtype
        self.params = params                        # the flat buffer itself (views below alias it)
        self.w = {t.name: params[t.offset:t.offset + t.size].reshape(t.shape) for t in layout.tensors}
        self.n_params = layout.n_params
        L, H, T, C, V, D = mc.n_layer, mc.n_head, mc.context, mc.d_model, mc.vocab_size, mc.head_dim
        if int(slots) < 1:
            raise AndreaError(f"InferenceModel: slots must be >= 1, got {slots}")
        f = self.dtype
        # per slot (one sequence each), (L, H, T, D) keys and values of every position seen so far
        self.slots = int(slots)
        self.k_all = xp.zeros((self.slots, L, H, T, D), dtype=f)
        self.v_all = xp.zeros((self.slots, L, H, T, D), dtype=f)
        self.k_cache, self.v_cache = self.k_all[0], self.v_all[0]     # the selected slot's
        self.slot, self.slot_pos = 0, [0] * self.slots
        self.row_ops = _RowExact(ops, self._attn_rows) if xp is np else _CachedAttention(ops, self._attn_rows)
        self._rows: list[tuple[int, int]] = []        # (slot, position) of each row of forward_rows
        T = max(T, self.slots)                      # row buffers: a prompt's tokens or one row per slot
        self.idx = xp.zeros((T,), dtype=xp.int32)
        self.x = xp.zeros((T, C), dtype=f)          # residual stream of the new rows
        self.h = xp.zeros((T, C), dtype=f)          # LayerNorm output
        self.mean = xp.zeros((T,), dtype=f)
        self.rstd = xp.zeros((T,), dtype=f)
        self.qkv = xp.zeros((T, 3 * C), dtype=f)
        self.y = xp.zeros((T, C), dtype=f)          # attention heads concatenated
        self.branch = xp.zeros((T, C), dtype=f)     # sublayer output before the residual add
        self.h_pre = xp.zeros((T, 4 * C), dtype=f)
        self.h_act = xp.zeros((T, 4 * C), dtype=f)
        self.att = xp.zeros((H * mc.context * mc.context,), dtype=f)  # scores (H, n, p + n), carved per call
        self.att_stat = xp.zeros((H * T,), dtype=f)
        self.logits = xp.zeros((T, V), dtype=f)
        self.probs = xp.zeros((T, V), dtype=f)
        self.losses = xp.zeros((T,), dtype=f)
        self.work = xp.zeros((T,), dtype=f)
        T = mc.context
        mask = np.triu(np.full((T, T), -np.inf, dtype=np.float64), k=1).astype(f)
        self.mask = xp.asarray(mask)                # (T, T): 0 on/below the diagonal, -inf above
        self.pos = 0

    def load_weights(self, host_weights: np.ndarray) -> None:
        """Copy another checkpoint's flat weights (host, n_params) into the viewed buffer."""
        if host_weights.shape != (self.n_params,):
            raise AndreaError(f"load_weights: expected {self.n_params} weights, got shape {host_weights.shape}")
        self.be.copy_from_host(self.params, host_weights)
        self.reset()

    @property
    def context(self) -> int:
        return self.mc.context

    def reset(self) -> None:
        """Forget the selected slot's cache: the next ``forward`` starts at position 0."""
        self.pos = 0

    def select(self, slot: int) -> None:
        """Make ``slot`` the sequence that ``forward``, ``reset`` and ``pos`` act on."""
        if not 0 <= slot < self.slots:
            raise AndreaError(f"InferenceModel: slot {slot} outside [0, {self.slots})")
        self.slot_pos[self.slot] = self.pos
        self.slot, self.pos = slot, self.slot_pos[slot]
        self.k_cache, self.v_cache = self.k_all[slot], self.v_all[slot]

    def position(self, slot: int) -> int:
        """How many positions ``slot``'s cache holds."""
        return self.pos if slot == self.slot else self.slot_pos[slot]

    def attn_forward(self, out, att, qkv, mask, n_head: int, work) -> None:
        """The attention op of the recipe, against the cache: ``att`` is layer l's (k, v) cache
        (H, T, D) each; the n new rows (positions pos..pos+n-1) are appended, then attend to it."""
        self._attend(out, att, qkv, n_head, self.pos)

    def _attn_rows(self, out, att, qkv, mask, n_head: int, work) -> None:
        """``forward_rows``' attention op: ``att`` is the layer index; row i (out (n, 1, C), qkv
        (n, 1, 3C)) attends to its own slot's cache, as ``attn_forward`` of that row alone."""
        for i, (slot, p) in enumerate(self._rows):
            self._attend(out[i:i + 1], (self.k_all[slot, att], self.v_all[slot, att]), qkv[i:i + 1], n_head, p)

    def _attend(self, out, att, qkv, n_head: int, p: int) -> None:
        xp = self.xp
        k_cache, v_cache = att
        H, D = n_head, self.mc.head_dim
        n = qkv.shape[1]
        S = p + n
        qkv = qkv.reshape(n, 3, H, D)
        k_cache[:, p:S] = qkv[:, 1].transpose(1, 0, 2)
        v_cache[:, p:S] = qkv[:, 2].transpose(1, 0, 2)
        q = qkv[:, 0].transpose(1, 0, 2)                                  # (H, n, D) view
        att = self.att[:H * n * S].reshape(H, n, S)
        stat = self.att_stat[:H * n].reshape(H, n, 1)
        xp.matmul(q, k_cache[:, :S].swapaxes(-1, -2), out=att)             # (H, n, S)
        att *= self.dtype.type(1.0 / math.sqrt(D))
        if n > 1:
            att += self.mask[p:S, :S]
        xp.max(att, axis=-1, keepdims=True, out=stat)
        att -= stat
        xp.exp(att, out=att)
        xp.sum(att, axis=-1, keepdims=True, out=stat)
        att /= stat
        y = out.reshape(n, H, D).transpose(1, 0, 2)                       # (H, n, D) view into out
        y[...] = xp.matmul(att, v_cache[:, :S])

    def _views(self, n: int, rows: slice) -> SimpleNamespace:
        """The recipe's views of the n new rows: the residual stream x is updated in place
        (x_in = x_mid = x_out), the block scratch is shared by the layers, and each layer's
        saved attention state is its (k, v) cache; the head sees only ``rows``."""
        w, C = self.w, self.mc.d_model
        x, h, mean, rstd = self.x[:n], self.h[:n], self.mean[:n], self.rstd[:n]
        m = rows.stop - rows.start
        z = SimpleNamespace(idx=self.idx[:n].reshape(1, n), emb3=x.reshape(1, n, C), wte=w["wte"],
                            wpe=w["wpe"][self.pos:], branch=self.branch[:n], mask=None, work=self.work,
                            res_last=x[rows], lnf=h[rows], lnf_mean=mean[rows], lnf_rstd=rstd[rows],
                            lnf_g=w["lnf.g"], lnf_b=w["lnf.b"], wte_head=w["wte"], logits=self.logits[:m],
                            probs=self.probs[:m], losses=self.losses[:m], targets=None, layers=[])
        qkv, y = self.qkv[:n], self.y[:n]
        for l in range(self.mc.n_layer):
            p = f"h.{l}."
            z.layers.append(SimpleNamespace(
                x_in=x, x_mid=x, x_out=x, ln1=h, ln1_mean=mean, ln1_rstd=rstd, ln2=h, ln2_mean=mean, ln2_rstd=rstd,
                qkv=qkv, qkv3=qkv.reshape(1, n, 3 * C), att=(self.k_cache[l], self.v_cache[l]),
                atty=y, atty3=y.reshape(1, n, C), h_pre=self.h_pre[:n], h_act=self.h_act[:n],
                **{k.replace(".", "_"): w[p + k] for k in recipe.BLOCK_WEIGHTS}))
        return z

    def forward_rows(self, slots: Sequence[int], ids: Sequence[int]):
        """Feed one token to each of the (distinct) ``slots``, each at its own position, as one
        batch; the logits (n, V) (a view of an internal buffer). Row i gives the bits that
        ``select(slots[i]); forward([ids[i]])`` gives on NumPy (the matmuls run on (n, 1, .)
        stacked views, one BLAS call per row; LayerNorm and the head row by row); on CuPy the
        matmuls are one GEMM over the rows (equal up to fp32 summation order)."""
        slots, ids = [int(s) for s in slots], np.asarray(ids, dtype=np.int32).reshape(-1)
        n = len(slots)
        if n == 0 or ids.size != n or len(set(slots)) != n:
            raise AndreaError(f"forward_rows: need one token per distinct slot, got slots {slots} and {ids.size} ids")
        self.slot_pos[self.slot] = self.pos
        pos = [self.slot_pos[s] for s in slots]
        if max(pos) >= self.mc.context or min(slots) < 0 or max(slots) >= self.slots:
            raise AndreaError(f"forward_rows: slot outside [0, {self.slots}) or past the context of {self.mc.context}")
        if ids.min() < 0 or ids.max() >= self.mc.vocab_size:
            raise AndreaError(f"forward_rows: token id outside [0, {self.mc.vocab_size})")
        self.be.copy_from_host(self.idx[:n], ids)
        w, C = self.w, self.mc.d_model
        z = self._views(n, slice(0, n))
        for l, s in enumerate(z.layers):
            s.att, s.qkv3, s.atty3 = l, s.qkv.reshape(n, 1, 3 * C), s.atty.reshape(n, 1, C)
        self._rows = list(zip(slots, pos))
        # BLAS on one thread as for ``forward`` of one row (the rows run in turn on this thread)
        with pool.blas_single_threaded() if self.xp is np else contextlib.nullcontext():
            for i, p in enumerate(pos):
                self.ops.embed_forward(z.emb3[:, i:i + 1], self.idx[i:i + 1].reshape(1, 1), w["wte"], w["wpe"][p:])
            for s in z.layers:
                recipe.block_forward(self.row_ops, s, z.branch, None, self.mc.n_head, self.work)
            recipe.head_forward(self.row_ops, z, with_targets=False)
        for sl in slots:
            self.slot_pos[sl] += 1
        self.pos = self.slot_pos[self.slot]
        return z.logits

    def forward(self, ids, all_logits: bool = False):
        """Feed ``ids`` (n,) at positions pos..pos+n-1; return logits (n, V) or, by default,
        only the last row's (1, V). The rows are views of an internal buffer (copy to keep)."""
        ids = np.asarray(ids, dtype=np.int32).reshape(-1)
        n = ids.size
        if n == 0:
            raise AndreaError("forward: no tokens to feed")
        if self.pos + n > self.mc.context:
            raise AndreaError(f"forward: {self.pos} cached + {n} new tokens exceed the context of {self.mc.context}")
        if ids.min() < 0 or ids.max() >= self.mc.vocab_size:
            raise AndreaError(f"forward: token id outside [0, {self.mc.vocab_size})")
        self.be.copy_from_host(self.idx[:n], ids)
        z = self._views(n, slice(0, n) if all_logits else slice(n - 1, n))
        # one row does not split over the op pool, so on NumPy its GEMVs would run on BLAS's own
        # threads, a handshake per call: one thread is faster (bench/generate.py, numpy rows)
        with pool.blas_single_threaded() if n == 1 and self.xp is np else contextlib.nullcontext():
            self.ops.embed_forward(z.emb3, z.idx, z.wte, z.wpe)
            for s in z.layers:
                recipe.block_forward(self.cached_ops, s, z.branch, None, self.mc.n_head, self.work)
            self.pos += n
            recipe.head_forward(self.ops, z, with_targets=False)
        return z.logits


# ----------------------------------------------------------------------- generation
@dataclass
class Generation:
    """What ``generate`` produced: the new ids (without the prompt, without EOT) and why it stopped."""

    ids: list[int] = field(default_factory=list)
    stop: str = "max_tokens"          # max_tokens | eot | stop_string
    text: str | None = None           # set when a tokenizer was given


def generate(model: InferenceModel, prompt_ids: Sequence[int], opts: SamplingOptions,
             rng: np.random.Generator | int, eot_id: int | None = None, tokenizer=None,
             on_token: Callable[[int], None] | None = None) -> Generation:
    """Continue ``prompt_ids`` by up to ``opts.max_new_tokens`` sampled tokens.

    Stops at the end-of-text id (when ``opts.stop_at_eot``; the EOT is not returned) or, when
    a ``tokenizer`` is given, as soon as the decoded new text contains one of
    ``opts.stop_strings`` (``text`` is then cut before it). An empty prompt starts from EOT,
    the document separator the model was trained on. ``rng`` is a Generator (its state
    advances, so a caller can save it) or an int seed.
    """
    job = _start(prompt_ids, opts, rng, eot_id, tokenizer)
    if hasattr(model, "sample_chunks"):               # the GPU graph decoder draws on the device
        seed = int(job.rng.integers(0, 2 ** 63))      # one host draw seeds the device's counter RNG
        for chunk in model.sample_chunks(job.seq, opts, seed, int(opts.max_new_tokens)):
            for tok in chunk:
                if _take(job, eot_id, tokenizer, on_token, tok) is None:
                    return _finish(job, tokenizer)
        return _finish(job, tokenizer)
    T = model.context
    keep = max(1, T // 2)
    model.reset()
    logits = model.forward(job.seq if len(job.seq) <= T else job.seq[-keep:])
    while True:
        job.row = model.be.to_host(logits[-1])
        tok = _take(job, eot_id, tokenizer, on_token)
        if tok is None:
            return _finish(job, tokenizer)
        if model.pos >= T:
            model.reset()
            logits = model.forward(job.seq[-keep:])
        else:
            logits = model.forward([tok])


@dataclass
class _Job:
    """One sequence of ``generate_batch``: ``generate``'s loop state, kept between batched steps."""

    seq: list[int]
    opts: SamplingOptions
    rng: np.random.Generator
    out: Generation
    stops: list[bytes]
    new_bytes: bytes = b""
    row: np.ndarray | None = None          # the logits to draw the next token from (host)


def _start(prompt_ids, opts: SamplingOptions, rng, eot_id: int | None, tokenizer) -> _Job:
    """``generate``'s set-up of one sequence (empty prompt -> EOT; the rng from an int seed)."""
    if not isinstance(rng, np.random.Generator):
        rng = np.random.default_rng(int(rng))
    seq = [int(t) for t in np.asarray(prompt_ids).reshape(-1)]
    if not seq:
        if eot_id is None:
            raise AndreaError("generate: an empty prompt needs eot_id to start from")
        seq = [int(eot_id)]
    stops = [s.encode("utf-8") for s in opts.stop_strings if s] if tokenizer is not None else []
    return _Job(seq, opts, rng, Generation(), stops)


def _take(job: _Job, eot_id: int | None, tokenizer, on_token, tok: int | None = None) -> int | None:
    """Draw one token for ``job`` from ``job.row`` (or take ``tok``, drawn on the device), exactly
    as ``generate``'s loop body: the token to feed next, or None when the job is done."""
    opts, out = job.opts, job.out
    if len(out.ids) >= opts.max_new_tokens:
        return None
    if tok is None:
        tok = draw(next_token_probs(job.row, opts.temperature, opts.top_k, opts.top_p), job.rng)
    if opts.stop_at_eot and eot_id is not None and tok == eot_id:
        out.stop = "eot"
        return None
    out.ids.append(tok)
    job.seq.append(tok)
    if on_token is not None:
        on_token(tok)
    if job.stops:
        job.new_bytes += tokenizer.token_bytes(tok)
        if any(s in job.new_bytes for s in job.stops):
            out.stop = "stop_string"
            return None
    if len(out.ids) == opts.max_new_tokens:
        return None
    return tok


def _finish(job: _Job, tokenizer) -> Generation:
    out, opts = job.out, job.opts
    if tokenizer is not None:
        text = tokenizer.decode(out.ids)
        if out.stop == "stop_string":
            cut = min(i for i in (text.find(s) for s in opts.stop_strings if s) if i >= 0)
            text = text[:cut]
        out.text = text
    return out


def generate_batch(model: InferenceModel, jobs: Sequence[tuple[Sequence[int], SamplingOptions, object]],
                   eot_id: int | None = None, tokenizer=None) -> list[Generation]:
    """``[generate(model, prompt, opts, rng, eot_id, tokenizer) for prompt, opts, rng in jobs]``,
    the sequences decoded together: up to ``model.slots`` at a time, one slot of the KV cache
    each (its own positions), one ``forward_rows`` per step for every live sequence; a finished
    one hands its slot to the next job. Each job keeps its own rng and stop rules, and on NumPy
    gets the tokens it gets alone (``forward_rows`` gives each row a one-row call's bits).
    A model without ``forward_rows`` (the GPU graph decoder) runs the jobs in turn."""
    if not hasattr(model, "forward_rows"):
        return [generate(model, p, o, r, eot_id, tokenizer) for p, o, r in jobs]
    T = model.context
    keep = max(1, T // 2)
    results: list[Generation | None] = [None] * len(jobs)
    live: dict[int, tuple[int, _Job]] = {}                 # slot -> (job index, job)
    todo = list(range(len(jobs)))[::-1]

    def prefill(slot: int, job: _Job, tokens: list[int]) -> None:
        model.select(slot)
        model.reset()
        job.row = model.be.to_host(model.forward(tokens)[-1]).copy()

    while todo or live:
        for slot in range(model.slots):                     # start jobs in free slots, in job order
            if slot not in live and todo:
                j = todo.pop()
                prompt, opts, rng = jobs[j]
                job = _start(prompt, opts, rng, eot_id, tokenizer)
                if int(opts.max_new_tokens) <= 0:
                    results[j] = _finish(job, tokenizer)
                    continue
                prefill(slot, job, job.seq if len(job.seq) <= T else job.seq[-keep:])
                live[slot] = (j, job)
        feed: list[tuple[int, int]] = []
        for slot in sorted(live):
            j, job = live[slot]
            tok = _take(job, eot_id, tokenizer, None)
            if tok is None:
                results[j] = _finish(job, tokenizer)
                del live[slot]
            elif model.position(slot) >= T:
                prefill(slot, job, job.seq[-keep:])         # the window slides, as in ``generate``
            else:
                feed.append((slot, tok))
        if feed:
            logits = model.be.to_host(model.forward_rows([s for s, _ in feed], [t for _, t in feed]))
            for i, (slot, _) in enumerate(feed):
                live[slot][1].row = logits[i].copy()
    return results  # type: ignore[return-value]


# ------------------------------------------------------------------ loading a run
@dataclass
class LoadedModel:
    model: InferenceModel
    tokenizer: object
    config: ModelConfig
    step: int
    checkpoint: Path
    state: dict | None


def find_tokenizer(run: str | Path, state: dict | None, given: str | Path | None = None) -> Path:
    """The tokenizer.json of a run: ``given`` if set; else the standard layout
    ``data/tokenizer/<variant>/tokenizer.json`` beside the ``runs/`` folder holding the run
    (``<root>/runs/<variant>/<phase>``), then under the working directory; variant = the run
    state's profile. The file must have the run's recorded ``tokenizer_sha256``."""
    import hashlib

    if given is not None:
        return Path(given)
    run_dir = Path(run)
    run_dir = run_dir if run_dir.is_dir() else run_dir.parent
    if state is None:
        raise AndreaError(f"{run_dir}: no model.state.json to find the tokenizer from; pass --tokenizer")
    saved = state.get("config") if isinstance(state.get("config"), dict) else {}
    variant = saved.get("profile") or run_dir.resolve().parent.name
    rel = Path("data") / "tokenizer" / str(variant) / "tokenizer.json"
    cands = []
    up = run_dir.resolve().parents
    if len(up) >= 2 and up[1].name == "runs":
        cands.append(up[2] / rel if len(up) >= 3 else rel)
    cands.append(rel)
    want = state.get("tokenizer_sha256")
    wrong = []
    for c in cands:
        if c.is_file():
            got = hashlib.sha256(c.read_bytes()).hexdigest()
            if not want or got == want:
                return c
            wrong.append(f"{c} (sha256 {got[:12]}...)")
    if wrong:
        raise AndreaError(f"{run_dir}/model.state.json: tokenizer_sha256 {str(want)[:12]}... matches none of "
                          f"{', '.join(wrong)}; pass the run's --tokenizer")
    raise AndreaError(f"{run_dir}: tokenizer not found at {' or '.join(str(c) for c in cands)} (variant "
                      f"{variant!r} from the run state); pass --tokenizer")


def load_model(run: str | Path, tokenizer_path: str | Path, cfg: dict, backend=None, slots: int = 1) -> LoadedModel:
    """Load a checkpoint, its tokenizer and config for inference, refusing any mismatch clearly;
    ``slots``: sequences the model's KV cache holds (``generate_batch``)."""
    from andrea import runs
    from andrea.engine import checkpoint as ckio
    from andrea.tokenizer import load as load_tokenizer

    ckpt = runs.find_checkpoint(run)
    tok = load_tokenizer(tokenizer_path)
    mc = ModelConfig.from_cfg(cfg, tok.vocab_size)
    state = runs.read_state_beside(ckpt)
    runs.check_for_inference(state, runs.state_path_beside(ckpt), cfg, tok)
    n_params = param_layout(mc).n_params
    step, weights = ckio.read_weights(ckpt, n_params)
    be = backend if backend is not None else NumpyBackend()
    flat = be.xp.asarray(weights) if be.xp is not np else weights
    return LoadedModel(InferenceModel(mc, flat, be, slots), tok, mc, int(step), ckpt, state)


def fast_model(lm: LoadedModel, backend, precision: str = "fp32") -> LoadedModel:
    """On the CuPy backend, the same weights run by the CUDA-graph decoder (andrea/cuda/decode.py:
    one graph per token, the surface of InferenceModel); elsewhere, or for a shape it does not
    take (head size not dividing 128), ``lm`` unchanged. fp32 gives the eager path's tokens."""
    if getattr(backend, "name", "") != "cupy":
        return lm
    from andrea.cuda.decode import GraphDecoder

    try:
        lm.model = GraphDecoder(lm.config, lm.model.params, precision=precision)
    except AndreaError as e:
        print(f"(CUDA-graph decode not used: {e})", file=sys.stderr)
    return lm


def options_from(args, section: dict) -> SamplingOptions:
    """SamplingOptions from CLI flags, falling back to a params section (audit/coherence)."""
    def pick(name, key, default):
        v = getattr(args, name, None)
        return v if v is not None else section.get(key, default)
    return SamplingOptions(max_new_tokens=int(pick("max_new_tokens", "max_new_tokens", 64)),
                           temperature=float(pick("temperature", "temperature", 0.8)),
                           top_k=int(pick("top_k", "top_k", 0)),
                           top_p=float(pick("top_p", "top_p", 1.0)),
                           stop_at_eot=not getattr(args, "no_stop_at_eot", False))


def add_sampling_arguments(p) -> None:
    g = p.add_argument_group("sampling (defaults: the params' audit section)")
    g.add_argument("--max-new-tokens", type=int, default=None)
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=None, help="0 = no top-k cut")
    g.add_argument("--top-p", type=float, default=None, help="1 = no nucleus cut")
    g.add_argument("--no-stop-at-eot", action="store_true", help="keep going past the end-of-text token")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: the params' seed)")
    g.add_argument("--backend", choices=["auto", "numpy", "cupy"], default=None,
                   help="array backend for inference (default: the params' train.backend)")


def add_decode_arguments(p) -> None:
    p.add_argument("--decode-precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="GPU decoder precision (default: %(default)s)")


def add_run_arguments(p) -> None:
    """RUN (positional, or --run) and --tokenizer (default: found from the run, see ``find_tokenizer``)."""
    import argparse

    p.add_argument("run", nargs="?", default=None, help="run folder (holding model.bin) or a checkpoint file")
    p.add_argument("--run", dest="run_opt", default=None, help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", default=None, help="tokenizer.json the run was trained with (default: "
                   "data/tokenizer/<variant>/tokenizer.json, checked against the run's tokenizer_sha256)")


def resolve_run(args, cfg) -> tuple[str, dict, Path]:
    """(run, config, tokenizer path) of a sample/chat call. Without ``--profile`` (or ``-S profile=``)
    the config is the run's own (``model.state.json`` "config", with the ``-S`` overrides applied),
    so ``andrea chat runs/tiny/main`` needs no other argument."""
    import copy

    from andrea import runs
    from andrea.config import apply_override

    run = args.run if args.run is not None else getattr(args, "run_opt", None)
    if run is None:
        raise AndreaError("no run given: pass the run folder, e.g. `andrea chat runs/tiny/main`")
    ckpt = runs.find_checkpoint(run)
    state = runs.read_state_beside(ckpt)
    overrides = list(getattr(args, "overrides", []) or [])
    saved = state.get("config") if isinstance(state, dict) else None
    picks_profile = getattr(args, "profile", None) is not None or any(
        o.split("=", 1)[0].strip() == "profile" for o in overrides)
    if isinstance(saved, dict) and not picks_profile:
        cfg = copy.deepcopy(saved)
        for o in overrides:
            apply_override(cfg, o)
    return str(run), cfg, find_tokenizer(ckpt.parent, state, args.tokenizer)


def add_arguments(p) -> None:
    add_run_arguments(p)
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable); default: start from EOT")
    p.add_argument("--prompt-file", default=None, help="read one prompt from this file ('-' = stdin)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--json", action="store_true", help="print one JSON object per sample")
    add_sampling_arguments(p)
    add_decode_arguments(p)


def run(args, cfg) -> int:
    from andrea.backends import select_backend

    run_path, cfg, tok_path = resolve_run(args, cfg)
    be, _ = select_backend(args.backend or cfg["train"]["backend"])
    lm = fast_model(load_model(run_path, tok_path, cfg, be), be, args.decode_precision)
    opts = options_from(args, cfg["audit"])
    prompts = list(args.prompt)
    if args.prompt_file:
        prompts.append(sys.stdin.read() if args.prompt_file == "-" else Path(args.prompt_file).read_text(encoding="utf-8"))
    if not prompts:
        prompts = [""]
    rng = np.random.default_rng(cfg["seed"] if args.seed is None else args.seed)
    for prompt in prompts:
        for i in range(max(1, args.n)):
            g = generate(lm.model, lm.tokenizer.encode(prompt), opts, rng, lm.tokenizer.eot_id, lm.tokenizer)
            if args.json:
                print(json.dumps({"step": lm.step, "prompt": prompt, "sample": i, "text": g.text, "stop": g.stop,
                                  "n_tokens": len(g.ids)}, ensure_ascii=False))
            else:
                print(f"--- step {lm.step} | sample {i} | {len(g.ids)} tokens | stop: {g.stop}")
                print(prompt + (g.text or ""))
    return 0
