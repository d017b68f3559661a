"""The GPU engine's plan for the MLP's GELU, without a GPU: bf16/fp16 fuse it into the cuBLASLt
epilogues (andrea/cuda/engine.py FUSE_GELU) and keep h_act per layer (RECOMPUTE_FUSED); fp32 runs the
separate passes and recomputes h_act in one buffer (RECOMPUTE); fp8 follows FUSE_GELU_FP8 (default
{"fwd"}: the fc forward fused) and, keeping the E4M3 transposes of its GEMM inputs (fp8.SAVE_TRANSPOSES),
holds h_act and the LayerNorm outputs in one buffer each, never read back; turning the fusion off gives
bf16 the fp32 plan back. The GPU
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


@pytest.mark.parametrize("prec,layers", [("bf16", 3), ("fp16", 3), ("fp32", 1), ("fp8", 1)])
def test_fused_precisions_keep_h_act_per_layer(prec, layers):
    """The defaults: fp8 fuses its fc forward only (FUSE_GELU_FP8 = {"fwd"}, the measured choice) and
    shares h_act across layers (its backward reads the kept E4M3 transpose)."""
    assert ce.FUSE_GELU_FP8 == frozenset({"fwd"})
    assert h_act_layers(prec) == layers
    assert ce.recompute_for(prec) == (frozenset({"gelu"}) if prec == "fp32" else frozenset())
    assert ce.fused_gelu(prec) == {"bf16": (True, True), "fp16": (True, True), "fp32": (False, False),
                                   "fp8": (True, False)}[prec]


@pytest.mark.parametrize("fp8_gemms,fused,layers", [({"fwd", "bwd"}, (True, True), 3), ({"fwd"}, (True, False), 3),
                                                    ({"bwd"}, (False, True), 1), (set(), (False, False), 1)])
def test_fp8_fusion_choice_sets_its_gemms_and_plan(monkeypatch, fp8_gemms, fused, layers):
    """Without the kept transposes (fp8.SAVE_TRANSPOSES off): only a fused fc forward keeps h_act per
    layer (it comes out of the GEMM beside h_pre); bf16 does not follow FUSE_GELU_FP8; FUSE_GELU off
    turns fp8's off too."""
    monkeypatch.setattr(ce.fp8_mod, "SAVE_TRANSPOSES", False)
    monkeypatch.setattr(ce, "FUSE_GELU_FP8", frozenset())
    sep = ce.arena_layout(MC, 2, "fp8")                                     # the separate passes' plan
    monkeypatch.setattr(ce, "FUSE_GELU_FP8", frozenset(fp8_gemms))
    assert ce.fused_gelu("fp8") == fused and ce.fused_gelu("bf16") == (True, True)
    assert h_act_layers("fp8") == layers
    assert ce.recompute_for("fp8") == (frozenset() if fused[0] else frozenset({"gelu"}))
    h = 2 * MC.context * 4 * MC.d_model * np.dtype(np.uint16).itemsize     # one layer's h_act, B = 2
    assert ce.arena_layout(MC, 2, "fp8").nbytes - sep.nbytes == (layers - 1) * h
    monkeypatch.setattr(ce, "FUSE_GELU", False)
    assert ce.fused_gelu("fp8") == (False, False) and h_act_layers("fp8") == 1


@pytest.mark.parametrize("fp8_gemms", [{"fwd"}, set(), {"fwd", "bwd"}])
@pytest.mark.parametrize("recompute", ["auto", "gelu"])
def test_fp8_with_kept_transposes_shares_ln_and_h_act_and_recomputes_nothing(monkeypatch, fp8_gemms, recompute):
    """fp8.SAVE_TRANSPOSES (the default): the backward's weight gradients read the kept E4M3 transposes,
    so ln1, ln2 and h_act are one buffer each (PlanPolicy.shared) and the backward refills none of them
    (train.recompute=gelu included); the plan is smaller than without the kept transposes by those
    buffers' other layers, less f8_saved and its slots."""
    monkeypatch.setattr(ce, "FUSE_GELU_FP8", frozenset(fp8_gemms))
    lay = ce.arena_layout(MC, 2, "fp8", recompute=recompute)
    shapes = dict((n, s) for n, s, _ in lay.spec)
    assert shapes["ln1"][0] == shapes["ln2"][0] == shapes["h_act"][0] == 1 and shapes["h_pre"][0] == MC.n_layer
    assert lay.policy.shared == {"ln", "gelu"} and lay.policy.recompute == frozenset()
    N, C, L = 2 * MC.context, MC.d_model, MC.n_layer
    assert math.prod(shapes["f8_saved"]) == (L * 7 + (ce.fp8_mod.FP8_HEAD and ce.fp8_mod.FP8_HEAD_FWD)) * N * C  # + lnf^T
    monkeypatch.setattr(ce.fp8_mod, "SAVE_TRANSPOSES", False)
    plain = ce.arena_layout(MC, 2, "fp8", recompute=recompute)
    assert "f8_saved" not in dict((n, s) for n, s, _ in plain.spec) and plain.policy.shared == frozenset()
    assert ce.arena_layout(MC, 2, "bf16").policy.shared == frozenset()


def test_without_the_fusion_bf16_recomputes_and_plans_fewer_bytes(monkeypatch):
    fused = ce.arena_layout(MC, 2, "bf16")
    monkeypatch.setattr(ce, "FUSE_GELU", False)
    assert h_act_layers("bf16") == 1 and ce.recompute_for("bf16") == frozenset({"gelu"})
    sep = ce.arena_layout(MC, 2, "bf16")
    h = 2 * MC.context * 4 * MC.d_model * np.dtype(np.uint16).itemsize     # one layer's h_act, B = 2
    assert fused.nbytes - sep.nbytes == (MC.n_layer - 1) * h
    assert math.prod(dict((n, s) for n, s, _ in sep.spec)["h_pre"]) == MC.n_layer * h // 2


@pytest.mark.parametrize("fp8_gemms", [set(), {"fwd"}, {"bwd"}, {"fwd", "bwd"}])
def test_fp8_mlp_runs_the_epilogues_it_was_given(monkeypatch, fp8_gemms):
    """FastOps over a recording stand-in for Fp8Gemm: the fc forward with GELU_AUX writing h_act and
    aux h_pre, the proj dgrad with DGELU reading h_pre, and no k_gelu_fwd / k_gelu_bwd pass where an
    epilogue does it; the GEMMs in the order the dY-cast reuse needs (proj dgrad, then its wgrad);
    without the DGELU epilogue the GELU backward is deferred into the cast of dh (fp8.DGELU_CAST) or,
    with that off, k_gelu_bwd."""
    from types import SimpleNamespace

    from andrea.cuda.cublaslt import EPILOGUE_DEFAULT

    monkeypatch.setattr(ce, "FUSE_GELU_FP8", frozenset(fp8_gemms))
    calls = []

    def mm(C, A, B, ta=False, tb=False, beta=0.0, lowtype=None, epilogue=EPILOGUE_DEFAULT, aux=None):
        calls.append(("mm", C.name, A.name, B.name, epilogue, None if aux is None else aux.name))

    for k in ("k_gelu_fwd", "k_gelu_bwd"):
        monkeypatch.setattr(ce, k, lambda *a, _k=k: calls.append((_k,)))
    t = {n: SimpleNamespace(name=n, size=8) for n in ("out", "h_pre", "h_act", "x", "w_fc", "w_proj", "dx", "dw_fc",
                                                      "dw_proj", "dout", "dh")}
    for dgelu_cast in (True, False):      # Fp8Gemm.defers_dgelu: gelu' inside the next GEMM's cast of dh, or k_gelu_bwd
        calls.clear()
        f8 = SimpleNamespace(mm=mm, defers_dgelu=dgelu_cast,
                             defer_dgelu=lambda G, hp: calls.append(("defer", G.name, hp.name)))
        _mlp_calls(ce.FastOps("bf16", None, {"dh": t["dh"]}, f8=f8), t, calls, fp8_gemms, dgelu_cast)


def _mlp_calls(ops, t, calls, fp8_gemms, dgelu_cast):
    from andrea.cuda.cublaslt import EPILOGUE_DEFAULT, EPILOGUE_DGELU, EPILOGUE_GELU_AUX

    assert (ops.fused, ops.fused_bwd) == ("fwd" in fp8_gemms, "bwd" in fp8_gemms)
    ops.mlp_forward(t["out"], t["h_pre"], t["h_act"], t["x"], t["w_fc"], t["w_proj"])
    fc = [("mm", "h_act", "x", "w_fc", EPILOGUE_GELU_AUX, "h_pre")] if ops.fused else \
        [("mm", "h_pre", "x", "w_fc", EPILOGUE_DEFAULT, None), ("k_gelu_fwd",)]
    assert calls == fc + [("mm", "out", "h_act", "w_proj", EPILOGUE_DEFAULT, None)]
    calls.clear()
    ops.mlp_backward(t["dx"], t["dw_fc"], t["dw_proj"], t["dout"], t["x"], t["h_pre"], t["h_act"], t["w_fc"],
                     t["w_proj"], None)
    dgrad = ("mm", "dh", "dout", "w_proj", EPILOGUE_DGELU if ops.fused_bwd else EPILOGUE_DEFAULT,
             "h_pre" if ops.fused_bwd else None)
    wgrad = ("mm", "dw_proj", "h_act", "dout", EPILOGUE_DEFAULT, None)
    gelu_bwd = [("defer", "dh", "h_pre")] if dgelu_cast else [("k_gelu_bwd",)]
    assert calls == [dgrad, wgrad] + ([] if ops.fused_bwd else gelu_bwd) + [
        ("mm", "dw_fc", "x", "dh", EPILOGUE_DEFAULT, None), ("mm", "dx", "dh", "w_fc", EPILOGUE_DEFAULT, None)]
