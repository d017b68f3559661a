"""The CUDA-graph decode step (andrea/cuda/decode.py) against its NumPy twin, InferenceModel.

    PYTHONPATH=. python3 -m pytest -m gpu tests/test_generate_decode_gpu.py     # on a machine with a GPU

Skipped cleanly where CuPy cannot be imported or finds no CUDA device.
Tolerances on the logits of every position (|got - ref| <= atol + rtol |ref|):
- fp32: 1e-4 + 1e-3 |ref| (cuBLAS vs BLAS summation order, fp32; as tests/test_generate_gpu.py);
- bf16: 0.08 + 0.03 |ref| (the matmul inputs and the KV cache are rounded to bf16, 2^-9 relative
  each, through 2 layers of width 64: measured max 0.012 at |logit| <= 2 on the H200, fp32 8.6e-7).
The graph and the eager launches of the same step are the same kernels: their ids must be equal.
"""

from __future__ import annotations

import numpy as np
import pytest

from andrea.cuda.loader import cupy_or_none
from andrea.engine.backend import NumpyBackend
from andrea.engine.engine import Engine
from andrea.engine.model import ModelConfig
from andrea.generate import InferenceModel, SamplingOptions, generate

cp = cupy_or_none()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason="CuPy cannot be imported or finds no CUDA device")]

MC = ModelConfig(vocab_size=301, d_model=64, n_head=4, n_layer=2, context=48)
TOL = {"fp32": (1e-4, 1e-3), "bf16": (0.08, 0.03)}


def weights():
    eng = Engine(MC, batch_size=1, backend=NumpyBackend())
    eng.init_weights(seed=11)
    eng.w[:] += 0.05 * np.random.default_rng(3).standard_normal(eng.n_params).astype(np.float32)
    return eng.w


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_graph_decode_logits_match_numpy_at_every_position(prec):
    from andrea.cuda.decode import GraphDecoder

    w = weights()
    cpu = InferenceModel(MC, w)
    dec = GraphDecoder(MC, cp.asarray(w), precision=prec)
    ids = np.random.default_rng(5).integers(0, MC.vocab_size, size=MC.context).astype(np.int32)
    want = cpu.forward(ids, all_logits=True).copy()
    got = np.stack([cp.asnumpy(dec.forward([t])[0]) for t in ids])
    atol, rtol = TOL[prec]
    err = np.abs(got - want)
    print(f"{prec}: max |err| {err.max():.3g}, max |ref| {np.abs(want).max():.3g}")
    assert (err <= atol + rtol * np.abs(want)).all(), float(err.max())


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_graph_greedy_equals_eager_and_generate_past_the_context(prec):
    from andrea.cuda.decode import GraphDecoder

    w = cp.asarray(weights())
    g = GraphDecoder(MC, w, precision=prec)
    e = GraphDecoder(MC, w, precision=prec, use_graph=False)
    prompt = [1, 2, 3, 4, 5]
    n = 2 * MC.context + 7                                  # slides the window twice
    a = g.greedy(prompt, n)
    assert len(a) == n and a == e.greedy(prompt, n)
    host = generate(g, prompt, SamplingOptions(max_new_tokens=n, temperature=0, stop_at_eot=False), 0).ids
    assert host == a                                         # device arg-max == the host sampler's, same window rule
    stop = a[10]
    assert g.greedy(prompt, n, eot_id=stop) == a[:a.index(stop)]
    if prec == "fp32":
        cpu = generate(InferenceModel(MC, weights()), prompt,
                       SamplingOptions(max_new_tokens=20, temperature=0, stop_at_eot=False), 0).ids
        assert cpu[:10] == a[:10]                            # near-ties may split later; the start must agree


def test_graph_decode_samples_reproducibly_through_generate():
    from andrea.cuda.decode import GraphDecoder

    dec = GraphDecoder(MC, cp.asarray(weights()), precision="bf16")
    opts = SamplingOptions(max_new_tokens=70, temperature=1.0, top_k=50, top_p=0.9, stop_at_eot=False)
    a = generate(dec, [4, 5], opts, 9).ids
    assert len(a) == 70 and a == generate(dec, [4, 5], opts, 9).ids and a != generate(dec, [4, 5], opts, 10).ids
