"""GPU gradient accumulation and fp16 loss scaling, value for value against the NumPy engine.

    PYTHONPATH=. python3 -m pytest -m gpu -s tests/test_cuda_accum.py      # on a machine with a GPU

"Finite" is not the check here: the same microbatches go through ``Engine`` (NumPy, fp32) and
``GpuEngine`` (public surface only: zero_grads, micro_step, apply_update, train_step,
grads_host, state_host, loss_scale), and the accumulated gradients, the pre-clip norm and the
first Adam moment ``m = (1 - beta1) * clipped mean gradient`` (linear in the gradient, unlike
the weight update, whose first AdamW step is about lr * sign(g)) must agree.

Tolerances, relative to each tensor's largest entry, set from what the H200 measured on
these batches (in parentheses) with room for another GPU's summation order: fp32 1e-4 (1e-6:
the same arithmetic summed in another order), fp16 1e-2 (1.3e-3) and bf16 6e-2 (8.7e-3; the
bound of test_cuda_engine.py): the activations are rounded to 11 and 8 significant bits on every
layer (unit roundoff 4.9e-4 and 3.9e-3). Pre-clip norms: 1e-5 fp32, 1e-3 in 16 bits (measured
1e-7, 2e-5). Every bound is far below what a real fault gives (a missing 1/n_micro or loss-scale
division is an error of 100% or more). Each test also checks that what it guards is really
exercised (the microbatches give different gradients; the clip clips; the raw fp16 gradients
carry the 2^12 scale; the overflow really overflows), so it cannot pass by accident.
Skipped cleanly where CuPy finds no CUDA device.
"""

from __future__ import annotations

import numpy as np
import pytest

from andrea.cuda.loader import cupy_or_none
from andrea.engine.backend import NumpyBackend
from andrea.engine.engine import Engine, Hyper
from andrea.engine.model import ModelConfig

cp = cupy_or_none()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason="CuPy cannot be imported or finds no CUDA device")]

MC = ModelConfig(vocab_size=97, d_model=64, n_head=2, n_layer=2, context=128)   # D = 32: the mma path in 16 bits
B = 2
GRAD_TOL = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 6e-2}
NORM_TOL = {"fp32": 1e-5, "fp16": 1e-3, "bf16": 1e-3}


def batch(seed: int):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, MC.vocab_size, (B, MC.context)).astype(np.int32)
    return x, np.roll(x, -1, axis=1)


def engines(prec: str):
    from andrea.cuda.backend import make_backend

    ref = Engine(MC, B, NumpyBackend())
    ref.init_weights(0)
    gpu = make_backend().make_engine(MC, B, precision=prec)
    gpu.init_weights(0)
    assert gpu.state_host()[0].tobytes() == ref.w.tobytes()
    return ref, gpu


def worst(got: np.ndarray, ref: np.ndarray, layout) -> tuple[float, str]:
    """The largest per-tensor error relative to that tensor's largest reference entry."""
    out = (0.0, "")
    for t in layout.tensors:
        a, r = got[t.offset:t.offset + t.size], ref[t.offset:t.offset + t.size]
        e = float(np.abs(a - r).max()) / (float(np.abs(r).max()) or 1.0)
        out = max(out, (e, t.name))
    return out


def assert_close(what: str, got, ref, layout, tol: float) -> None:
    e, name = worst(np.asarray(got, np.float64), np.asarray(ref, np.float64), layout)
    print(f"\n  {what}: worst relative error {e:.2e} ({name}), bound {tol:g}")
    assert e <= tol, f"{what}: {name} off by {e:.3g} of its largest entry (> {tol})"


@pytest.mark.parametrize("prec", ["fp32", "bf16", "fp16"])
def test_accumulated_gradients_match_numpy_on_the_same_microbatches(prec):
    ref, gpu = engines(prec)
    micro = [batch(40 + k) for k in range(3)]
    ref.zero_grads()
    gpu.zero_grads()
    losses = []
    for x, y in micro:
        losses.append((ref.micro_step(x, y), gpu.micro_step(x, y)))
    gpu.be.synchronize()
    scale = gpu.loss_scale
    assert (scale == 2.0 ** 12) if prec == "fp16" else (scale == 1.0)
    for lr_, lg in losses:
        assert abs(lr_ - lg) <= (1e-5 if prec == "fp32" else 2e-2) * abs(lr_)
    assert_close(f"{prec} sum of 3 microbatch gradients", gpu.grads_host() / scale, ref.g, ref.layout, GRAD_TOL[prec])
    # not by accident: one microbatch alone is far from the sum (accumulation really adds)
    ref.zero_grads()
    ref.micro_step(*micro[0])
    assert worst(gpu.grads_host() / scale, ref.g, ref.layout)[0] > 10 * GRAD_TOL[prec]


@pytest.mark.parametrize("prec", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("clip", [0.25, 0.0])
def test_an_accumulated_step_matches_numpy(prec, clip):
    """train_step over 3 microbatches: the same pre-clip norm of the mean gradient and the same
    m = 0.1 x the (clipped) mean gradient; then 4 more steps keep the losses together."""
    ref, gpu = engines(prec)
    hp = Hyper(grad_clip=clip)
    micro = [batch(70 + k) for k in range(3)]
    a = ref.train_step(micro, 3e-3, 1, hp)
    b = gpu.train_step(micro, 3e-3, 1, hp)
    assert a.ok and b.ok
    tol = GRAD_TOL[prec]
    print(f"\n  {prec} clip={clip}: grad norm numpy {a.grad_norm:.6g} gpu {b.grad_norm:.6g}")
    assert abs(a.grad_norm - b.grad_norm) <= NORM_TOL[prec] * a.grad_norm
    if clip:
        assert a.grad_norm > clip                                 # the clip is exercised
    assert_close(f"{prec} clip={clip} Adam m after one accumulated step", gpu.state_host()[1], ref.m, ref.layout, tol)
    assert_close(f"{prec} clip={clip} Adam v after one accumulated step", np.sqrt(gpu.state_host()[2]),
                 np.sqrt(ref.v), ref.layout, tol)
    for t in range(2, 6):
        micro = [batch(100 * t + k) for k in range(3)]
        a = ref.train_step(micro, 3e-3, t, hp)
        b = gpu.train_step(micro, 3e-3, t, hp)
        assert a.ok and b.ok and abs(a.loss - b.loss) <= (1e-3 if prec == "fp32" else 3e-2) * a.loss, (t, a, b)


def test_fp16_gradients_carry_the_loss_scale_and_the_update_removes_it():
    ref, gpu = engines("fp16")
    x, y = batch(5)
    ref.zero_grads()
    ref.micro_step(x, y)
    gpu.zero_grads()
    gpu.micro_step(x, y)
    gpu.be.synchronize()
    raw = gpu.grads_host()
    big = np.abs(ref.g) > 1e-3 * np.abs(ref.g).max()
    ratio = float(np.median(raw[big] / ref.g[big]))
    print(f"\n  fp16 raw / numpy gradient, median over {int(big.sum())} entries: {ratio:.1f} (loss scale 4096)")
    assert abs(ratio - 4096.0) <= 0.02 * 4096.0
    assert_close("fp16 gradient / loss scale", raw / gpu.loss_scale, ref.g, ref.layout, GRAD_TOL["fp16"])


def test_fp16_overflow_halves_the_scale_skips_the_step_then_matches_numpy():
    ref, gpu = engines("fp16")
    micro = [batch(11), batch(12)]
    before = [a.copy() for a in gpu.state_host()]
    gpu.loss_scale = 2.0 ** 24                   # 2^24 / N x (p - 1) does not fit fp16's 65504: inf
    skipped = 0
    while True:
        scale = gpu.loss_scale
        r = gpu.train_step(micro, 3e-3, 1, Hyper())
        if r.ok:
            break
        skipped += 1
        assert gpu.loss_scale == scale / 2, (scale, gpu.loss_scale)
        for p, q in zip(before, gpu.state_host()):
            assert p.tobytes() == q.tobytes()                         # a skipped step touches nothing
        assert skipped < 16
    print(f"\n  fp16: {skipped} overflowing step(s) skipped, first good one at loss scale {scale:g}")
    assert skipped >= 1
    a = ref.train_step(micro, 3e-3, 1, Hyper())
    assert abs(a.grad_norm - r.grad_norm) <= NORM_TOL["fp16"] * a.grad_norm
    assert_close("fp16 Adam m after the first good step", gpu.state_host()[1], ref.m, ref.layout, GRAD_TOL["fp16"])


def test_fp16_scale_doubles_after_1000_good_steps():
    _, gpu = engines("fp16")
    x, y = batch(3)
    start = gpu.loss_scale
    for t in range(1, 1001):
        assert gpu.train_step([(x, y)], 1e-5, t, Hyper()).ok
        if t == 999:
            assert gpu.loss_scale == start
    assert gpu.loss_scale == 2 * start
