"""The backend switch: train.backend is one visible choice, never a silent alias.

    pytest tests/test_engine_backend.py
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from andrea.config import load_config
from andrea.engine import ops_cpu
from andrea.backends import NumpyBackend, select_backend
from andrea.engine.schedule import lr_at
from andrea.settings import Settings
from andrea.errors import AndreaError


def _cuda_usable() -> bool:
    try:
        from andrea.cuda.backend import probe
    except ImportError:
        return False
    return probe() is None


def test_numpy_is_numpy():
    be, why = select_backend("numpy")
    assert isinstance(be, NumpyBackend) and be.ops is ops_cpu and why.startswith("numpy")


def test_auto_says_what_it_picked_and_why():
    be, why = select_backend("auto")
    assert why.startswith(be.name + ":")
    if not _cuda_usable():
        assert be.name == "numpy" and "cupy is not usable" in why


def test_cupy_never_falls_back():
    if _cuda_usable():
        be, _ = select_backend("cupy")
        assert be.name == "cupy"
    else:
        with pytest.raises(AndreaError, match="train.backend=cupy: no usable CUDA backend"):
            select_backend("cupy")


def test_unknown_backend_is_refused():
    with pytest.raises(AndreaError, match="unknown backend"):
        select_backend("numpyy")


def test_every_op_of_the_contract_exists_on_the_numpy_backend():
    names = {"embed", "layernorm", "attn_qkv", "attn", "attn_out", "mlp", "residual_add", "loss"}
    for n in names:
        assert callable(getattr(NumpyBackend.ops, f"{n}_forward"))
        assert callable(getattr(NumpyBackend.ops, f"{n}_backward"))
    for n in ("grad_norm_partial", "grad_norm_final", "grad_scale", "adamw", "work_elems"):
        assert callable(getattr(NumpyBackend.ops, n))


def test_lr_schedule_warmup_then_cosine():
    tiny = Settings.from_dict(load_config("params.yaml", "tiny")).train
    t = replace(tiny, lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert lr_at(0, t) == pytest.approx(0.1)
    assert lr_at(9, t) == pytest.approx(1.0)
    assert lr_at(10, t) == pytest.approx(1.0)
    assert lr_at(60, t) == pytest.approx(0.55)
    assert lr_at(110, t) == pytest.approx(0.1)
    assert lr_at(500, t) == pytest.approx(0.1)
    assert all(lr_at(s, t) >= lr_at(s + 1, t) for s in range(10, 120))


def test_every_op_the_recipe_calls_exists_on_every_op_set():
    """The model is written once (andrea/engine/recipe.py): each op set it runs on (NumPy, the fp32
    CuPy mirror, the GPU engine's FastOps) has every op it calls. Checked without a GPU."""
    import ast
    import inspect

    from andrea.cuda.engine import FastOps
    from andrea.cuda.mirror import MirrorOps
    from andrea.engine import recipe

    tree = ast.parse(inspect.getsource(recipe))
    called = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
              and isinstance(n.func.value, ast.Name) and n.func.value.id == "ops"}
    assert {"embed_forward", "attn_backward", "loss_backward", "gelu_forward"} <= called
    for opset in (NumpyBackend.ops, MirrorOps, FastOps):
        missing = sorted(n for n in called if not callable(getattr(opset, n, None)))
        assert not missing, f"{opset.__name__}: no {missing}"
        if opset is not NumpyBackend.ops:     # same argument names as the NumPy reference
            for n in called:
                want = list(inspect.signature(getattr(NumpyBackend.ops, n)).parameters)
                got = list(inspect.signature(getattr(opset, n)).parameters)[1:]
                assert got == want, f"{opset.__name__}.{n}{tuple(got)} != ops_numpy.{n}{tuple(want)}"


def test_the_16bit_arena_pads_logits_rows_and_holds_the_cublaslt_workspace():
    """bf16/fp16/fp8: logits rows of V rounded up to LOGITS_PAD elements and the zero-padded head
    copy wte_pad (fp8's head is a bf16 GEMM), cuBLASLt's workspace in the arena (planned, not beside
    it), the LayerNorm outputs kept per layer (and h_act where the fc GEMM's GELU epilogue writes it:
    bf16/fp16) but in one buffer in fp8, whose backward reads their kept E4M3 transposes
    (PlanPolicy.shared); fp32 keeps (N, V). The recipe's views are (N, V) either way. Checked without
    a GPU."""
    from andrea.cuda.engine import LOGITS_PAD, arena_layout, fused_gelu
    from andrea.cuda.fp8 import LT_WORKSPACE
    from andrea.engine.model import ModelConfig

    mc = ModelConfig(vocab_size=1001, d_model=64, n_head=2, n_layer=2, context=64)
    N = 2 * mc.context
    for prec, cols in (("bf16", 1024), ("fp16", 1024), ("fp32", 1001), ("fp8", 1024)):
        ar = arena_layout(mc, 2, prec)
        spec = {name: (shape, dt) for name, shape, dt in ar.spec}
        assert spec["logits"][0] == (N, cols), prec
        assert ("lt_ws" in spec) == (prec != "fp32") and (prec == "fp32" or spec["lt_ws"][0] == (LT_WORKSPACE,))
        assert cols % LOGITS_PAD == 0 or prec == "fp32"
        h_layers = mc.n_layer if fused_gelu(prec)[0] and prec != "fp8" else 1   # the fused epilogue keeps h_act
        ln_layers = 1 if prec == "fp8" else mc.n_layer
        assert spec["ln1"][0][0] == ln_layers and spec["h_act"][0][0] == h_layers, prec
        assert ("wte_pad" in spec) == (prec != "fp32") and spec.get("wte_pad", ((cols, 64),))[0] == (cols, 64)


@pytest.mark.parametrize("shape, dtype", [((7,), "float32"), ((3, 5), "float64"), ((2, 3), "int32")])
def test_aligned_zeros_are_zeros_on_a_cache_line(shape, dtype):
    import numpy as np

    from andrea.engine.backend import ALIGN, aligned_zeros
    for _ in range(4):                                        # whatever offset the allocator gives the bytes
        a = aligned_zeros(shape, dtype)
        assert a.shape == shape and a.dtype == np.dtype(dtype) and a.flags.c_contiguous and a.flags.writeable
        assert a.ctypes.data % ALIGN == 0 and not a.any()
        a[...] = 1
        assert a.all()


@pytest.mark.parametrize("B", [1, 3, 16])
def test_every_numpy_engine_buffer_starts_on_a_cache_line(B):
    """NumPy's allocations start 16 bytes past a line, so every row of the engine's buffers straddled one
    (the step ran 2-3% slower, session 43); w, g, m, v, each parameter's and gradient's view, and every planned
    buffer (each slice's scratch included: the first slice's size is rounded up to whole lines) now start on
    one at the tiny profile's widths."""
    from andrea.engine.backend import ALIGN
    from andrea.engine.engine import Engine
    from andrea.engine.model import ModelConfig

    eng = Engine(ModelConfig(vocab_size=1281, d_model=128, n_head=4, n_layer=4, context=128), B, NumpyBackend())
    arrays = {"w": eng.w, "g": eng.g, "m": eng.m, "v": eng.v, **eng.a,
              **{f"W.{k}": v for k, v in eng.W.items()}, **{f"G.{k}": v for k, v in eng.G.items()}}
    off = {k: a.ctypes.data % ALIGN for k, a in arrays.items()}
    assert not {k: o for k, o in off.items() if o}, "buffers off a cache line (byte offsets)"
    assert len(eng.slots) == 1 or "work.1" in eng.a
