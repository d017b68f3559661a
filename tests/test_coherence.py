"""Coherence scores and the early-stop monitor.

    pytest tests/test_coherence.py
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from andrea.coherence import PROMPTS, CoherenceMonitor, is_degenerate, reasons, scores
from andrea.config import load_config
from andrea.data.template import ASSISTANT_PREFIX
from andrea.errors import AndreaError
from andrea.settings import Settings

PROSE = ("A list is a mutable sequence, typically used to store collections of homogeneous items. "
         "Lists may be constructed in several ways: using a pair of square brackets to denote the empty "
         "list, using square brackets and separating items with commas, or using a list comprehension. "
         "Many other operations also produce lists, including the sorted built-in.")
CODE = "def area(r):\n    \"\"\"Area of a circle.\"\"\"\n    return 3.14159 * r * r\n\nprint(area(2.0))\n"


@pytest.fixture(scope="module")
def coh():
    return Settings.from_dict(load_config("params.yaml", "tiny")).coherence


def test_normal_text_is_not_degenerate(coh):
    lim = coh.max_repeat
    for text in (PROSE, CODE, "Hello there."):
        s = scores(text)
        assert not is_degenerate(s, lim), (text, s)
        assert s["distinct_2"] > 0.8


@pytest.mark.parametrize("text,rate", [
    ("the the the the the the the the the the the the", "word"),
    ("I am a model. I am a model. I am a model. I am a model. I am a model.", "trigram"),
    ("=" * 80, "char"),
    ("abababababababababababababababababababababab", "char"),
])
def test_repetitive_text_is_degenerate(coh, text, rate):
    s = scores(text)
    assert is_degenerate(s, coh.max_repeat)
    assert any(r.startswith(rate) for r in reasons(s, coh.max_repeat)), s


def test_score_values():
    s = scores("a b a b a b")  # words a b a b a b: 2 distinct of 6; bigrams ab ba: 2 of 5; trigrams 2 of 4
    assert s["word"] == pytest.approx(1 - 2 / 6, abs=1e-6)
    assert s["bigram"] == pytest.approx(1 - 2 / 5, abs=1e-6)
    assert s["trigram"] == pytest.approx(0.5, abs=1e-6)
    assert s["distinct_3"] == pytest.approx(0.5, abs=1e-6)
    assert s["n_words"] == 6 and s["n_chars"] == 11
    empty = scores("")
    assert empty["bigram"] == empty["char"] == 0.0 and empty["distinct_1"] == 1.0
    with pytest.raises(AndreaError):
        scores(None)


def test_monitor_needs_patience_consecutive_degenerate_checks(coh):
    mon = CoherenceMonitor(coh)
    p = coh.patience
    bad = [("q", "no no no no no no no no no no")] * 3
    good = [("q", PROSE)] * 3
    mixed = [("q", PROSE), ("q", PROSE), bad[0]]  # a minority degenerate: the check passes
    for _ in range(p - 1):
        assert mon.check(10, bad)["halt"] is None
    assert mon.check(11, mixed)["streak"] == 0
    for _ in range(p - 1):
        assert mon.check(12, bad)["halt"] is None
    res = mon.check(13, bad)
    assert res["halt"]["step"] == 13 and "coherence" in res["halt"]["reason"]
    json.dumps(res["samples"], allow_nan=False)
    assert res["samples"][0]["degenerate"] and not mon.check(14, good)["degenerate"]


def test_monitor_run_check_samples_every_prompt(coh):
    mon = CoherenceMonitor(coh)
    seen = []
    res = mon.run_check(5, lambda prompt: seen.append(prompt) or PROSE)
    assert seen == PROMPTS and len(res["samples"]) == len(PROMPTS)
    assert any(p.endswith(ASSISTANT_PREFIX) for p in PROMPTS)
    assert mon.due(coh.every) and not mon.due(0) and not mon.due(coh.every + 1)


def test_diverging_loss_halts_and_noisy_loss_does_not(coh):
    mon = CoherenceMonitor(coh)
    halt = None
    for step in range(400):
        loss = 5.0 - step * 0.005 + (0.3 if step % 2 else -0.3)
        assert mon.observe_loss(step, loss) is None
    for step in range(400, 1000):
        halt = mon.observe_loss(step, 3.0 + (step - 400) * 0.05)
        if halt:
            break
    assert halt is not None and "diverge" in halt["reason"] and halt["step"] < 1000
    off = CoherenceMonitor(replace(coh, diverge_ratio=0.0))
    assert all(off.observe_loss(s, 1.0 + s) is None for s in range(300))
    assert mon.observe_loss(1, float("nan")) is None


def test_switch_to_a_harder_source_is_not_divergence(coh):
    """Bandit runs dwell on one source: 300 steps of an easy one (loss ~1.4), then a hard one
    (~3.1). One EMA over both read that switch as divergence (2.2x its best); each source's
    EMA against its own best does not, and a real divergence inside a source still halts."""
    mon = CoherenceMonitor(coh)
    for step in range(300):
        assert mon.observe_loss(step, 1.5 - step * 1e-4, "chat-multi") is None
    for step in range(300, 700):
        assert mon.observe_loss(step, 3.1 - (step - 300) * 1e-4, "py-notes") is None
    halt = None
    for step in range(700, 1200):
        halt = mon.observe_loss(step, 3.0 + (step - 700) * 0.05, "py-notes")
        if halt:
            break
    assert halt is not None and "py-notes" in halt["reason"] and halt["step"] < 1200


def test_monitor_state_round_trip(coh):
    a = CoherenceMonitor(coh)
    for s in range(120):
        a.observe_loss(s, 4.0 - 0.01 * s)
    a.check(1, [("q", "x x x x x x x x")])
    b = CoherenceMonitor(coh)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.state_dict() == a.state_dict()
    for s in range(120, 200):
        assert a.observe_loss(s, 9.0) == b.observe_loss(s, 9.0)
    with pytest.raises(AndreaError, match="coherence state"):
        b.load_state_dict({"streak": 1})
    old = CoherenceMonitor(coh)                     # a .state.json written before per-source EMAs
    old.load_state_dict({"streak": 0, "n_loss": 120, "loss_ema": 2.0, "best_ema": 1.5})
    assert old.ema == {"": {"ema": 2.0, "best": 1.5, "n": 120}}


class ByteTokenizer:
    """Ids 0-255 are bytes, 256 is end-of-text: the part of the tokenizer API generate uses."""

    vocab_size, eot_id = 257, 256

    def encode(self, text):
        import numpy as np
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids):
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, i):
        return bytes([i]) if i < 256 else b""


def test_sample_check_samples_the_model_reproducibly(coh):
    import numpy as np

    from andrea.engine.model import ModelConfig, param_layout
    from andrea.generate import InferenceModel

    mc = ModelConfig(vocab_size=257, d_model=16, n_head=2, n_layer=1, context=32)
    params = np.random.default_rng(0).normal(0, 0.3, param_layout(mc).n_params).astype(np.float32)
    im = InferenceModel(mc, params)
    c = replace(coh, max_new_tokens=12)
    a = CoherenceMonitor(c).sample_check(200, im, ByteTokenizer(), seed=3)
    b = CoherenceMonitor(c).sample_check(200, im, ByteTokenizer(), seed=3)
    assert [s["text"] for s in a["samples"]] == [s["text"] for s in b["samples"]]
    assert [s["prompt"] for s in a["samples"]] == PROMPTS
    assert all(len(s["text"].encode("utf-8", "replace")) <= 12 * 3 for s in a["samples"])
    other = CoherenceMonitor(c).sample_check(400, im, ByteTokenizer(), seed=3)
    assert [s["text"] for s in other["samples"]] != [s["text"] for s in a["samples"]]


def test_sample_check_decodes_the_prompts_together_as_each_alone(coh):
    import numpy as np

    from andrea.engine.model import ModelConfig, param_layout
    from andrea.generate import InferenceModel, SamplingOptions, generate

    mc = ModelConfig(vocab_size=257, d_model=16, n_head=2, n_layer=1, context=32)
    params = np.random.default_rng(0).normal(0, 0.3, param_layout(mc).n_params).astype(np.float32)
    c = replace(coh, max_new_tokens=40)                       # 40 > context: the window slides
    tok = ByteTokenizer()
    from andrea.data.template import STOP_STRINGS

    opts = SamplingOptions(max_new_tokens=40, temperature=c.temperature, top_k=c.top_k, stop_strings=tuple(STOP_STRINGS))
    alone = [generate(InferenceModel(mc, params), tok.encode(p), opts, np.random.default_rng([3, 200, i]),
                      eot_id=tok.eot_id, tokenizer=tok).text for i, p in enumerate(PROMPTS)]
    for slots in (1, len(PROMPTS)):
        got = CoherenceMonitor(c).sample_check(200, InferenceModel(mc, params, slots=slots), tok, seed=3)
        assert [s["text"] for s in got["samples"]] == alone
