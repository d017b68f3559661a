"""bench/engine_cpu.py's --breakdown without a long run: the classes of the anchor's aten ops, the engine's
op timing (BLAS calls moved to matmul outside attention, nested ops counted once, everything put back), a
real engine's and a real torch model's few steps adding up to their step time, and the table.

    python -m pytest -q tests/test_bench_engine_cpu.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import engine_cpu as ec  # noqa: E402


@pytest.mark.parametrize("name,cls", [
    ("aten::mm", "matmul (BLAS)"), ("aten::addmm", "matmul (BLAS)"), ("aten::matmul", "other"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
    ("aten::gelu_backward", "GELU"), ("aten::_log_softmax_backward_data", "loss (softmax, cross-entropy)"),
    ("aten::nll_loss_forward", "loss (softmax, cross-entropy)"), ("aten::native_layer_norm", "LayerNorm + residual"),
    ("aten::add", "LayerNorm + residual"), ("aten::add_", "other"), ("aten::_fused_adamw_", "optimizer (norm, clip, AdamW)"),
    ("aten::_foreach_mul_", "optimizer (norm, clip, AdamW)"), ("aten::linalg_vector_norm", "optimizer (norm, clip, AdamW)"),
    ("aten::embedding_dense_backward", "embedding"), ("aten::index", "embedding"), ("aten::fill_", "other")])
def test_the_anchors_aten_ops_fall_in_their_classes(name, cls):
    assert ec.torch_class(name) == cls


def test_ours_moves_blas_time_to_matmul_outside_attention_and_counts_a_nested_op_once(monkeypatch):
    """On a fake clock that only the fake work advances, so every figure is exact."""
    clock = [0.0]
    monkeypatch.setattr(ec, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def _busy(s: float) -> None:
        clock[0] += s

    calls = []

    def mlp_forward():                    # 4 ms of GEMM, 2 ms of its own
        np.matmul(np.ones((2, 2)), np.ones((2, 2)))
        _busy(0.002)
        calls.append("mlp")

    def attn_forward():                   # its GEMM stays attention's, and the op it calls is its own
        np.matmul(np.ones((2, 2)), np.ones((2, 2)))
        ops.layernorm_forward()
        _busy(0.002)

    def layernorm_forward():
        _busy(0.001)

    ops = SimpleNamespace(mlp_forward=mlp_forward, attn_forward=attn_forward, layernorm_forward=layernorm_forward)
    orig = np.matmul

    def slow_matmul(*a, **k):
        _busy(0.004)
        return orig(*a, **k)

    monkeypatch.setattr(np, "matmul", slow_matmul)
    saved = dict(vars(ops))

    def step(i):
        ops.mlp_forward()
        ops.attn_forward()
        ops.layernorm_forward()
        _busy(0.003)                      # the engine's own work between ops

    got = ec.ours_breakdown(ops, step, 2)
    c = got["classes"]
    assert set(c) == set(ec.CLASSES) and calls == ["mlp", "mlp"]
    assert got["step_ms"] == pytest.approx(4 + 2 + 4 + 1 + 2 + 1 + 3)
    assert c == pytest.approx({"matmul (BLAS)": 4.0,      # mlp's GEMM only
                               "GELU": 2.0,
                               "attention": 7.0,          # 4 + 1 + 2: its GEMM and its nested LayerNorm
                               "LayerNorm + residual": 1.0,   # the top-level call alone
                               "other": 3.0,
                               "loss (softmax, cross-entropy)": 0.0, "optimizer (norm, clip, AdamW)": 0.0,
                               "embedding": 0.0})
    assert vars(ops) == saved and np.matmul is slow_matmul   # everything put back


def test_a_real_engines_breakdown_adds_up_to_its_step():
    from andrea.engine.backend import NumpyBackend
    from andrea.engine.engine import Engine, Hyper
    from andrea.engine.model import ModelConfig

    mc = ModelConfig(vocab_size=97, d_model=32, n_head=2, n_layer=1, context=16)
    eng = Engine(mc, 2, NumpyBackend())
    eng.init_weights(0)
    x = np.random.default_rng(0).integers(0, 97, (2, 17)).astype(np.int32)
    b = (x[:, :-1].copy(), x[:, 1:].copy())
    mm, fwd = np.matmul, eng.ops.attn_forward
    got = ec.ours_breakdown(eng.ops, lambda i: eng.train_step([b], 1e-3, i + 1, Hyper()), 2)
    c = got["classes"]
    assert abs(sum(c.values()) - got["step_ms"]) < 1e-6
    for k in ("matmul (BLAS)", "attention", "GELU", "loss (softmax, cross-entropy)", "LayerNorm + residual",
              "optimizer (norm, clip, AdamW)", "embedding"):
        assert c[k] > 0, k
    assert np.matmul is mm and eng.ops.attn_forward is fwd


def test_a_torch_models_breakdown_adds_up_to_its_step():
    torch = pytest.importorskip("torch")
    from andrea.engine.engine import init_params
    from andrea.engine.model import ModelConfig
    from andrea.engine.oracle_torch import TorchGPT

    mc = ModelConfig(vocab_size=97, d_model=32, n_head=2, n_layer=1, context=16)
    model = TorchGPT(mc)
    model.load_flat(init_params(mc, 0))
    opt = model.adamw(1e-3, 0.9, 0.95, 1e-8, 0.1, foreach=True)
    x = torch.randint(0, 97, (2, 17))

    def step(i):
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(0)
    got = ec.torch_breakdown(step, 2)
    c = got["classes"]
    assert abs(sum(c.values()) - got["step_ms"]) < 1e-6
    for k in ("matmul (BLAS)", "attention", "GELU", "loss (softmax, cross-entropy)", "LayerNorm + residual",
              "optimizer (norm, clip, AdamW)"):
        assert c[k] > 0, k


def test_the_table_puts_both_sides_by_class(capsys):
    ours = {"step_ms": 10.0, "classes": dict.fromkeys(ec.CLASSES, 1.25)}
    anchor = {"step_ms": 20.0, "classes": {**dict.fromkeys(ec.CLASSES, 2.5), "embedding": 0.0}}
    ec.print_breakdown(ours, anchor, "torch-fused", 3)
    out = capsys.readouterr().out
    assert "over 3 instrumented steps" in out and "torch-fused" in out
    assert "matmul (BLAS)                      1.25     2.50           0.50" in out
    assert "embedding                          1.25     0.00              -" in out
    assert "step (instrumented)               10.00    20.00           0.50" in out


def test_without_torch_the_bench_says_so_in_one_line(monkeypatch, capsys):
    real = ec.importlib.util.find_spec
    monkeypatch.setattr(ec.importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    monkeypatch.setattr(ec, "run_all", lambda args: pytest.fail("no child should start"))
    assert ec.main(["--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("engine_cpu: error: the anchor needs torch") and err.count("\n") == 1


def test_a_bad_profile_is_the_childs_one_line(capsys):
    pytest.importorskip("torch")
    assert ec.main(["--repeats", "1", "--steps", "1", "--warmup", "0", "--profile", "no-such-profile"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("engine_cpu: error: profile 'no-such-profile'") and err.count("\n") == 1
