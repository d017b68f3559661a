"""The NumPy engine against an independent PyTorch CPU implementation (andrea.engine.oracle_torch):
same weights and batch -> same logits, loss and every gradient; the first 10 AdamW steps
(with clipping) -> the same losses. Skipped with a reason where torch is not installed.

    pytest tests/test_engine_oracle.py
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the optional 'oracle' extra) is not installed")

from andrea.engine import ops_numpy  # noqa: E402
from andrea.engine.backend import NumpyBackend  # noqa: E402
from andrea.engine.engine import Engine, Hyper  # noqa: E402
from andrea.engine.model import ModelConfig  # noqa: E402
from andrea.engine.oracle_torch import TorchGPT  # noqa: E402

MC = ModelConfig(vocab_size=67, d_model=32, n_head=4, n_layer=2, context=16)
B = 4
# Stated tolerances: |ours - ref| <= ATOL + RTOL * |ref|, elementwise.
TOL = {"float64": dict(atol=1e-10, rtol=1e-8), "float32": dict(atol=2e-6, rtol=2e-4)}


def _setup(dtype):
    eng = Engine(MC, B, NumpyBackend(), dtype=dtype)
    eng.init_weights(7)
    rng = np.random.default_rng(8)
    # non-default LayerNorm params so their gradients are exercised away from g=1, b=0
    for t in eng.layout.tensors:
        if not t.decay:
            eng.W[t.name][:] += rng.normal(0, 0.1, t.shape)
    x = rng.integers(0, MC.vocab_size, (B, MC.context)).astype(np.int32)
    y = rng.integers(0, MC.vocab_size, (B, MC.context)).astype(np.int32)
    ref = TorchGPT(MC, dtype=getattr(torch, dtype))
    ref.load_flat(np.asarray(eng.w))
    return eng, ref, x, y


def _close(ours, ref, what, tol):
    err = np.abs(ours - ref)
    bound = tol["atol"] + tol["rtol"] * np.abs(ref)
    worst = int(np.argmax(err - bound))
    assert (err <= bound).all(), (f"{what}: |ours-ref| {err.flat[worst]:.3e} > {bound.flat[worst]:.3e} "
                                  f"at {worst} (ref {ref.flat[worst]:.4e})")


@pytest.mark.parametrize("dtype,att_block", [("float64", 64), ("float32", 64), ("float64", 5)])
def test_logits_loss_and_every_gradient_match_torch(monkeypatch, dtype, att_block):
    monkeypatch.setattr(ops_numpy, "ATT_BLOCK", att_block)     # 5 < context: causal blocks skipped
    tol = TOL[dtype]
    eng, ref, x, y = _setup(dtype)
    eng.zero_grads()
    loss = eng.forward(x, y)
    logits = eng.a["logits"].reshape(B, MC.context, -1).copy()
    eng.backward(1.0 / eng.N)
    r_logits, r_loss = ref(torch.from_numpy(x).long(), torch.from_numpy(y).long())
    r_loss.backward()
    _close(logits, r_logits.detach().numpy(), "logits", tol)
    _close(np.array(loss), np.array(r_loss.item()), "loss", tol)
    rg = ref.flat_grads()
    for t in eng.layout.tensors:
        sl = slice(t.offset, t.offset + t.size)
        assert np.abs(rg[sl]).max() > 0, t.name
        _close(eng.g[sl], rg[sl], f"grad {t.name}", tol)


def test_ten_adamw_steps_match_torch():
    eng, ref, _, _ = _setup("float32")
    hp = Hyper(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=1.0)
    lr = 1e-2
    opt = ref.adamw(lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, foreach=False)
    rng = np.random.default_rng(9)
    ours, theirs = [], []
    clipped = 0
    x = rng.integers(0, MC.vocab_size, (B, MC.context)).astype(np.int32)
    y = np.roll(x, -1, axis=1)
    for step in range(10):                           # one fixed batch: the loss must fall (memorizing)
        res = eng.train_step([(x, y)], lr, step + 1, hp)
        assert res.ok
        ours.append(res.loss)
        opt.zero_grad()
        _, loss = ref(torch.from_numpy(x).long(), torch.from_numpy(y).long())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), hp.grad_clip)
        clipped += float(norm) > hp.grad_clip
        assert res.grad_norm == pytest.approx(float(norm), rel=1e-4)
        opt.step()
        theirs.append(loss.item())
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)
    assert ours[-1] < ours[0] - 0.05, "the model did not learn: the comparison would be vacuous"
    # An AdamW step moves an entry by about lr whenever |g| >> eps, in the direction of g, so where g
    # passes near zero in some step the float32 rounding of the two implementations moves that entry
    # by a small part of lr. Ours is the same bytes under every thread setting; torch's CPU result
    # changes with its thread count (OMP/MKL threads: other bytes) and with the process's state: seen
    # once in a full CI run, 5 of 27552 entries off by up to 2.4e-5 (alone the largest is 9.7e-6).
    # So: every entry within 1e-4 (1% of one step's move) + 1e-3 relative, and all but 0.1% of them
    # within the tight 1e-5.
    w, want = np.asarray(eng.w, np.float64), np.asarray(ref.flat(), np.float64)
    np.testing.assert_allclose(w, want, rtol=1e-3, atol=1e-4)
    assert np.mean(np.abs(w - want) > 1e-5 + 1e-3 * np.abs(want)) < 1e-3
    assert 0 < clipped < 10, "both clipped and unclipped steps should occur"


def test_grad_accumulation_equals_one_big_batch():
    """n microbatches of B with scale 1/n give the gradient of the mean over the 2B rows."""
    eng, ref, x, y = _setup("float64")
    rng = np.random.default_rng(4)
    x2 = rng.integers(0, MC.vocab_size, (B, MC.context)).astype(np.int32)
    y2 = rng.integers(0, MC.vocab_size, (B, MC.context)).astype(np.int32)
    eng.zero_grads()
    for xb, yb in ((x, y), (x2, y2)):
        eng.forward(xb, yb)
        eng.backward(1.0 / eng.N)
    eng.ops.grad_scale(eng.g, 0.5)
    _, loss = ref(torch.from_numpy(np.r_[x, x2]).long(), torch.from_numpy(np.r_[y, y2]).long())
    loss.backward()
    _close(eng.g, ref.flat_grads(), "accumulated grads", TOL["float64"])
