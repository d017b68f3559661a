"""The model, written once: the sequence of ops of one block and of the whole GPT, forward and
backward. The NumPy engine, the GPU engine and KV-cache inference all run these functions;
a backend supplies only ``ops`` (the functions of ``andrea/engine/ops_numpy.py``, or its GPU
twins) and the buffers (``views`` over the plan of ``andrea/engine/model.py``).

    from andrea.engine import recipe
    z = recipe.views(a, W, WC, G, mc, rows=(0, B))       # named views of one batch slice
    recipe.forward(ops, z, mc.n_head, with_targets=True)  # -> z.losses (N,)
    recipe.backward(ops, z, mc.n_head, dloss=1.0 / N)     # += dL/dparams into z.G

Shapes: B batch (of this slice), T context, C d_model, N = B * T rows, V vocab. Activations
are (N, C) rows (the same memory as (B, T, C)); x is the residual stream:

    x = wte[idx] + wpe[:T]                          embed                       (B, T, C)
    for each block:
        x = x + attn_out(attn(attn_qkv(ln1(x))))    pre-LN causal attention     (B, T, C)
        x = x + mlp(ln2(x))                         pre-LN MLP, GELU(tanh), 4C  (B, T, C)
    logits = lnf(x) @ wte.T                         tied head                   (B, T, V)
    loss = cross_entropy(logits, targets)                                       (B, T)

Backward conventions (the op contract): parameter gradients are added (+=); the gradient
of the residual stream ``dres`` (N, C) is one buffer, passed down through every residual add
and added into (+=) by each LayerNorm backward; every other activation gradient is written
(=) by the op that produces it. ``recompute`` (the backend's ``PlanPolicy.recompute``) names the
saved activations kept in one buffer for all layers, which the backward refills by re-running
their forward op (same kernel, same bits) just before it needs them.

The weights come as ``W`` (the fp32 master weights: embeddings and LayerNorm g/b) and ``WC``
(the compute copy the matmuls read: W itself on NumPy, a bf16/fp16 copy on the GPU).
"""

from __future__ import annotations

from types import SimpleNamespace

from andrea.engine.model import ModelConfig

BLOCK_WEIGHTS = ("ln1.g", "ln1.b", "attn.w_qkv", "attn.w_o", "ln2.g", "ln2.b", "mlp.w_fc", "mlp.w_proj")
MATMUL_WEIGHTS = ("attn.w_qkv", "attn.w_o", "mlp.w_fc", "mlp.w_proj")


# ---------------------------------------------------------------------------- forward
def block_forward(ops, s, branch, mask, n_head: int, work, prev=None, add_out: bool = True) -> None:
    """One pre-LN block on the rows of ``s`` (its views); ``branch`` (N, C) is scratch. With ``prev``
    (the block before, whose ``add_out`` was False) ln1 also does that block's residual add, x_in =
    prev.x_mid + branch (residual_layernorm_forward: the sum is not read back); ``add_out`` False leaves
    this block's own add, x_out = x_mid + branch (the MLP's output), to the LayerNorm after it."""
    if prev is None:
        ops.layernorm_forward(s.ln1, s.ln1_mean, s.ln1_rstd, s.x_in, s.ln1_g, s.ln1_b)   # (N, C)
    else:
        ops.residual_layernorm_forward(s.x_in, s.ln1, s.ln1_mean, s.ln1_rstd, prev.x_mid, branch, s.ln1_g, s.ln1_b)
    ops.attn_qkv_forward(s.qkv, s.ln1, s.attn_w_qkv)                                # (N, 3C)
    ops.attn_forward(s.atty3, s.att, s.qkv3, mask, n_head, work)                    # (B, T, C)
    ops.attn_out_forward(branch, s.atty, s.attn_w_o)                                # (N, C)
    ops.residual_layernorm_forward(s.x_mid, s.ln2, s.ln2_mean, s.ln2_rstd, s.x_in, branch, s.ln2_g, s.ln2_b)
    ops.mlp_forward(branch, s.h_pre, s.h_act, s.ln2, s.mlp_w_fc, s.mlp_w_proj)       # (N, 4C) inside
    if add_out:
        ops.residual_add_forward(s.x_out, s.x_mid, branch)


def head_forward(ops, z, with_targets: bool, last=None) -> None:
    """Final LayerNorm, tied output projection and (with targets) the per-row loss. With ``last`` (the
    last block, its ``add_out`` False) lnf also does its residual add, res_last = last.x_mid + branch."""
    if last is None:
        ops.layernorm_forward(z.lnf, z.lnf_mean, z.lnf_rstd, z.res_last, z.lnf_g, z.lnf_b)
    else:
        ops.residual_layernorm_forward(z.res_last, z.lnf, z.lnf_mean, z.lnf_rstd, last.x_mid, z.branch, z.lnf_g,
                                       z.lnf_b)
    ops.loss_forward(z.losses, z.logits, z.probs, z.lnf, z.wte_head, z.targets if with_targets else None, z.work)


def forward(ops, z, n_head: int, with_targets: bool) -> None:
    """embed -> blocks -> final LN -> tied head -> loss, on one batch slice ``z``. Each residual add
    after an MLP runs inside the LayerNorm that reads its sum (the next block's ln1, or lnf): the same
    bits as the add then the LayerNorm (the ops' contract), one pass less over the stream."""
    ops.embed_forward(z.emb3, z.idx, z.wte, z.wpe)                                  # (B, T, C)
    prev = None
    for s in z.layers:
        block_forward(ops, s, z.branch, z.mask, n_head, z.work, prev=prev, add_out=False)
        prev = s
    head_forward(ops, z, with_targets, last=prev)


# --------------------------------------------------------------------------- backward
def backward(ops, z, n_head: int, dloss: float, recompute=frozenset()) -> None:
    """Add dL/dparams into ``z.G`` for the last forward with targets, L = dloss * sum(losses)."""
    G, work = z.G, z.work
    ops.loss_backward(z.dln, G["wte"], z.logits, z.probs, z.lnf, z.wte_head, z.targets, dloss, work)
    z.dres.fill(0)
    # each LayerNorm backward adds into dres; the fused op also hands the updated dres to the branch
    # below it (residual_add_backward: x_out = x_mid + branch passes dres down unchanged), except the
    # first block's ln1, whose stream gradient goes to the embedding
    ops.layernorm_residual_backward(z.dres, z.dbranch, G["lnf.g"], G["lnf.b"], z.dln, z.res_last, z.lnf_mean,
                                    z.lnf_rstd, z.lnf_g, work)
    for s in reversed(z.layers):
        # x_out = x_mid + mlp(ln2(x_mid)): dbranch holds the branch's gradient
        if "ln" in recompute:
            ops.layernorm_forward(s.ln2, s.ln2_mean, s.ln2_rstd, s.x_mid, s.ln2_g, s.ln2_b)
        if "gelu" in recompute:
            ops.gelu_forward(s.h_act, s.h_pre)
        ops.mlp_backward(z.dln, s.d_mlp_w_fc, s.d_mlp_w_proj, z.dbranch, s.ln2, s.h_pre, s.h_act,
                         s.mlp_w_fc, s.mlp_w_proj, work)
        ops.layernorm_residual_backward(z.dres, z.dbranch, s.d_ln2_g, s.d_ln2_b, z.dln, s.x_mid, s.ln2_mean,
                                        s.ln2_rstd, s.ln2_g, work)
        # x_mid = x_in + attn_out(attn(attn_qkv(ln1(x_in))))
        ops.attn_out_backward(z.datty, s.d_attn_w_o, z.dbranch, s.atty, s.attn_w_o, work)
        ops.attn_backward(z.dqkv3, z.datty3, s.qkv3, s.att, s.atty3, n_head, work)
        if "ln" in recompute:
            ops.layernorm_forward(s.ln1, s.ln1_mean, s.ln1_rstd, s.x_in, s.ln1_g, s.ln1_b)
        ops.attn_qkv_backward(z.dln, s.d_attn_w_qkv, z.dqkv, s.ln1, s.attn_w_qkv, work)
        ln1 = (s.d_ln1_g, s.d_ln1_b, z.dln, s.x_in, s.ln1_mean, s.ln1_rstd, s.ln1_g, work)
        if s is z.layers[0]:                # the stream gradient goes to the embedding, no branch below
            ops.layernorm_backward(z.dres, *ln1)
        else:
            ops.layernorm_residual_backward(z.dres, z.dbranch, *ln1)
    ops.embed_backward(G["wte"], G["wpe"], z.dres3, z.idx)


# ------------------------------------------------------------------------------ views
def _layer(a: dict, name: str, l: int):
    """Layer l's buffer of a per-layer saved tensor (a recomputed one has a single layer): an array
    (L, ...) or a list of L layers (the GPU engine's ACTS_IN_GRADS)."""
    buf = a[name]
    return buf[l if len(buf) > 1 else 0]


def views(a: dict, W: dict, WC: dict, G: dict, mc: ModelConfig, rows: tuple[int, int], work=None,
          mask=None) -> SimpleNamespace:
    """Named views of batch rows [b0, b1) of the plan's buffers ``a`` (built once, so a step only
    indexes Python lists). ``G`` is the slice's gradient views; ``work`` its scratch."""
    b0, b1 = rows
    n, T, C = b1 - b0, mc.context, mc.d_model
    r0, r1 = b0 * T, b1 * T
    rows_of = {k: a[k][r0:r1] for k in ("branch", "lnf", "lnf_mean", "lnf_rstd", "probs", "losses",
                                         "dres", "dln", "dqkv", "datty")}
    rows_of["logits"] = a["logits"][r0:r1, :mc.vocab_size]    # (n*T, V), rows may be padded (PlanPolicy)
    dbranch = a["dbranch"][r0:r1] if "dbranch" in a else rows_of["dres"]     # fp32: the branch grad IS dres
    z = SimpleNamespace(G=G, work=work, mask=mask, idx=a["idx"][b0:b1], targets=a["targets"][b0:b1].reshape(n * T),
                        emb3=a["res"][0][r0:r1].reshape(n, T, C), res_last=a["res"][-1][r0:r1],
                        wte=W["wte"], wpe=W["wpe"], lnf_g=W["lnf.g"], lnf_b=W["lnf.b"], wte_head=WC["wte"],
                        dbranch=dbranch, dres3=rows_of["dres"].reshape(n, T, C),
                        dqkv3=rows_of["dqkv"].reshape(n, T, 3 * C), datty3=rows_of["datty"].reshape(n, T, C),
                        layers=[], **rows_of)
    for l in range(mc.n_layer):
        p = f"h.{l}."
        qkv, atty = a["qkv"][l][r0:r1], a["atty"][l][r0:r1]
        wts = {k.replace(".", "_"): (WC if k in MATMUL_WEIGHTS else W)[p + k] for k in BLOCK_WEIGHTS}
        z.layers.append(SimpleNamespace(
            x_in=a["res"][2 * l][r0:r1], x_mid=a["res"][2 * l + 1][r0:r1], x_out=a["res"][2 * l + 2][r0:r1],
            ln1=_layer(a, "ln1", l)[r0:r1], ln1_mean=a["ln1_mean"][l][r0:r1], ln1_rstd=a["ln1_rstd"][l][r0:r1],
            qkv=qkv, qkv3=qkv.reshape(n, T, 3 * C), att=a["att"][l][b0:b1], atty=atty, atty3=atty.reshape(n, T, C),
            ln2=_layer(a, "ln2", l)[r0:r1], ln2_mean=a["ln2_mean"][l][r0:r1], ln2_rstd=a["ln2_rstd"][l][r0:r1],
            h_pre=a["h_pre"][l][r0:r1], h_act=_layer(a, "h_act", l)[r0:r1], **wts,
            **{"d_" + k.replace(".", "_"): G[p + k] for k in BLOCK_WEIGHTS},
        ))
    return z
