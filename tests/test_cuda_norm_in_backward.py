"""engine.NORM_IN_BACKWARD without a GPU: the hook that starts a block's gradient-norm partial sums between
its last weight-gradient GEMM (qkv) and the qkv dgrad, only for a hooked block, and the (L + 2) NORM_BLOCKS
partials the plan adds for it. The GPU side (the same norms as the single pass, the bytes repeated, graph and
eager alike): tests/test_cuda_engine.py.

    python -m pytest -q tests/test_cuda_norm_in_backward.py
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
