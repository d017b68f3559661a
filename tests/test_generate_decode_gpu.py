"""The CUDA-graph decode step (andrea/cuda/decode.py) against its NumPy twins: each kernel of
decode.cu against its ``ref_*`` function, the whole step against InferenceModel and ``ref_decode``.

    PYTHONPATH=. python3 -m pytest -m gpu tests/test_generate_decode_gpu.py     # on a machine with a GPU

Skipped cleanly where CuPy cannot be imported or finds no CUDA device. Every check is
|got - ref| <= atol + rtol |ref| elementwise; outputs are prefilled with NaN.
- kernels vs their twins (float64 on the same rounded inputs): KTOL, fp32 1e-5 s + 1e-4 |ref|
  (fp32 summation order over K <= 3072; s = the output's scale), bf16 1e-2 s + 1e-2 |ref| and fp16
  2e-3 s + 2e-3 |ref| (the output is rounded to the storage type: 2^-8 / 2^-11 relative, so an
  accumulation a hair either side of a rounding boundary moves it by one unit);
- logits of every position vs InferenceModel (fp32): fp32 1e-4 + 1e-3 |ref| (summation order, as
  tests/test_generate_gpu.py); bf16 and fp16 0.08 + 0.03 |ref| (the matmul inputs and the KV cache
  are rounded, 2^-9 relative each, through 2 layers of width 64: measured max 0.012 at |logit| <= 2
  on the H200 with the previous kernels, fp32 8.6e-7); the same bounds against ``ref_decode``.
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
MC_LONG = ModelConfig(vocab_size=257, d_model=128, n_head=2, n_layer=2, context=160)   # 3 attention chunks
TOL = {"fp32": (1e-4, 1e-3), "bf16": (0.08, 0.03), "fp16": (0.08, 0.03)}
KTOL = {"fp32": (1e-5, 1e-4), "bf16": (1e-2, 1e-2), "fp16": (2e-3, 2e-3)}


def weights(mc=MC):
    eng = Engine(mc, batch_size=1, backend=NumpyBackend())
    eng.init_weights(seed=11)
    eng.w[:] += 0.05 * np.random.default_rng(3).standard_normal(eng.n_params).astype(np.float32)
    return eng.w


def within(got, ref, atol, rtol, what):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(got).all(), f"{what}: non-finite output"
    err = np.abs(got - ref)
    print(f"{what}: max |err| {err.max():.3g}, max |ref| {np.abs(ref).max():.3g}")
    assert (err <= atol + rtol * np.abs(ref)).all(), f"{what}: max excess {float((err - atol - rtol * np.abs(ref)).max()):.3g}"


def dev(x, prec):
    """Host floats -> the device storage payload and the rounded float64 values the kernel sees."""
    from andrea.cuda.decode import round_to

    r = round_to(prec, x)
    if prec == "fp32":
        return cp.asarray(r.astype(np.float32)), r
    if prec == "fp16":
        return cp.asarray(r.astype(np.float16).view(np.uint16)), r
    return cp.asarray((r.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)), r


def host(a, prec):
    h = cp.asnumpy(a)
    if h.dtype == np.float32:
        return h.astype(np.float64)
    if prec == "fp16":
        return h.view(np.float16).astype(np.float64)
    return (h.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def nan_like(shape, prec):
    if prec == "fp32":
        return cp.full(shape, np.nan, np.float32)
    return cp.full(shape, 0x7FFF if prec == "bf16" else 0x7E00, np.uint16)


@pytest.mark.parametrize("prec", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("C,N", [(64, 192), (768, 2304), (384, 1536), (768, 8449)])
def test_ln_gemv_kernel_matches_its_twin_in_every_mode(prec, C, N):
    from andrea.cuda.decode import MODE_GELU, MODE_LOGITS, MODE_QKV, GraphDecoder, ref_ln_gemv

    rng = np.random.default_rng(C + N)
    dec = GraphDecoder(MC, cp.asarray(weights()), precision=prec)      # its launchers and state
    x = (2 * rng.standard_normal(C) + 0.5).astype(np.float32)
    g = (1 + 0.1 * rng.standard_normal(C)).astype(np.float32)
    b = (0.1 * rng.standard_normal(C)).astype(np.float32)
    wd, wh = dev(rng.standard_normal((N, C)) / np.sqrt(C), prec)
    for mode in (MODE_GELU, MODE_LOGITS) + ((MODE_QKV,) if N % 3 == 0 and C == MC.d_model else ()):
        ref = ref_ln_gemv(prec, x, g, b, wh, mode)
        if mode == MODE_QKV:                       # q rows out, k and v rows into the caches at state[1]
            Cq, H, D, pos = C, MC.n_head, MC.head_dim, 7
            q, kc, vc = nan_like((Cq,), prec), nan_like((H, MC.context, D), prec), nan_like((H, MC.context, D), prec)
            dec.state[:] = cp.asarray([0, pos, 0, 0], dtype=np.int32)
            dec.ln_gemv(cp.asarray(x), cp.asarray(g), cp.asarray(b), wd, mode, q, kc, vc)
            got = np.concatenate([host(q, prec), host(kc, prec)[:, pos].reshape(-1), host(vc, prec)[:, pos].reshape(-1)])
        else:
            out = cp.full(N, np.nan, np.float32) if mode == MODE_LOGITS else nan_like((N,), prec)
            dec.ln_gemv(cp.asarray(x), cp.asarray(g), cp.asarray(b), wd, mode, out)
            got = host(out, "fp32" if mode == MODE_LOGITS else prec)
        cp.cuda.Device().synchronize()
        atol, rtol = KTOL["fp32" if mode == MODE_LOGITS else prec]
        within(got, ref, atol * np.abs(ref).max(), rtol, f"ln_gemv {prec} C={C} N={N} mode {mode}")


@pytest.mark.parametrize("prec", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("K,N", [(64, 64), (768, 768), (3072, 768), (1536, 384)])
def test_gemv_residual_kernel_matches_its_twin(prec, K, N):
    from andrea.cuda.decode import GraphDecoder, ref_gemv_res

    rng = np.random.default_rng(K * N)
    dec = GraphDecoder(MC, cp.asarray(weights()), precision=prec)
    x = rng.standard_normal(N).astype(np.float32)
    ad, ah = dev(rng.standard_normal(K), prec)
    wd, wh = dev(rng.standard_normal((N, K)) / np.sqrt(K), prec)
    xd = cp.asarray(x)
    dec.gemv_res(ad, wd, xd)
    ref = ref_gemv_res(prec, x, ah, wh)
    atol, rtol = KTOL[prec]
    within(cp.asnumpy(xd), ref, atol * np.abs(ref).max(), rtol, f"gemv_res {prec} K={K} N={N}")


@pytest.mark.parametrize("prec", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("n", [1, 64, 65, 160])
def test_split_attention_kernel_matches_its_twin_and_repeats_bitwise(prec, n):
    from andrea.cuda.decode import GraphDecoder, ref_attn

    mc = MC_LONG
    H, T, D = mc.n_head, mc.context, mc.head_dim
    rng = np.random.default_rng(n)
    dec = GraphDecoder(mc, cp.asarray(weights(mc)), precision=prec)
    qd, qh = dev(rng.standard_normal(H * D), prec)
    kd, kh = dev(2 * rng.standard_normal((H, T, D)), prec)
    vd, vh = dev(rng.standard_normal((H, T, D)), prec)
    dec.q[...] = qd.reshape(1, -1)
    dec.state[:] = cp.asarray([0, n - 1, 0, 0], dtype=np.int32)
    runs = []
    for _ in range(2):                               # the second launch needs the tickets reset by the first
        dec.y[...] = nan_like((1, H * D), prec)
        dec.attn(kd, vd)
        runs.append(cp.asnumpy(dec.y).copy())
    assert np.array_equal(runs[0].view(np.uint8), runs[1].view(np.uint8))
    ref = np.concatenate([ref_attn(prec, qh[h * D:(h + 1) * D], kh[h], vh[h], n, 1 / np.sqrt(D)) for h in range(H)])
    atol, rtol = KTOL[prec]
    within(host(dec.y.reshape(-1), prec), ref, atol, rtol, f"attn {prec} n={n}")


@pytest.mark.parametrize("mc", [MC, MC_LONG], ids=["ctx48", "ctx160"])
@pytest.mark.parametrize("prec", ["fp32", "bf16", "fp16"])
def test_graph_decode_logits_match_numpy_at_every_position(prec, mc):
    from andrea.cuda.decode import GraphDecoder, ref_decode

    w = weights(mc)
    cpu = InferenceModel(mc, w)
    dec = GraphDecoder(mc, cp.asarray(w), precision=prec)
    ids = np.random.default_rng(5).integers(0, mc.vocab_size, size=mc.context).astype(np.int32)
    want = cpu.forward(ids, all_logits=True).copy()
    got = np.stack([cp.asnumpy(dec.forward([t])[0]) for t in ids])
    atol, rtol = TOL[prec]
    within(got, want, atol, rtol, f"{prec} vs InferenceModel")
    within(got, ref_decode(mc, w, ids, prec), atol, rtol, f"{prec} vs ref_decode")


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


@pytest.mark.parametrize("V", [301, 8449])
def test_sample_kernel_matches_its_twin(V):
    """k_dec_sample against ref_sample given the same uniform (ref_uniform of the same seed and
    counter): the same token wherever the twin does not call the draw ambiguous (a sum within
    1e-5 relative of its threshold, where fp32 may decide otherwise)."""
    import sys
    from pathlib import Path

    from andrea.cuda.decode import GraphDecoder, ref_sample, ref_uniform

    sys.path.insert(0, str(Path(__file__).parent))
    from test_generate_decode import sampling_cases

    dec = GraphDecoder(MC, cp.asarray(weights()), precision="bf16")
    rng = np.random.default_rng(V)
    n = amb_n = 0
    for row, (t, k, p) in sampling_cases():
        logits = np.resize(row, V).astype(np.float32) if V != row.size else row
        if V != row.size:
            logits = logits + 0.01 * rng.standard_normal(V).astype(np.float32) * (row.std() > 0)
        ld, es = cp.asarray(logits), cp.zeros(V, np.float32)
        for _ in range(6):
            seed, counter = int(rng.integers(0, 2 ** 63)), int(rng.integers(0, 1000))
            dec.set_sampling(t, k, p, seed, counter)
            dec.state.fill(0)
            dec._k_sample((1,), (1024,), (ld, np.int32(V), dec.samp_opts, dec.rng_state, dec.state, dec.out_ids, es,
                                          np.int32(1)))
            st, ids, rs = cp.asnumpy(dec.state), cp.asnumpy(dec.out_ids[:1]), cp.asnumpy(dec.rng_state)
            want, amb = ref_sample(logits, t, k, p, ref_uniform(seed, counter))
            n += 1
            amb_n += amb
            assert amb or st[0] == want, (t, k, p, seed, counter, int(st[0]), want)
            assert ids[0] == st[0] and st[1] == 1 and st[2] == 1 and rs[1] == counter + 1
    # most draws are decided (so the check above bites): a row of 8449 near-flat entries has a CDF
    # step within 1e-5 of many uniforms (on the H200: 13 of 324 draws ambiguous at V = 8449, 0 at
    # V = 301; every decided draw agreed)
    print(f"V={V}: {amb_n} of {n} draws ambiguous")
    assert amb_n <= n // 5


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_device_sampling_is_seeded_graph_equals_eager_and_replays_on_the_host(prec):
    """generate() on the graph decoder draws on the device: same seed -> same tokens, graph ==
    eager launches, and a host replay (the decoder's logits, ref_sample with ref_uniform(seed, i))
    picks the same tokens, through two slides of the context window."""
    from andrea.cuda.decode import GraphDecoder, ref_sample, ref_uniform

    w = cp.asarray(weights())
    g = GraphDecoder(MC, w, precision=prec)
    e = GraphDecoder(MC, w, precision=prec, use_graph=False)
    opts = SamplingOptions(max_new_tokens=2 * MC.context + 7, temperature=1.0, top_k=50, top_p=0.9, stop_at_eot=False)
    a = generate(g, [4, 5], opts, 9).ids
    assert len(a) == opts.max_new_tokens and a == generate(g, [4, 5], opts, 9).ids and a == generate(e, [4, 5], opts, 9).ids
    assert a != generate(g, [4, 5], opts, 10).ids
    seed = int(np.random.default_rng(9).integers(0, 2 ** 63))    # generate's one host draw
    seq, T, keep, amb = [4, 5], MC.context, MC.context // 2, 0
    e.reset()
    logits = e.forward(seq)
    for i, tok in enumerate(a):
        want, ambiguous = ref_sample(cp.asnumpy(logits[0]), 1.0, 50, 0.9, ref_uniform(seed, i))
        amb += ambiguous
        assert ambiguous or tok == want, (i, tok, want)
        seq.append(tok)
        if e.pos >= T:
            e.reset()
            logits = e.forward(seq[-keep:])
        else:
            logits = e.forward([tok])
    assert amb <= 3
    eot = a[20]
    stopped = generate(g, [4, 5], SamplingOptions(max_new_tokens=60, temperature=1.0, top_k=50, top_p=0.9), 9, eot_id=eot)
    assert stopped.stop == "eot" and stopped.ids == a[:a.index(eot)]
