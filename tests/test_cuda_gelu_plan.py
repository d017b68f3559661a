"""The GPU engine's plan for the MLP's GELU, without a GPU: bf16/fp16 fuse it into the cuBLASLt
epilogues (andrea/cuda/engine.py FUSE_GELU) and keep h_act per layer (RECOMPUTE_FUSED); fp32 and fp8
run the separate passes and recompute h_act in one buffer (RECOMPUTE); turning the fusion off gives
bf16 the fp32/fp8 plan back. The GPU side: tests/test_cuda_kernels.py, tests/test_cuda_engine.py.

    python -m pytest -q tests/test_cuda_gelu_plan.py
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import andrea.cuda.engine as ce
from andrea.engine.model import ModelConfig

MC = ModelConfig(vocab_size=97, d_model=64, n_head=2, n_layer=3, context=128)


def h_act_layers(prec: str) -> int:
    lay = ce.arena_layout(MC, 2, prec)
    return dict((n, s) for n, s, _ in lay.spec)["h_act"][0]


@pytest.mark.parametrize("prec,layers", [("bf16", 3), ("fp16", 3), ("fp32", 1), ("fp8", 1)])
def test_fused_precisions_keep_h_act_per_layer(prec, layers):
    assert h_act_layers(prec) == layers
    assert ce.recompute_for(prec) == (frozenset() if prec in ("bf16", "fp16") else frozenset({"gelu"}))


def test_without_the_fusion_bf16_recomputes_and_plans_fewer_bytes(monkeypatch):
    fused = ce.arena_layout(MC, 2, "bf16")
    monkeypatch.setattr(ce, "FUSE_GELU", False)
    assert h_act_layers("bf16") == 1 and ce.recompute_for("bf16") == frozenset({"gelu"})
    sep = ce.arena_layout(MC, 2, "bf16")
    h = 2 * MC.context * 4 * MC.d_model * np.dtype(np.uint16).itemsize     # one layer's h_act, B = 2
    assert fused.nbytes - sep.nbytes == (MC.n_layer - 1) * h
    assert math.prod(dict((n, s) for n, s, _ in sep.spec)["h_pre"]) == MC.n_layer * h // 2
