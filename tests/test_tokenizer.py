"""Harris morpheme tokenizer: exact round trip for any str, determinism, real segmentation.

    pytest tests/test_tokenizer.py

Trained on CPython's own documentation topics (``pydoc_data.topics``, ships with
every CPython) and on a small synthetic corpus of English verb forms.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from andrea.errors import AndreaError
from andrea.tokenizer import load
from andrea.tokenizer.harris import (PRETOKEN_PATTERN, Tokenizer, WordCounter, segment, train_ranking,
                                     varieties)


def _topics() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


@pytest.fixture(scope="module")
def doc_tok() -> Tokenizer:
    ranking = train_ranking(_topics(), max_morpheme_len=16, min_count=3)
    return Tokenizer.from_ranking(ranking, 512)


STEMS = ["walk", "talk", "jump", "play", "work", "call", "help", "look", "open", "start", "turn", "kick",
         "pull", "push", "clean", "cook", "watch", "wash", "paint", "climb", "count", "fill", "mark", "rest"]
SUFFIXES = ["", "s", "ed", "ing", "er", "ers"]
FILLER = ["the", "a", "dog", "cat", "we", "they", "home", "and", "then", "today", "slowly", "park"]


def _verb_corpus(seed: int = 7, n_docs: int = 300) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        words = []
        for _ in range(40):
            if rng.random() < 0.5:
                words.append(rng.choice(STEMS) + rng.choice(SUFFIXES))
            else:
                words.append(rng.choice(FILLER))
        docs.append(" ".join(words) + ".\n")
    return docs


def test_pretoken_pattern_covers_every_character():
    import re

    pat = re.compile(PRETOKEN_PATTERN)
    s = "  Hello,  wörld!\r\n\tx_y 12345 ½ é\u0301 \U0001F600\u200f\x00 "
    assert "".join(pat.findall(s)) == s
    assert pat.findall("ok.<|end|>\n<|user|>\nx <= y<|") == ["ok", ".", "<|end|>", "\n", "<|user|>", "\n", "x", " <=",
                                                            " y", "<|"]


def test_successor_variety_finds_the_stem():
    types = [s + x for s in STEMS for x in SUFFIXES]
    sv, pv = varieties(types)
    assert sv["walk"] == len({x[:1] or "\0" for x in SUFFIXES})  # s, e, i, end of word
    assert sv["wal"] == 1
    for w, want in [("walking", ["walk", "ing"]), ("walked", ["walk", "ed"]), ("walks", ["walk", "s"])]:
        assert segment(w, sv, pv) == want


def test_suffix_before_a_last_letter_with_many_predecessors():
    # words ending in "d" after many letters: PV("d") >= PV("ed"), yet "-ed" is still cut
    extra = ["and", "old", "bad", "mud", "kid", "odd", "word", "card", "glad", "yard", "head", "ahead", "food",
             "cold", "wild", "grand", "fjord", "vivid", "avoid", "plaid", "squid", "dad", "lloyd", "david", "sword"]
    sv, pv = varieties([s + x for s in STEMS for x in SUFFIXES] + extra)
    assert pv["d"] > pv["ed"] >= 3
    assert segment("walked", sv, pv) == ["walk", "ed"] and segment("cold", sv, pv) == ["cold"]


def test_morphology_walk_forms_share_a_stem_token():
    ranking = train_ranking(_verb_corpus(), max_morpheme_len=16, min_count=2)
    tok = Tokenizer.from_ranking(ranking, 64, refine_rounds=2)
    firsts = set()
    for form in [" walk", " walks", " walked", " walking"]:
        ids = tok.encode(form)
        assert tok.decode(ids) == form
        firsts.add(int(ids[0]))
        assert ids[0] >= 256, f"{form!r} starts with a byte token"
    assert len(firsts) == 1
    (stem,) = firsts
    assert tok.token_bytes(stem) == b" walk"
    assert [tok.token_bytes(i) for i in tok.encode(" walking")] == [b" walk", b"ing"]
    assert [tok.token_bytes(i) for i in tok.encode(" walked")] == [b" walk", b"ed"]


def test_refinement_never_encodes_the_training_text_longer():
    from andrea.tokenizer.harris import select_morphemes

    ranking = train_ranking(_topics(), max_morpheme_len=16, min_count=3)
    sel = select_morphemes(ranking, 300, rounds=3)
    assert len(sel.total_tokens) == 4 and min(sel.total_tokens) < sel.total_tokens[0]
    tok = Tokenizer(sel.morphemes)
    assert sum(c * len(tok.encode(w)) for w, c in ranking.word_counts.items()) == min(sel.total_tokens)
    saved = [u * (len(m.encode()) - 1) for m, u in zip(sel.morphemes, sel.uses)]
    assert saved == sorted(saved, reverse=True) and len(set(sel.morphemes)) == 300
    again = select_morphemes(train_ranking(_topics(), max_morpheme_len=16, min_count=3), 300, rounds=3)
    assert again.morphemes == sel.morphemes                       # deterministic


def test_vocab_layout(doc_tok):
    assert doc_tok.vocab_size == 256 + 512 + 1
    assert doc_tok.eot_id == doc_tok.vocab_size - 1
    assert doc_tok.token_bytes(65) == b"A"
    assert doc_tok.token_bytes(doc_tok.eot_id) == b""
    assert all(len(doc_tok.token_bytes(i)) >= 2 for i in range(256, doc_tok.eot_id))
    text = "Return the value of the attribute."
    ids = doc_tok.encode(text)
    assert ids.dtype == np.int32 and (ids < doc_tok.eot_id).all()
    assert len(ids) < len(text) / 2           # trained on this register: mostly morphemes


def test_compresses_held_out_text(doc_tok):
    text = ("The iterator protocol returns an object that defines the method __next__, which "
            "accesses elements in the container one at a time.")
    assert len(text.encode()) / len(doc_tok.encode(text)) > 2.5


SPECIAL = ["", "\r\n", "\t\t", "\U0001F600\U0001F469\u200d\U0001F4BB", "\u6f22\u5b57\u304b\u306a", "\u05e9\u05dc\u05d5\u05dd \u0645\u0631\u062d\u0628\u0627",
           "e\u0301\u0302\u0303", "\x00\x01\x1b[0m\x7f", "\ud800", "\udfff\ud800", "\ufeff", "a" * 5000,
           "Supercalifragilistic" * 300, " " * 1000, "12345678901234567890", "x_y__z", "\u0000\n",
           "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n", "<|<|end|>|>", "a<|b c|>"]

ALPHABET = st.one_of(st.characters(exclude_categories=()), st.characters(categories=["Cs"]),
                     st.sampled_from(list(" \t\r\n_0aé\u0301\U0001F600\u05d0<|>")))
PIECES = st.one_of(st.text(alphabet=ALPHABET, max_size=40),
                   st.sampled_from(["<|end|>", "<|user|>\n", "\r\n", " walking", "Return the", "\ud83d"]))
STRINGS = st.lists(PIECES, max_size=8).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(STRINGS)
@example("")
def test_round_trip_any_str(doc_tok, s):
    ids = doc_tok.encode(s)
    assert doc_tok.decode(ids) == s
    assert np.array_equal(ids, doc_tok.encode(s))   # cached encode == first encode


@pytest.mark.parametrize("s", SPECIAL)
def test_round_trip_special(doc_tok, s):
    assert doc_tok.decode(doc_tok.encode(s)) == s


def test_very_long_word_round_trip(doc_tok):
    s = "".join(random.Random(3).choice("abcdefghij\u00e9\u4e2d") for _ in range(200_000))
    ids = doc_tok.encode(s)
    assert doc_tok.decode(ids) == s


def test_decode_of_arbitrary_ids_never_raises(doc_tok):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, doc_tok.vocab_size, size=5000)
    assert isinstance(doc_tok.decode(ids), str)
    with pytest.raises(AndreaError, match="outside"):
        doc_tok.decode([doc_tok.vocab_size])


def test_training_and_encoding_are_deterministic(tmp_path):
    docs = _topics()
    a = Tokenizer.from_ranking(train_ranking(docs, 16, 3), 300)
    b = Tokenizer.from_ranking(train_ranking(list(docs), 16, 3), 300)
    assert a.dumps() == b.dumps() and a.sha256 == b.sha256
    text = docs[5]
    before = a.encode(text)
    a.encode(docs[6] + docs[7])                     # a warm cache must not change the result
    assert np.array_equal(before, a.encode(text))
    assert np.array_equal(before, b.encode(text))


def test_save_load_and_sha(tmp_path, doc_tok):
    import hashlib

    p = tmp_path / "tokenizer.json"
    blob = doc_tok.dumps().encode()
    p.write_bytes(blob)
    (tmp_path / "tokenizer.json.sha256").write_text(hashlib.sha256(blob).hexdigest() + "  tokenizer.json\n")
    tok = load(p)
    assert tok.sha256 == hashlib.sha256(blob).hexdigest()
    assert tok.vocab_size == doc_tok.vocab_size
    text = _topics()[3]
    assert np.array_equal(tok.encode(text), doc_tok.encode(text))
    (tmp_path / "tokenizer.json.sha256").write_text("0" * 64 + "  tokenizer.json\n")
    with pytest.raises(AndreaError, match="does not match"):
        load(p)


def test_load_rejects_bad_files(tmp_path):
    p = tmp_path / "tokenizer.json"
    with pytest.raises(AndreaError, match="not found"):
        load(p)
    p.write_text("{")
    with pytest.raises(AndreaError, match="not valid JSON"):
        load(p)
    p.write_text(json.dumps({"format": "something/else"}))
    with pytest.raises(AndreaError, match="not an ANDREA tokenizer"):
        load(p)
    obj = Tokenizer(["ab", "cd"]).to_json()
    obj["vocab_size"] = 7
    p.write_text(json.dumps(obj))
    with pytest.raises(AndreaError, match="vocab_size"):
        load(p)


def test_lone_surrogates_in_training_text_never_become_morphemes():
    ranking = train_ranking(["x\ud800\ud800 abc abc"] * 10, 16, 1)
    tok = Tokenizer(ranking.morphemes)
    tok.dumps().encode("utf-8")
    assert all("\ud800" not in m for m in ranking.morphemes)
    assert tok.decode(tok.encode("x\ud800\ud800 abc")) == "x\ud800\ud800 abc"


def test_too_few_candidates_is_a_clear_error():
    ranking = train_ranking(["ab ab ab"], 16, 1)
    with pytest.raises(AndreaError, match="n_morphemes=4096"):
        Tokenizer.from_ranking(ranking, 4096)


def test_word_counter_prunes_rare_words():
    wc = WordCounter(max_types=1000)
    rng = random.Random(1)
    for _ in range(50):
        wc.add(" ".join(["common"] * 20 + ["".join(rng.choice("abcdefghijklmnop") for _ in range(9)) for _ in range(200)]))
    assert len(wc.counts) <= 1000
    assert wc.counts[" common"] == 50 * 19 and wc.n_pruned > 0
