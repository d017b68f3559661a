"""The audit stage on a small synthetic run: prompts, archived checkpoints, flags, determinism.

    pytest tests/test_reports_audit.py
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from andrea.cli import main as cli_main
from andrea.engine import checkpoint as ck
from andrea.engine.model import param_layout
from andrea.errors import AndreaError
from andrea.reports.audit import load_prompts, sample_flags
from andrea.settings import MaxRepeat
from reports_fixtures import make_run


def test_shipped_prompt_sets_load_with_every_domain():
    prompts = load_prompts()
    domains = {p.domain for p in prompts}
    assert {"chat", "prose", "code"} <= domains
    chat = [p for p in prompts if p.domain == "chat"]
    assert all(p.text.endswith("<|assistant|>\n") and p.stop_strings for p in chat)
    assert {"<|end|>", "<|user|>", "<|system|>", "<|assistant|>"} <= set(chat[0].stop_strings)
    assert any("<|system|>" in p.text for p in chat) and any(p.text.count("<|user|>") > 1 for p in chat)
    assert len({p.id for p in prompts}) == len(prompts)


def test_bad_prompt_files_are_refused_naming_file_and_row():
    good = {"format": "andrea.prompts/1", "domain": "chat", "kind": "chat",
            "prompts": [{"id": "a", "turns": [{"from": "human", "value": "hi"}]}]}
    bad = json.loads(json.dumps(good))
    bad["prompts"].append({"id": "b", "turns": [{"from": "gpt", "value": "x"}]})
    with pytest.raises(AndreaError, match=r"andrea/prompts/x.json: prompt 1 \(b\).*bad_order"):
        load_prompts([("x.json", json.dumps(bad))])
    dup = json.loads(json.dumps(good))
    dup["prompts"].append(dup["prompts"][0])
    with pytest.raises(AndreaError, match="prompt 1: missing or repeated 'id'"):
        load_prompts([("x.json", json.dumps(dup))])


def test_flags():
    from andrea.coherence import scores
    lim = MaxRepeat(bigram=0.5, trigram=0.4, word=0.5, char=0.6)
    assert sample_flags("   ", scores("   "), lim) == ["empty"]
    loop = "the cat sat " * 10
    assert any(f.startswith("trigram") for f in sample_flags(loop, scores(loop), lim))
    assert sample_flags("\ufffd\ufffdab", scores("\ufffd\ufffdab"), lim) == ["mojibake"]
    assert sample_flags("a b a", scores("a b a"), lim) == []          # too short for a rate to mean much
    assert sample_flags("ab" * 10, scores("ab" * 10), lim)[0].startswith("char")
    fine = "Lists are mutable sequences, typically used to store collections of items."
    assert sample_flags(fine, scores(fine), lim) == []


def audit(r, out, *extra):
    return cli_main(["audit", *r.cli_params(), "--run", str(r.run), "--tokenizer", str(r.tokenizer), "--out", str(out), *extra])


def test_audit_writes_json_and_md_for_final_and_archived_checkpoints(tmp_path):
    r = make_run(tmp_path, train_steps=20)
    out = tmp_path / "reports"
    assert audit(r, out) == 0
    a = json.loads((out / "audit.json").read_text())
    assert a["format"] == "andrea.audit/1"
    assert [(c["step"], c["final"]) for c in a["checkpoints"]] == [(10, False), (20, True)]
    assert a["checkpoints"][0]["path"] == "archive/model.step10.bin"
    n = len(load_prompts())
    for c in a["checkpoints"]:
        assert len(c["samples"]) == n
        assert {"chat", "prose", "code", "all"} <= set(c["summary"])
        for s in c["samples"]:
            assert s["n_tokens"] <= 12 and set(s["scores"]) >= {"bigram", "trigram", "word", "char", "distinct_2"}
    assert a["final"]["step"] == 20 and a["final"]["summary"]["n_samples"] == n
    assert a["training"]["coherence_checks"] == 2 and a["training"]["halt"] is None
    md = (out / "audit.md").read_text()
    assert "## Coherence by checkpoint" in md and "### chat-01" in md and "step 20" in md
    # same config, same bytes
    first = (out / "audit.json").read_bytes()
    assert audit(r, out) == 0
    assert (out / "audit.json").read_bytes() == first
    # the warmup run's checkpoint can join as an extra one
    assert audit(r, out, "--extra-checkpoint", str(r.run / "archive" / "model.step10.bin"), "--final-only") == 0
    assert [c["step"] for c in json.loads((out / "audit.json").read_text())["checkpoints"]] == [20]


def test_degenerate_model_is_flagged(tmp_path):
    r = make_run(tmp_path, train_steps=2)
    layout = param_layout(r.engine.mc)
    step, w, m, v = ck.read_checkpoint(r.run / "model.bin", layout.n_params)

    def view(name):
        t = layout.by_name[name]
        return w[t.offset:t.offset + t.size].reshape(t.shape)
    view("lnf.g")[:] = 0.0
    view("lnf.b")[:] = 1.0
    view("wte")[ord("a")] = 3.0                    # every position's arg-max: the byte "a"
    ck.write_checkpoint(r.run / "model.bin", step, w, m, v)
    out = tmp_path / "rep"
    assert audit(r, out, "--final-only", "-S", "audit.temperature=0.01", "-S", "audit.max_new_tokens=24") == 0
    a = json.loads((out / "audit.json").read_text())
    assert a["final"]["summary"]["n_flagged"] == a["final"]["summary"]["n_samples"]
    assert all(any(f.startswith("char") for f in s["flags"]) for s in a["checkpoints"][-1]["samples"])
    assert "flagged" in (out / "audit.md").read_text()


def test_missing_run_is_a_clear_error(tmp_path, capsys):
    r = make_run(tmp_path, train_steps=1)
    (r.run / "model.bin").unlink()
    assert audit(r, tmp_path / "o") == 2
    assert "final checkpoint not found" in capsys.readouterr().err
    assert not (tmp_path / "o" / "audit.json").exists()
