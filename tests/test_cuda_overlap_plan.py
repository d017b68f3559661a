"""OVERLAP_UPDATE, the engine switch that runs AdamW beside the next forward, without a GPU: the pieces AdamW
runs in cover every parameter once, in the order the forward reads them. OVERLAP_NORM's partial sums over the
same pieces: slots in flat order, the arena's norm_part sized for them. The GPU side (the same bytes as the
single launch, graph and eager alike; the norm within its summation error): tests/test_cuda_engine.py.
STREAM_PRIORITY's choice of the engine stream's priority, one GPU only.

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


HALVES = (("ln1.g", (("attn.w_qkv", "attn.w_o"), ("ln1.g", "ln1.b"))),
          ("ln2.g", (("mlp.w_fc", "mlp.w_proj"), ("ln2.g", "ln2.b"))))
QUARTERS = (("ln1.g", (("attn.w_qkv",), ("ln1.g", "ln1.b"))), ("attn.w_o", (("attn.w_o",),)),
            ("ln2.g", (("mlp.w_fc",), ("ln2.g", "ln2.b"))), ("mlp.w_proj", (("mlp.w_proj",),)))


def test_finer_pieces_a_block_wait_where_the_forward_first_reads_them_and_still_cover_every_parameter_once(
        monkeypatch):
    """UPDATE_BLOCK_PIECES as two pieces a block (attention's weights with ln1, the MLP's with ln2) or one a
    matrix: each opened by its own tensor, in the forward's order; every parameter stepped once. A table whose
    run is not contiguous in the layout is refused by name; OVERLAP_NORM refuses a piece no LayerNorm opens."""
    import pytest

    import andrea.cuda.engine as ce
    from andrea.engine.model import ModelConfig, param_layout
    from andrea.errors import AndreaError

    mc = ModelConfig(vocab_size=300, d_model=64, n_head=2, n_layer=3, context=128)
    lay, C = param_layout(mc), mc.d_model
    at = lambda name: lay.by_name[name].offset                         # noqa: E731
    for table, per_block in ((HALVES, 2), (QUARTERS, 4)):
        monkeypatch.setattr(ce, "UPDATE_BLOCK_PIECES", table)
        pieces = ce.update_pieces(lay, mc.n_layer)
        assert [opens for _, opens in pieces] == ["wte"] + [f"h.{l}.{o}" for l in range(3) for o, _ in table] + ["lnf.g"]
        flat = sorted(r for rs, _ in pieces for r in rs)
        assert flat[0][0] == 0 and flat[-1][1] == lay.n_params and all(a[1] == b[0] for a, b in zip(flat, flat[1:]))
        for l in range(mc.n_layer):
            block = pieces[1 + per_block * l:1 + per_block * (l + 1)]
            assert block[0][0] == [(at(f"h.{l}.attn.w_qkv"), at(f"h.{l}.attn.w_o" if per_block == 4 else f"h.{l}.mlp.w_fc")),
                                   (at(f"h.{l}.ln1.g"), at(f"h.{l}.ln2.g"))]
            assert block[-1][0][0][1] - block[-1][0][0][0] == (4 if per_block == 4 else 8) * C * C
        if per_block == 2:                   # each piece ends at a LayerNorm backward: OVERLAP_NORM takes it
            assert len(ce.norm_slots(pieces)[0]) == len(pieces)
        else:
            with pytest.raises(AndreaError, match="not by h.0.attn.w_o; turn one of them off"):
                ce.norm_slots(pieces)
    monkeypatch.setattr(ce, "UPDATE_BLOCK_PIECES", (("ln1.g", (("attn.w_qkv", "mlp.w_fc"),)),))
    with pytest.raises(AndreaError, match="mlp.w_fc starts at element"):
        ce.update_pieces(lay, mc.n_layer)


def test_the_norms_partial_sums_take_every_range_in_flat_order(monkeypatch):
    """norm_slots: a range's blocks are one per NORM_CHUNK elements (1 to NORM_BLOCKS); the slots follow the
    ranges' flat order whatever the pieces' order; the arena sizes norm_part for them only with OVERLAP_NORM."""
    import andrea.cuda.engine as ce
    from andrea.engine.model import ModelConfig, param_layout

    mc = ModelConfig(vocab_size=300, d_model=64, n_head=2, n_layer=3, context=128)
    pieces = ce.update_pieces(param_layout(mc), mc.n_layer)
    monkeypatch.setattr(ce, "NORM_CHUNK", 4096)
    ranges, slots = ce.norm_slots(pieces)
    assert [len(rs) for rs in ranges] == [len(rs) for rs, _ in pieces]
    flat = sorted(r for rs in ranges for r in rs)
    assert flat[0][2] == 0 and all(a[2] + a[3] == b[2] for a, b in zip(flat, flat[1:]))
    assert flat[-1][2] + flat[-1][3] == slots
    for lo, hi, _, blocks in flat:
        assert blocks == min(ce.NORM_BLOCKS, max(1, -(-(hi - lo) // 4096)))
    assert ranges[1][0][3] == 12 * 64 * 64 // 4096 and ranges[1][1][3] == 1     # a block's matrices, its LayerNorms

    def part(flag):
        monkeypatch.setattr(ce, "OVERLAP_NORM", flag)
        return dict((n, shape) for n, shape, _ in ce.arena_layout(mc, 2, "bf16").spec)["norm_part"]

    monkeypatch.setattr(ce, "NORM_CHUNK", 64)                  # more slots than NORM_BLOCKS
    assert part(True) == (ce.norm_slots(pieces)[1],) and part(True)[0] > ce.NORM_BLOCKS
    assert part(False) == (ce.NORM_BLOCKS,)


def test_stream_priority_raises_the_engines_stream_on_one_gpu_only(monkeypatch):
    import andrea.cuda.engine as ce

    assert ce.STREAM_PRIORITY is True                                        # committed since session 38
    assert ce.stream_priority(1) == ce.PRIORITY_HIGH < 0                     # lower = greater in CUDA
    assert ce.stream_priority(2) is None                                     # NCCL's streams keep their say
    monkeypatch.setattr(ce, "STREAM_PRIORITY", False)
    assert ce.stream_priority(1) is None                                     # off: the default stream
