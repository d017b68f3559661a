"""CPU checks of the GPU decoder's NumPy twins (andrea/cuda/decode.py): the kernels' rules, wired as
the decode step, give the model's logits; the split-softmax attention equals the plain softmax.

    pytest tests/test_generate_decode.py

Tolerances (|got - ref| <= atol + rtol |ref|): fp32 twins vs InferenceModel (float32) 1e-4 + 1e-4 |ref|;
bf16 twins 0.08 + 0.03 |ref| (the GPU test's bound for bf16 against fp32, tests/test_generate_decode_gpu.py);
the attention combine vs a one-pass softmax in float64: 1e-12 + 1e-12 |ref|.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from andrea.cuda.decode import ATTN_CHUNK, ref_attn, ref_decode, round_to
from andrea.engine.backend import NumpyBackend
from andrea.engine.engine import Engine
from andrea.engine.model import ModelConfig
from andrea.generate import InferenceModel

MC = ModelConfig(vocab_size=101, d_model=32, n_head=2, n_layer=2, context=80)   # 80 > ATTN_CHUNK: 2 chunks


def weights(mc):
    eng = Engine(mc, batch_size=1, backend=NumpyBackend())
    eng.init_weights(seed=11)
    eng.w[:] += 0.05 * np.random.default_rng(3).standard_normal(eng.n_params).astype(np.float32)
    return eng.w


@pytest.mark.parametrize("prec,atol,rtol", [("fp32", 1e-4, 1e-4), ("bf16", 0.08, 0.03)])
def test_twins_wired_as_the_step_give_the_models_logits(prec, atol, rtol):
    assert MC.context > ATTN_CHUNK
    w = weights(MC)
    ids = np.random.default_rng(5).integers(0, MC.vocab_size, size=MC.context).astype(np.int32)
    want = InferenceModel(MC, w).forward(ids, all_logits=True).astype(np.float64)
    got = ref_decode(MC, w, ids, prec)
    err = np.abs(got - want)
    assert (err <= atol + rtol * np.abs(want)).all(), float(err.max())


@pytest.mark.parametrize("n", [1, 63, 64, 65, 200])
def test_split_attention_combine_equals_one_softmax(n):
    rng = np.random.default_rng(n)
    D = 16
    q, k, v = rng.standard_normal(D), 3 * rng.standard_normal((n, D)), rng.standard_normal((n, D))
    s = k @ q / math.sqrt(D)
    p = np.exp(s - s.max())
    want = (p / p.sum()) @ v
    for chunk in (ATTN_CHUNK, 7):
        got = ref_attn("fp64", q, k, v, n, 1 / math.sqrt(D), chunk)       # fp64: no storage rounding
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_round_to_bf16_is_round_to_nearest_even():
    one = 1.0
    ulp = 2.0 ** -7                                     # bf16 spacing at 1
    x = np.array([one + ulp / 2, one + 1.5 * ulp, one + 0.49 * ulp, -3.0], np.float32)
    assert round_to("bf16", x).tolist() == [one, one + 2 * ulp, one, -3.0]


def test_splitmix64_and_the_device_uniform():
    from andrea.cuda.decode import ref_uniform, splitmix64

    assert splitmix64(0) == 0xE220A8397B1DCDAF            # the published first output of splitmix64(0)
    us = [ref_uniform(7, c) for c in range(2000)]
    assert us == [ref_uniform(7, c) for c in range(2000)] and us != [ref_uniform(8, c) for c in range(2000)]
    assert min(us) >= 0 and max(us) < 1 and abs(np.mean(us) - 0.5) < 0.02
    assert all(u * 2 ** 24 == int(u * 2 ** 24) for u in us)  # 24-bit: exact in fp32 on the device


def sampling_cases():
    """Logit rows with the cases the rule has to get right: ties (at the top-k and top-p cuts),
    NaN and -inf entries, a peaked row, a flat one; with the options that cut each way."""
    rng = np.random.default_rng(0)
    rows = [rng.standard_normal(301) * s for s in (0.5, 2.0, 6.0)]
    tied = np.round(rng.standard_normal(301), 1)            # many exact ties
    bad = rng.standard_normal(301)
    bad[[3, 50]] = np.nan
    bad[[7, 8]] = -np.inf
    rows += [tied, bad, np.zeros(301)]
    opts = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 40, 1.0), (1.0, 1, 1.0), (1.3, 0, 0.9), (0.8, 40, 0.95),
            (1.0, 5, 0.3), (1.0, 300, 0.5), (1.0, 301, 1.0)]
    return [(r.astype(np.float32), o) for r in rows for o in opts]


def test_the_device_sampling_rule_is_the_host_samplers():
    """ref_sample (k_dec_sample's twin) picks the token draw(next_token_probs(...)) picks with the
    same uniform, wherever the draw is not within 1e-5 of a threshold."""
    from copy import deepcopy

    from andrea.cuda.decode import ref_sample
    from andrea.generate import draw, next_token_probs

    n, ambiguous = 0, 0
    rng = np.random.default_rng(1)
    for logits, (t, k, p) in sampling_cases():
        for _ in range(40):
            u = deepcopy(rng).random()                      # the uniform draw() is about to take
            want = draw(next_token_probs(logits, t, k, p), rng)
            got, amb = ref_sample(logits, t, k, p, u)
            ambiguous += amb
            n += 1
            assert amb or got == want, (t, k, p, u, got, want)
    assert ambiguous <= n // 50
