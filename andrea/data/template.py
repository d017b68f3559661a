"""The one fixed chat template of ANDREA, and the shape checks that go with it.

    from andrea.data.template import render_conversation, render_prompt, has_system_prompt_shape
    turns = [{"from": "system", "value": "Be brief."},
             {"from": "human", "value": "What is a list?"},
             {"from": "gpt", "value": "A mutable sequence."}]
    text = render_conversation(turns)        # the training text of one conversation
    prompt = render_prompt(turns[:2])        # ends where the assistant's answer begins

A conversation is a list of turns in the Hermes-3 (ShareGPT) schema: ``{"from": role,
"value": text}`` with role ``system`` | ``human`` | ``gpt``. Every turn renders as

    <|role|>\\n{value}<|end|>\\n

with the tags in ``ROLE_TAGS``; ``render_prompt`` appends ``ASSISTANT_PREFIX`` so that a
model continues with the answer and stops at ``END_TAG`` (see ``STOP_STRINGS``). Values
are written verbatim (no stripping), so rendering never changes the text it carries.

Shape checks look only at structure (roles, their order, empty values), never at the
characters of the text: ``conversation_problem`` names what makes a conversation
unusable (a stable reason string, used as a drop reason by prep-megachat),
``has_system_prompt_shape`` tells whether it opens with a real system prompt, and
``n_exchanges`` counts the assistant answers (1 = single-turn, >1 = multi-turn).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("system", "human", "gpt")
ROLE_TAGS = {"system": "<|system|>", "human": "<|user|>", "gpt": "<|assistant|>"}
END_TAG = "<|end|>"
ASSISTANT_PREFIX = ROLE_TAGS["gpt"] + "\n"
STOP_STRINGS = (END_TAG, ROLE_TAGS["human"], ROLE_TAGS["system"])

# Drop reasons that conversation_problem can return (prep-megachat reports them by these names).
PROBLEMS = ("wrong_type", "no_turns", "missing_role", "unknown_role", "empty_turn", "bad_order")


def _is_map(x: Any) -> bool:
    return type(x) is dict or isinstance(x, Mapping)


def render_turn(role: str, value: str) -> str:
    """One turn in the template: ``<|tag|>\\n{value}<|end|>\\n``."""
    try:
        tag = ROLE_TAGS[role]
    except KeyError:
        raise ValueError(f"unknown role {role!r} (expected one of {', '.join(ROLES)})") from None
    if not isinstance(value, str):
        raise ValueError(f"turn value must be a string, got {type(value).__name__}")
    return f"{tag}\n{value}{END_TAG}\n"


def render_conversation(turns: Sequence[Mapping[str, Any]]) -> str:
    """The training text of a whole conversation: every turn in order, in the template."""
    return "".join(render_turn(t["from"], t["value"]) for t in turns)


def render_prompt(turns: Sequence[Mapping[str, Any]]) -> str:
    """The conversation so far followed by the assistant tag: generation continues with the answer.

    ``turns`` normally ends with a human turn; the text the model writes after it ends at
    ``END_TAG`` (or at another role tag, see ``STOP_STRINGS``).
    """
    return render_conversation(turns) + ASSISTANT_PREFIX


def conversation_problem(turns: Any) -> str | None:
    """Why ``turns`` is not a usable conversation (one of ``PROBLEMS``), or None if it is.

    Usable means: a list of mappings with string ``from`` and ``value``; every role known;
    no empty (all-whitespace) value; an optional system turn only in first place, then
    human and gpt turns alternating, starting with human and ending with gpt.
    """
    if not isinstance(turns, (list, tuple)):
        return "no_turns" if turns is None else "wrong_type"
    if not turns:
        return "no_turns"
    for t in turns:
        if not _is_map(t):
            return "wrong_type"
        role, value = t.get("from"), t.get("value")
        if role is None:
            return "missing_role"
        if not isinstance(role, str) or not (value is None or isinstance(value, str)):
            return "wrong_type"
        if role not in ROLE_TAGS:
            return "unknown_role"
        if value is None or not value.strip():
            return "empty_turn"
    body = turns[1:] if turns[0]["from"] == "system" else turns
    if not body:
        return "bad_order"
    for i, t in enumerate(body):
        if t["from"] != ("human" if i % 2 == 0 else "gpt"):
            return "bad_order"
    if body[-1]["from"] != "gpt":
        return "bad_order"
    return None


def has_system_prompt_shape(turns: Any) -> bool:
    """True when the conversation opens with a non-empty system turn followed by a human turn."""
    if not isinstance(turns, (list, tuple)) or len(turns) < 2:
        return False
    first, second = turns[0], turns[1]
    if not _is_map(first) or not _is_map(second):
        return False
    value = first.get("value")
    return (first.get("from") == "system" and isinstance(value, str) and bool(value.strip())
            and second.get("from") == "human")


def n_exchanges(turns: Sequence[Mapping[str, Any]]) -> int:
    """Number of assistant answers: 1 for a single-turn conversation, more for multi-turn."""
    return sum(1 for t in turns if _is_map(t) and t.get("from") == "gpt")
