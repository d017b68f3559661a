"""Bit-exact resume through real signals sent to a real `andrea train` child process:
N steps straight, N steps with a SIGUSR1 in the middle, and K steps + SIGTERM + resume
to N give byte-identical checkpoints and the same loss history.

    pytest tests/test_train_resume.py
"""

from __future__ import annotations

import json
import re
import signal
import subprocess

import pytest

from andrea.engine import checkpoint as ck
from train_helpers import andrea_cmd, child_env, make_data, micro_overrides, run_cli

WARMUP, TOTAL, K = 20, 420, 40


def _run_with_signal(cmd, sig, at_step):
    """Start ``cmd``, send ``sig`` once it logs step >= at_step, wait; return (rc, stderr)."""
    p = subprocess.Popen(cmd, env=child_env(), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines, sent = [], False
    for line in p.stderr:
        lines.append(line)
        m = re.match(r"main step (\d+)/", line)
        if m and not sent and int(m.group(1)) >= at_step:
            p.send_signal(sig)
            sent = True
    rc = p.wait(timeout=300)
    assert sent, "the child never reached the step to signal at:\n" + "".join(lines[-20:])
    return rc, "".join(lines)


def _history(out):
    d = json.loads((out / "model.loss.json").read_text())
    return [(r["step"], r["phase"], r["loss"], r["lr"], r["grad_norm"], r["source"]) for r in d["train"]], d


@pytest.mark.slow
def test_sigterm_resume_and_sigusr1_are_bit_exact(tmp_path):
    tok, tokens = make_data(tmp_path / "data")
    ov = micro_overrides(WARMUP, TOTAL)
    warm = tmp_path / "warmup"
    r = run_cli("warmup", tok, tokens, warm, ov)
    assert r.returncode == 0, r.stderr

    # A: straight to TOTAL
    a = tmp_path / "a"
    r = run_cli("main", tok, tokens, a, ov, init=warm)
    assert r.returncode == 0, r.stderr
    ref = (a / "model.bin").read_bytes()
    assert ck.read_checkpoint(a / "model.bin", None)[0] == TOTAL

    # B: a SIGUSR1 in the middle writes a checkpoint and changes nothing
    b = tmp_path / "b"
    rc, err = _run_with_signal(andrea_cmd("main", tok, tokens, b, ov, init=warm), signal.SIGUSR1, K)
    assert rc == 0, err
    assert "SIGUSR1: checkpoint at step" in err
    _, hb = _history(b)
    usr1 = [e for e in hb["events"] if e["detail"] == "SIGUSR1"]
    assert len(usr1) == 1 and K <= usr1[0]["step"] < TOTAL
    assert (b / "model.bin").read_bytes() == ref

    # C: SIGTERM at ~K: checkpoint, exit 143 (stopped, not finished); then resume to TOTAL
    c = tmp_path / "c"
    rc, err = _run_with_signal(andrea_cmd("main", tok, tokens, c, ov, init=warm), signal.SIGTERM, K)
    assert rc == 143, err
    stopped = ck.read_checkpoint(c / "model.bin", None)[0]
    assert K <= stopped < TOTAL, f"SIGTERM checkpoint at step {stopped}"
    assert json.loads((c / "model.state.json").read_text())["step"] == stopped
    r = run_cli("main", tok, tokens, c, ov, init=warm)
    assert r.returncode == 0, r.stderr
    assert f"resuming main at step {stopped}" in r.stderr
    assert (c / "model.bin").read_bytes() == ref

    # .loss.json accumulated across the resume: every step once, same values as the straight run
    ha, _ = _history(a)
    hc, dc = _history(c)
    assert [h[0] for h in hc] == list(range(TOTAL))
    assert [h[:3] + h[4:] for h in hc] == [h[:3] + h[4:] for h in ha]
    assert [e["kind"] for e in dc["events"]].count("resume") == 1
