"""The GPU engine's plan for the MLP's GELU, without a GPU: bf16/fp16/fp8 fuse it into the cuBLASLt
epilogues (andrea/cuda/engine.py FUSE_GELU; fp8's GEMMs FUSE_GELU_FP8) and keep h_act per layer
(RECOMPUTE_FUSED); fp32 runs the separate passes and recomputes h_act in one buffer (RECOMPUTE);
turning the fusion off gives bf16 the fp32 plan back, and fp8 its plan before the fusion. The GPU
side: tests/test_cuda_kernels.py, tests/test_cuda_engine.py, tests/test_fp8_gpu.py.

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


@pytest.mark.parametrize("prec,layers", [("bf16", 3), ("fp16", 3), ("fp32", 1), ("fp8", 3)])
def test_fused_precisions_keep_h_act_per_layer(prec, layers):
    assert h_act_layers(prec) == layers
    assert ce.recompute_for(prec) == (frozenset() if prec != "fp32" else frozenset({"gelu"}))
    assert ce.fused_gelu(prec) == ((True, True) if prec != "fp32" else (False, False))


@pytest.mark.parametrize("fp8_gemms,fused,layers", [(frozenset(), (False, False), 1), ({"fwd"}, (True, False), 3),
                                                    ({"bwd"}, (False, True), 1)])
def test_fp8_fusion_choice_sets_its_gemms_and_plan(monkeypatch, fp8_gemms, fused, layers):
    """Only a fused fc forward keeps h_act per layer (it comes out of the GEMM); the empty set is
    fp8's plan before the fusion; bf16 does not follow FUSE_GELU_FP8."""
    full = ce.arena_layout(MC, 2, "fp8")
    monkeypatch.setattr(ce, "FUSE_GELU_FP8", frozenset(fp8_gemms))
    assert ce.fused_gelu("fp8") == fused and ce.fused_gelu("bf16") == (True, True)
    assert h_act_layers("fp8") == layers
    h = 2 * MC.context * 4 * MC.d_model * np.dtype(np.uint16).itemsize     # one layer's h_act, B = 2
    assert full.nbytes - ce.arena_layout(MC, 2, "fp8").nbytes == (MC.n_layer - layers) * h
    monkeypatch.setattr(ce, "FUSE_GELU", False)
    assert ce.fused_gelu("fp8") == (False, False) and h_act_layers("fp8") == 1


def test_without_the_fusion_bf16_recomputes_and_plans_fewer_bytes(monkeypatch):
    fused = ce.arena_layout(MC, 2, "bf16")
    monkeypatch.setattr(ce, "FUSE_GELU", False)
    assert h_act_layers("bf16") == 1 and ce.recompute_for("bf16") == frozenset({"gelu"})
    sep = ce.arena_layout(MC, 2, "bf16")
    h = 2 * MC.context * 4 * MC.d_model * np.dtype(np.uint16).itemsize     # one layer's h_act, B = 2
    assert fused.nbytes - sep.nbytes == (MC.n_layer - 1) * h
    assert math.prod(dict((n, s) for n, s, _ in sep.spec)["h_pre"]) == MC.n_layer * h // 2
