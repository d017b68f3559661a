"""OVERLAP_UPDATE, the engine switch that runs AdamW beside the next forward, without a GPU: the pieces AdamW
runs in cover every parameter once, in the order the forward reads them. The GPU side (the same bytes as the
single launch, graph and eager alike): tests/test_cuda_engine.py.

    python -m pytest -q tests/test_cuda_overlap_plan.py
"""

from __future__ import annotations


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
