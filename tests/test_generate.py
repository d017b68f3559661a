"""Tests of andrea.generate: KV-cache logits equal a full forward's, sampling filters, determinism.

    pytest tests/test_generate.py
"""

from __future__ import annotations

import numpy as np
import pytest

from andrea.engine import ops_numpy as ops
from andrea.engine.model import ModelConfig, param_layout
from andrea.errors import AndreaError
from andrea.generate import (InferenceModel, SamplingOptions, draw, generate, next_token_probs)

MC = ModelConfig(vocab_size=61, d_model=32, n_head=4, n_layer=2, context=16)


def random_params(mc: ModelConfig, seed: int = 0, scale: float = 0.3) -> np.ndarray:
    """A flat fp32 buffer in the engine's layout: random matrices, LayerNorm gains near 1."""
    rng = np.random.default_rng(seed)
    layout = param_layout(mc)
    flat = np.zeros(layout.n_params, dtype=np.float32)
    for t in layout.tensors:
        v = flat[t.offset:t.offset + t.size]
        if t.name.endswith(".g"):
            v[:] = 1.0 + 0.1 * rng.standard_normal(t.size)
        elif t.name.endswith(".b"):
            v[:] = 0.1 * rng.standard_normal(t.size)
        else:
            v[:] = scale * rng.standard_normal(t.size) / np.sqrt(t.shape[0])
    return flat


def full_forward(mc: ModelConfig, flat: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Logits (T, V) of one sequence by the engine's training op pairs (full causal attention)."""
    layout = param_layout(mc)
    w = {t.name: flat[t.offset:t.offset + t.size].reshape(t.shape) for t in layout.tensors}
    T, C, H, V = ids.size, mc.d_model, mc.n_head, mc.vocab_size
    f = np.float32
    work = np.zeros(ops.work_elems(1, T, C, H, V), dtype=f)
    x = np.zeros((1, T, C), f)
    ops.embed_forward(x, ids.reshape(1, T).astype(np.int32), w["wte"], w["wpe"])
    x = x.reshape(T, C)
    h, mean, rstd = np.zeros((T, C), f), np.zeros(T, f), np.zeros(T, f)
    qkv, y, br = np.zeros((T, 3 * C), f), np.zeros((T, C), f), np.zeros((T, C), f)
    att = np.zeros(ops.att_shape(1, H, T), f)
    mask = np.triu(np.full((T, T), -np.inf, f), k=1)
    hp, ha = np.zeros((T, 4 * C), f), np.zeros((T, 4 * C), f)
    for l in range(mc.n_layer):
        p = f"h.{l}."
        ops.layernorm_forward(h, mean, rstd, x, w[p + "ln1.g"], w[p + "ln1.b"])
        ops.attn_qkv_forward(qkv, h, w[p + "attn.w_qkv"])
        ops.attn_forward(y.reshape(1, T, C), att, qkv.reshape(1, T, 3 * C), mask, H, work)
        ops.attn_out_forward(br, y, w[p + "attn.w_o"])
        x = x + br
        ops.layernorm_forward(h, mean, rstd, x, w[p + "ln2.g"], w[p + "ln2.b"])
        ops.mlp_forward(br, hp, ha, h, w[p + "mlp.w_fc"], w[p + "mlp.w_proj"])
        x = x + br
    ops.layernorm_forward(h, mean, rstd, x, w["lnf.g"], w["lnf.b"])
    return h @ w["wte"].T


def test_kv_cache_matches_full_forward_token_by_token_and_in_chunks():
    flat = random_params(MC)
    ids = np.random.default_rng(1).integers(0, MC.vocab_size, size=MC.context).astype(np.int32)
    want = full_forward(MC, flat, ids)
    im = InferenceModel(MC, flat)
    one = np.stack([im.forward([t])[0].copy() for t in ids])
    np.testing.assert_allclose(one, want, rtol=1e-4, atol=1e-4)
    im.reset()
    a = im.forward(ids[:5], all_logits=True).copy()
    b = im.forward(ids[5:11], all_logits=True).copy()
    c = im.forward(ids[11:], all_logits=True).copy()
    np.testing.assert_allclose(np.concatenate([a, b, c]), want, rtol=1e-4, atol=1e-4)
    im.reset()
    last = im.forward(ids)
    np.testing.assert_allclose(last[0], want[-1], rtol=1e-4, atol=1e-4)


def test_weights_are_views_of_the_flat_buffer():
    flat = random_params(MC)
    im = InferenceModel(MC, flat)
    before = im.forward([3, 4, 5]).copy()
    flat[:] *= 0.5                                       # the engine updates its weights in place
    im.reset()
    after = im.forward([3, 4, 5])
    assert not np.allclose(before, after)
    np.testing.assert_allclose(after[0], full_forward(MC, flat, np.array([3, 4, 5]))[-1], rtol=1e-4, atol=1e-4)


def test_context_overflow_and_bad_input_are_refused():
    im = InferenceModel(MC, random_params(MC))
    with pytest.raises(AndreaError, match="exceed the context"):
        im.forward(np.zeros(MC.context + 1, dtype=np.int32))
    with pytest.raises(AndreaError, match="outside"):
        im.forward([MC.vocab_size])
    with pytest.raises(AndreaError, match="flat buffer"):
        InferenceModel(MC, np.zeros(10, np.float32))


def test_probs_temperature_topk_topp():
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0])
    p = next_token_probs(logits, 1.0)
    np.testing.assert_allclose(p, np.exp(logits) / np.exp(logits).sum())
    g = next_token_probs(logits, 0.0)
    assert g.tolist() == [1, 0, 0, 0, 0]
    k2 = next_token_probs(logits, 1.0, top_k=2)
    assert (k2[2:] == 0).all() and k2[:2].sum() == pytest.approx(1.0)
    assert k2[0] / k2[1] == pytest.approx(np.e)
    cold = next_token_probs(logits, 0.25)
    assert cold[0] > p[0]
    # top-p: the smallest prefix of sorted mass reaching p
    probs = np.exp(logits) / np.exp(logits).sum()          # ~[.56, .21, .13, .08, .03]
    tp = next_token_probs(logits, 1.0, top_p=0.7)
    assert (tp > 0).tolist() == [True, True, False, False, False]
    np.testing.assert_allclose(tp[:2], probs[:2] / probs[:2].sum())
    assert (next_token_probs(logits, 1.0, top_p=0.5) > 0).sum() == 1
    with pytest.raises(AndreaError, match="NaN"):
        next_token_probs(np.full(4, np.nan), 1.0)


def test_draw_follows_the_distribution_and_never_picks_zero_mass():
    rng = np.random.default_rng(0)
    p = np.array([0.0, 0.7, 0.0, 0.3, 0.0])
    counts = np.bincount([draw(p, rng) for _ in range(4000)], minlength=5)
    assert counts[0] == counts[2] == counts[4] == 0
    assert abs(counts[1] / 4000 - 0.7) < 0.03


def test_generation_is_deterministic_for_a_seed_and_differs_across_seeds():
    flat = random_params(MC, scale=1.0)
    im = InferenceModel(MC, flat)
    opts = SamplingOptions(max_new_tokens=40, temperature=1.0, top_k=20, top_p=0.95, stop_at_eot=False)
    a = generate(im, [1, 2, 3], opts, rng=7).ids
    b = generate(im, [1, 2, 3], opts, rng=7).ids
    c = generate(im, [1, 2, 3], opts, rng=8).ids
    assert a == b and len(a) == 40            # 40 > context: runs past the window
    assert a != c
    # greedy continuation equals arg-max of the full forward at each step (within the window)
    g = generate(im, [1, 2, 3], SamplingOptions(max_new_tokens=5, temperature=0, stop_at_eot=False), rng=0).ids
    seq = [1, 2, 3]
    for t in g:
        assert t == int(np.argmax(full_forward(MC, flat, np.array(seq))[-1]))
        seq.append(t)


def test_stop_at_eot_and_rng_state_advances():
    flat = random_params(MC)
    layout = param_layout(MC)

    def view(name):
        t = layout.by_name[name]
        return flat[t.offset:t.offset + t.size].reshape(t.shape)
    eot = MC.vocab_size - 1
    view("lnf.g")[:] = 0.0                     # final LayerNorm output = lnf.b exactly
    view("lnf.b")[:] = 1.0
    view("wte")[eot] = 5.0                     # so the EOT logit (160) dominates every other row's
    im = InferenceModel(MC, flat)
    rng = np.random.default_rng(3)
    out = generate(im, [1, 2], SamplingOptions(max_new_tokens=10, temperature=0), rng, eot_id=eot)
    assert out.stop == "eot" and eot not in out.ids
    s0 = rng.bit_generator.state
    generate(im, [1, 2], SamplingOptions(max_new_tokens=3, temperature=1.0, stop_at_eot=False), rng, eot_id=eot)
    assert rng.bit_generator.state != s0


class ByteTok:
    """The smallest tokenizer: ids are bytes (for stop-string tests)."""
    vocab_size, eot_id = 61, 60

    def token_bytes(self, i):
        return bytes([65 + (i % 26)])

    def decode(self, ids):
        return b"".join(self.token_bytes(i) for i in ids).decode()


def test_stop_strings_cut_the_text():
    im = InferenceModel(MC, random_params(MC, scale=1.0))
    tok = ByteTok()
    free = generate(im, [5], SamplingOptions(max_new_tokens=30, temperature=1.0, stop_at_eot=False), 11, tokenizer=tok)
    stop = free.text[3:5]
    cut = generate(im, [5], SamplingOptions(max_new_tokens=30, temperature=1.0, stop_at_eot=False,
                                            stop_strings=(stop,)), 11, tokenizer=tok)
    assert cut.stop == "stop_string"
    assert cut.text == free.text[:free.text.find(stop)]


def test_options_validate():
    with pytest.raises(AndreaError, match="top_p"):
        SamplingOptions(top_p=0)
    with pytest.raises(AndreaError, match="temperature"):
        SamplingOptions(temperature=-1)


def test_kv_cache_matches_the_engine_forward():
    from andrea.engine.backend import NumpyBackend
    from andrea.engine.engine import Engine

    eng = Engine(MC, batch_size=1, backend=NumpyBackend())
    eng.init_weights(seed=5)
    eng.w[:] += 0.2 * np.random.default_rng(2).standard_normal(eng.n_params).astype(np.float32)
    ids = np.random.default_rng(4).integers(0, MC.vocab_size, size=(1, MC.context)).astype(np.int32)
    eng.forward(ids)
    want = eng.a["logits"].copy()
    im = InferenceModel(MC, eng.w)                       # the engine's own flat weights, no copy
    got = np.concatenate([im.forward(ids[0, :7], all_logits=True).copy(),
                          np.stack([im.forward([t])[0].copy() for t in ids[0, 7:]])])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_one_row_forward_runs_blas_on_one_thread_and_restores_it():
    from threadpoolctl import ThreadpoolController

    from andrea.engine import ops_numpy

    ctl = ThreadpoolController().select(user_api="blas")
    before = [c.num_threads for c in ctl.lib_controllers]
    seen = []

    class Spy:
        def __getattr__(self, name):
            fn = getattr(ops_numpy, name)
            if name != "mlp_forward":
                return fn

            def wrapped(*a, **k):
                seen.append(max(c.num_threads for c in ctl.lib_controllers))
                return fn(*a, **k)
            return wrapped

    im = InferenceModel(MC, random_params(MC))
    im.ops = Spy()
    im.cached_ops._ops = im.ops
    im.forward([1, 2, 3])                    # several rows: the op pool splits them (its own rule)
    im.forward([4])                          # one row: BLAS on one thread
    assert seen[-MC.n_layer:] == [1] * MC.n_layer
    assert [c.num_threads for c in ctl.lib_controllers] == before


def _jobs(eot):
    """Prompts of every kind generate handles: empty (starts from EOT), longer than the context,
    greedy and sampled, a stop string, no tokens at all, long runs past the context."""
    free = SamplingOptions(max_new_tokens=40, temperature=1.0, top_k=20, top_p=0.9, stop_at_eot=False)
    return [([1, 2, 3], free, 7),
            ([], SamplingOptions(max_new_tokens=12, temperature=0.8), 8),
            (list(range(3, 3 + MC.context + 5)), SamplingOptions(max_new_tokens=9, temperature=0), 9),
            ([5], SamplingOptions(max_new_tokens=30, temperature=1.0, stop_strings=("C", "QQ")), 10),
            ([4, 4], SamplingOptions(max_new_tokens=0), 11),
            ([6, 7, 8, 9], SamplingOptions(max_new_tokens=25, temperature=1.3, top_k=5), np.random.default_rng([1, 2])),
            ([2], free, 12)]


@pytest.mark.parametrize("slots", [1, 3, 7])
def test_generate_batch_gives_each_prompt_what_it_gets_alone(slots):
    from andrea.generate import generate_batch

    flat = random_params(MC, scale=1.0)
    tok = ByteTok()
    alone = [generate(InferenceModel(MC, flat), p, o, r if isinstance(r, int) else np.random.default_rng([1, 2]),
                      eot_id=tok.eot_id, tokenizer=tok) for p, o, r in _jobs(tok.eot_id)]
    together = generate_batch(InferenceModel(MC, flat, slots=slots), _jobs(tok.eot_id), eot_id=tok.eot_id, tokenizer=tok)
    assert [(g.ids, g.stop, g.text) for g in together] == [(g.ids, g.stop, g.text) for g in alone]
    assert {g.stop for g in alone} == {"max_tokens", "eot", "stop_string"}       # every way out is covered
    assert max(len(g.ids) for g in alone) > MC.context                           # and the sliding window


def test_forward_rows_gives_each_row_the_bits_of_a_one_row_forward():
    flat = random_params(MC, scale=1.0)
    one = InferenceModel(MC, flat)
    many = InferenceModel(MC, flat, slots=3)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
    for s, p in enumerate(prompts):
        many.select(s)
        many.forward(p)
    got = many.forward_rows([2, 0, 1], [10, 11, 12]).copy()
    for row, (p, t) in zip(got, [(prompts[2], 10), (prompts[0], 11), (prompts[1], 12)]):
        one.reset()
        one.forward(p)
        assert np.array_equal(row, one.forward([t])[0])
    assert [many.position(s) for s in range(3)] == [4, 2, 6]
    with pytest.raises(AndreaError, match="distinct"):
        many.forward_rows([0, 0], [1, 2])
