"""`andrea chat` driven through a pipe: transcript shape, determinism, commands, context fitting.

    pytest tests/test_generate_chat.py
"""

from __future__ import annotations

import subprocess
import sys

from andrea.chat import fit_turns
from andrea.data.template import render_prompt
from reports_fixtures import make_run


def chat(r, stdin: str, *extra) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "andrea", "chat", *r.cli_params(), "--run", str(r.run), "--tokenizer", str(r.tokenizer),
           "--seed", "5", "--max-new-tokens", "10", *extra]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=120)


def test_piped_chat_transcript_is_deterministic(tmp_path):
    r = make_run(tmp_path, train_steps=5)
    p = chat(r, "What does len do?\nAnd print?\n/reset\n/system Be brief.\nHello\n/quit\nnever read\n")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("andrea chat:") and "step 5" in lines[0]
    assert [l.split(":")[0] for l in lines[1:] if not l.startswith(" ")] == ["you", "andrea", "you", "andrea", "you", "(conversation cleared)",
                                                    "you", "(system prompt set; conversation cleared)", "you", "andrea",
                                                    "you"]
    assert "never read" not in p.stdout
    assert chat(r, "What does len do?\nAnd print?\n/reset\n/system Be brief.\nHello\n/quit\n").stdout == p.stdout


def test_fit_turns_drops_oldest_exchanges_and_keeps_system():
    class CharTok:
        def encode(self, s):
            return list(s)
    sys_t = {"from": "system", "value": "S"}
    turns = [sys_t] + [{"from": r, "value": f"{r}{i}" * 20} for i in range(3) for r in ("human", "gpt")][:-1]
    full = len(render_prompt(turns))
    assert fit_turns(turns, CharTok(), full) == turns
    cut = fit_turns(turns, CharTok(), full - 1)
    assert cut[0] == sys_t and cut[1:] == turns[3:]
    assert fit_turns(turns, CharTok(), 5) == [sys_t, turns[-1]]
