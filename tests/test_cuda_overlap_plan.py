"""Two engine switches that overlap memory-bound work with the GEMMs, without a GPU:
- NORM_IN_BACKWARD: the hook that starts a block's gradient-norm partial sums between its last
  weight-gradient GEMM (qkv) and the qkv dgrad, only for a hooked block, and the (L + 2) NORM_BLOCKS partials
  the plan adds for it;
- OVERLAP_UPDATE: the pieces AdamW runs in, covering every parameter once in the order the forward reads them.
The GPU side (the same norms, and the same bytes as without either switch, graph and eager alike):
tests/test_cuda_engine.py.

    python -m pytest -q tests/test_cuda_overlap_plan.py
"""

from __future__ import annotations


def test_the_norm_of_a_block_starts_between_its_last_weight_gradient_and_its_dgrad(monkeypatch):
    import andrea.cuda.engine as ce
    from andrea.engine.model import ModelConfig

    calls = []

    class Ptr:
        def __init__(self, p):
            self.data = type("D", (), {"ptr": p})()

    ops = ce.FastOps("bf16", None, {})
    monkeypatch.setattr(ops, "_mm", lambda C, A, B, tag="gemm", **k: calls.append(tag))
    monkeypatch.setattr(ops, "_side_norm", lambda rows, n, part: calls.append(("norm", rows, n, part)))
    ops.attn_qkv_backward("dx", Ptr(7), "dqkv", "x", "w", None)                 # no hooks: no norm
    ops.norm_hooks = {7: ("rows", 12, "part")}
    ops.attn_qkv_backward("dx", Ptr(7), "dqkv", "x", "w", None)
    ops.attn_qkv_backward("dx", Ptr(8), "dqkv", "x", "w", None)                 # not a hooked block
    assert calls == ["qkv wgrad", "qkv dgrad", "qkv wgrad", ("norm", "rows", 12, "part"), "qkv dgrad",
                     "qkv wgrad", "qkv dgrad"]
    mc = ModelConfig(vocab_size=300, d_model=128, n_head=2, n_layer=3, context=256)
    assert all(b.name != "norm_layers" for b in ce.gpu_policy(mc, 2, "bf16").scratch)
    monkeypatch.setattr(ce, "NORM_IN_BACKWARD", True)
    extra = [b for b in ce.gpu_policy(mc, 2, "bf16").scratch if b.name == "norm_layers"]
    assert len(extra) == 1 and extra[0].shape == (5 * ce.NORM_BLOCKS,)


def test_the_updates_pieces_cover_every_parameter_once_in_the_order_the_forward_reads_them():
    import andrea.cuda.engine as ce
    from andrea.engine.model import ModelConfig, param_layout

    mc = ModelConfig(vocab_size=300, d_model=64, n_head=2, n_layer=3, context=128)
    lay = param_layout(mc)
    pieces = ce.update_pieces(lay, mc.n_layer)
    assert [opens for _, opens in pieces] == ["wte", "h.0.ln1.g", "h.1.ln1.g", "h.2.ln1.g", "lnf.g"]
    flat = sorted(r for rs, _ in pieces for r in rs)
    assert flat[0][0] == 0 and flat[-1][1] == lay.n_params and all(a[1] == b[0] for a, b in zip(flat, flat[1:]))
    C = mc.d_model
    for l in range(mc.n_layer):              # a block's piece: its four matrices, then its two LayerNorms
        mats, lns = pieces[1 + l][0]
        assert mats[1] - mats[0] == 12 * C * C and lns[1] - lns[0] == 4 * C
        assert lns[0] == lay.by_name[f"h.{l}.ln1.g"].offset
    assert pieces[0][0] == [(0, (mc.vocab_size + mc.context) * C)]
