"""The fp32 op mirror: every function of ``andrea/engine/ops_numpy.py`` on CuPy float32 arrays, same
names, same arguments, same ``+=``/``=`` contract, so ``andrea.engine.engine.Engine`` runs the model
of ``andrea/engine/recipe.py`` on the GPU unchanged (the twin the tests compare against NumPy).

    from andrea.cuda.backend import make_backend
    eng = Engine(mc, batch_size=8, backend=make_backend())       # be.ops is a MirrorOps

The attention op saves the row log-sum-exp (B, H, T) instead of the (B, T, H, T) probabilities
(``CupyBackend.att_shape``); its backward reads the forward's output y. Launches go through
``andrea/cuda/kernels.py``, which checks every argument first.
"""

from __future__ import annotations

import math

import numpy as np

from andrea.cuda.kernels import (LN_ROWS_PER_CHUNK, Blas, adam_hyper, cp, embed_segments, k_adamw, k_attn_bwd,
                                 k_attn_fwd, k_embed_bwd, k_embed_fwd, k_gelu_bwd, k_gelu_fwd, k_grad_norm_chunks,
                                 k_layernorm_bwd, k_layernorm_fwd, k_loss_fwd, k_probs_to_dlogits, k_residual_add,
                                 k_scale, k_softmax, need)


class MirrorOps:
    """Every function of andrea.engine.ops_numpy on CuPy fp32 arrays: same names, arguments, semantics."""

    def __init__(self):
        self.blas = Blas()
        self._seg_cache: dict[int, tuple] = {}

    @staticmethod
    def work_elems(B: int, T: int, C: int, H: int, V: int) -> int:
        N = B * T
        n_chunks = (N + LN_ROWS_PER_CHUNK - 1) // LN_ROWS_PER_CHUNK
        return max(n_chunks * 2 * C,          # layernorm_backward partials
                   B * H * T,                 # attn_backward: dvec
                   N * 4 * C,                 # mlp_backward: dh
                   N)                         # loss_forward: row lse

    # embed
    def embed_forward(self, out, idx, wte, wpe):
        B, T = idx.shape
        V, C = wte.shape
        need("embed_forward", "out", out, np.float32, size=B * T * C)
        need("embed_forward", "idx", idx, np.int32)
        need("embed_forward", "wte", wte, np.float32)
        need("embed_forward", "wpe", wpe, np.float32)
        k_embed_fwd(out, idx, wte, wpe, B * T, T, C, V)

    def embed_backward(self, dwte, dwpe, dout, idx):
        xp = cp()
        B, T = idx.shape
        C = dwte.shape[1]
        N = B * T
        for nm, a in (("dwte", dwte), ("dwpe", dwpe), ("dout", dout)):
            need("embed_backward", nm, a, np.float32)
        bufs = self._seg_cache.get(N)
        if bufs is None:  # allocated once per shape, reused every step
            bufs = (xp.zeros(N, np.int32), xp.zeros(N + 1, np.int32), xp.zeros(N, np.int32), xp.zeros(1, np.int32))
            self._seg_cache[N] = bufs
        for dst, src in zip(bufs, embed_segments(xp.asnumpy(idx))):
            dst.set(src)
        k_embed_bwd(dwte, dwpe, dout, bufs, B, T, C)

    # layernorm
    def layernorm_forward(self, out, mean, rstd, x, g, b):
        N, C = x.shape
        for nm, a in (("out", out), ("x", x)):
            need("layernorm_forward", nm, a, np.float32, shape=(N, C))
        for nm, a in (("mean", mean), ("rstd", rstd)):
            need("layernorm_forward", nm, a, np.float32, size=N)
        for nm, a in (("g", g), ("b", b)):
            need("layernorm_forward", nm, a, np.float32, size=C)
        k_layernorm_fwd("fp32", out, mean, rstd, x, g, b, N, C)

    def layernorm_backward(self, dx, dg, db, dout, x, mean, rstd, g, work):
        N, C = x.shape
        for nm, a in (("dx", dx), ("dout", dout), ("x", x)):
            need("layernorm_backward", nm, a, np.float32, shape=(N, C))
        need("layernorm_backward", "work", work, np.float32)
        k_layernorm_bwd("fp32", dx, dg, db, dout, x, mean, rstd, g, work, N, C)

    def layernorm_residual_backward(self, dx, dbranch, dg, db, dout, x, mean, rstd, g, work):
        self.layernorm_backward(dx, dg, db, dout, x, mean, rstd, g, work)
        self.residual_add_backward(dbranch, dx)

    def residual_layernorm_forward(self, xo, out, mean, rstd, a, b, g, beta):
        self.residual_add_forward(xo, a, b)
        self.layernorm_forward(out, mean, rstd, xo, g, beta)

    # linear layers
    def _lin_fwd(self, op, y, x, w):
        for nm, a in (("out", y), ("x", x), ("w", w)):
            need(op, nm, a, np.float32)
        self.blas.mm(y, x, w)

    def _lin_bwd(self, op, dx, dw, dout, x, w):
        for nm, a in (("dx", dx), ("dw", dw), ("dout", dout), ("x", x), ("w", w)):
            need(op, nm, a, np.float32)
        self.blas.mm(dx, dout, w, tb=True)             # dx = dout @ w.T
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
        need("attn_forward", "out", out, np.float32)
        need("attn_forward", "qkv", qkv, np.float32, size=B * T * 3 * C)
        need("attn_forward", "att", att, np.float32, size=B * H * T)
        k_attn_fwd("fp32", out, att, qkv, B, T, C, H)

    def attn_backward(self, dqkv, dout, qkv, att, y, n_head, work):
        B, T, C = dout.shape
        H = n_head
        need("attn_backward", "dqkv", dqkv, np.float32, size=B * T * 3 * C)
        need("attn_backward", "dout", dout, np.float32)
        need("attn_backward", "qkv", qkv, np.float32, size=B * T * 3 * C)
        need("attn_backward", "att", att, np.float32, size=B * H * T)
        need("attn_backward", "y", y, np.float32, size=B * T * C)
        need("attn_backward", "work", work, np.float32)
        dvec = work[:B * H * T]
        k_attn_bwd("fp32", dqkv, dout, y, att, dvec, qkv, B, T, C, H, accumulate=False)

    # mlp
    def mlp_forward(self, out, h_pre, h_act, x, w_fc, w_proj):
        for nm, a in (("out", out), ("h_pre", h_pre), ("h_act", h_act), ("x", x), ("w_fc", w_fc), ("w_proj", w_proj)):
            need("mlp_forward", nm, a, np.float32)
        self.blas.mm(h_pre, x, w_fc)
        k_gelu_fwd("fp32", h_act, h_pre, h_pre.size)
        self.blas.mm(out, h_act, w_proj)

    def mlp_backward(self, dx, dw_fc, dw_proj, dout, x, h_pre, h_act, w_fc, w_proj, work):
        for nm, a in (("dx", dx), ("dw_fc", dw_fc), ("dw_proj", dw_proj), ("dout", dout), ("x", x),
                      ("h_pre", h_pre), ("h_act", h_act), ("w_fc", w_fc), ("w_proj", w_proj), ("work", work)):
            need("mlp_backward", nm, a, np.float32)
        N, F = h_pre.shape
        dh = work[:N * F].reshape(N, F)
        self.blas.mm(dh, dout, w_proj, tb=True)            # dL/dh_act
        self.blas.mm(dw_proj, h_act, dout, ta=True, beta=1.0)
        k_gelu_bwd("fp32", dh, dh, h_pre, N * F)           # dL/dh_pre, in place
        self.blas.mm(dw_fc, x, dh, ta=True, beta=1.0)
        self.blas.mm(dx, dh, w_fc, tb=True)                # dx = dh @ w_fc.T

    def gelu_forward(self, out, x):
        need("gelu_forward", "out", out, np.float32, size=x.size)
        need("gelu_forward", "x", x, np.float32)
        k_gelu_fwd("fp32", out, x, x.size)

    # residual
    def residual_add_forward(self, out, a, b):
        for nm, t in (("out", out), ("a", a), ("b", b)):
            need("residual_add_forward", nm, t, np.float32, size=out.size)
        k_residual_add("fp32", out, a, b, out.size)

    def residual_add_backward(self, db, dout):
        for nm, t in (("db", db), ("dout", dout)):
            need("residual_add_backward", nm, t, np.float32, size=dout.size)
        if db.data.ptr != dout.data.ptr:
            cp().copyto(db, dout)

    # loss
    def loss_forward(self, losses, logits, probs, x, wte, targets, work):
        N, V = logits.shape
        for nm, a in (("logits", logits), ("probs", probs)):
            need("loss_forward", nm, a, np.float32, shape=(N, V))
        need("loss_forward", "x", x, np.float32)
        need("loss_forward", "wte", wte, np.float32)
        self.blas.mm(logits, x, wte, tb=True)
        if targets is None:
            return
        need("loss_forward", "targets", targets, np.int32, size=N)
        need("loss_forward", "losses", losses, np.float32, size=N)
        lse = work[:N]
        k_loss_fwd("fp32", lse, losses, logits, targets, N, V)
        k_softmax(probs, logits, lse, N, V)

    def loss_backward(self, dx, dwte, logits, probs, x, wte, targets, dloss, work):
        N, V = probs.shape
        need("loss_backward", "probs", probs, np.float32)
        need("loss_backward", "targets", targets, np.int32, size=N)
        for nm, a in (("dx", dx), ("dwte", dwte), ("x", x), ("wte", wte)):
            need("loss_backward", nm, a, np.float32)
        k_probs_to_dlogits(probs, targets, dloss, N, V)
        self.blas.mm(dx, probs, wte)                         # dx = dlogits @ wte
        self.blas.mm(dwte, probs, x, ta=True, beta=1.0)      # dwte += dlogits.T @ x

    # clipping + AdamW
    def grad_norm_partial(self, partials, grads):
        need("grad_norm_partial", "partials", partials, np.float64)
        need("grad_norm_partial", "grads", grads, np.float32)
        P, n = partials.shape[0], grads.shape[0]
        chunk = -(-n // P)
        k_grad_norm_chunks(partials, grads, n, chunk, P)

    def grad_norm_final(self, partials) -> float:
        host = cp().asnumpy(partials)
        return float(math.sqrt(float(np.sum(host)))) if np.isfinite(host).all() else float("nan")

    def grad_scale(self, grads, scale):
        need("grad_scale", "grads", grads, np.float32)
        k_scale(grads, grads.size, scale)

    def adamw(self, w, g, m, v, n_decay, t, lr, beta1, beta2, eps, weight_decay):
        xp = cp()
        for nm, a in (("w", w), ("g", g), ("m", m), ("v", v)):
            need("adamw", nm, a, np.float32, size=w.size)
        hp = xp.asarray(adam_hyper(t, lr, beta1, beta2, eps, weight_decay))
        gstate = xp.asarray(np.array([0.0, 1.0, 1.0, 0.0], dtype=np.float32))
        k_adamw("fp32", w, g, m, v, np.uint64(0), w.size, hp, gstate, n_decay if weight_decay else 0, 0)


