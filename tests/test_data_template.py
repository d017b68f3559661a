"""The fixed chat template and its shape checks.

    pytest tests/test_data_template.py
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from andrea.data.template import (ASSISTANT_PREFIX, END_TAG, ROLE_TAGS, STOP_STRINGS, conversation_problem,
                                  has_system_prompt_shape, n_exchanges, render_conversation, render_prompt)


def T(role, value):
    return {"from": role, "value": value}


def test_render_is_the_documented_layout():
    turns = [T("system", "Be brief."), T("human", "Hi?"), T("gpt", "Hello.")]
    assert render_conversation(turns) == ("<|system|>\nBe brief.<|end|>\n<|user|>\nHi?<|end|>\n"
                                          "<|assistant|>\nHello.<|end|>\n")
    assert render_prompt(turns[:2]) == "<|system|>\nBe brief.<|end|>\n<|user|>\nHi?<|end|>\n<|assistant|>\n"
    # the prompt is exactly the conversation up to where the answer's text begins
    assert render_conversation(turns).startswith(render_prompt(turns[:2]))
    assert ASSISTANT_PREFIX == ROLE_TAGS["gpt"] + "\n" and END_TAG in STOP_STRINGS


def test_render_refuses_unknown_roles_and_non_text():
    with pytest.raises(ValueError, match="unknown role 'user'"):
        render_conversation([T("user", "x")])
    with pytest.raises(ValueError, match="must be a string"):
        render_conversation([T("human", 3)])


@given(st.lists(st.tuples(st.text(min_size=1), st.text(min_size=1)), min_size=1, max_size=4))
def test_values_are_carried_verbatim(pairs):
    turns = [t for q, a in pairs for t in (T("human", q), T("gpt", a))]
    text = render_conversation(turns)
    for t in turns:
        assert f"{ROLE_TAGS[t['from']]}\n{t['value']}{END_TAG}\n" in text
    assert len(text) == sum(len(ROLE_TAGS[t["from"]]) + len(t["value"]) + len(END_TAG) + 2 for t in turns)


@pytest.mark.parametrize("turns, problem", [
    ([T("human", "q"), T("gpt", "a")], None),
    ([T("system", "s"), T("human", "q"), T("gpt", "a"), T("human", "q2"), T("gpt", "a2")], None),
    (None, "no_turns"),
    ([], "no_turns"),
    ("text", "wrong_type"),
    ([["human", "q"]], "wrong_type"),
    ([T("human", 1), T("gpt", "a")], "wrong_type"),
    ([T(2, "q"), T("gpt", "a")], "wrong_type"),
    ([{"value": "q"}, T("gpt", "a")], "missing_role"),
    ([T("user", "q"), T("gpt", "a")], "unknown_role"),
    ([T("human", " \n"), T("gpt", "a")], "empty_turn"),
    ([T("human", None), T("gpt", "a")], "empty_turn"),
    ([T("system", "s")], "bad_order"),
    ([T("gpt", "a"), T("human", "q")], "bad_order"),
    ([T("human", "q"), T("human", "q"), T("gpt", "a")], "bad_order"),
    ([T("human", "q"), T("gpt", "a"), T("system", "s")], "bad_order"),
    ([T("human", "q")], "bad_order"),
])
def test_conversation_problem(turns, problem):
    assert conversation_problem(turns) == problem


def test_system_prompt_shape_is_structural():
    q, a = T("human", "q"), T("gpt", "a")
    assert has_system_prompt_shape([T("system", "Be kind."), q, a])
    assert not has_system_prompt_shape([T("system", "  "), q, a])           # empty system value
    assert not has_system_prompt_shape([T("system", "s")])                   # nothing after it
    assert not has_system_prompt_shape([q, T("system", "s"), a])             # not first
    assert not has_system_prompt_shape([T("human", "<|system|>\nYou are"), a])  # characters do not count
    assert not has_system_prompt_shape([T("system", 5), q, a]) and not has_system_prompt_shape(None)


def test_n_exchanges():
    assert n_exchanges([T("human", "q"), T("gpt", "a")]) == 1
    assert n_exchanges([T("system", "s"), T("human", "q"), T("gpt", "a"), T("human", "q"), T("gpt", "b")]) == 2
