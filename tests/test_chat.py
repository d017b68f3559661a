"""`andrea chat RUN` / `andrea sample RUN` with no other argument, the chat's commands, streaming.

    pytest tests/test_chat.py

The run is laid out as the pipeline lays it out (``<root>/runs/tiny/main`` beside
``<root>/data/tokenizer/tiny/tokenizer.json``), so the profile comes from the run state's
config and the tokenizer from the standard layout, checked by its sha256.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from andrea.chat import COMMANDS, AnswerStream
from andrea.cli import main as cli_main
from andrea.generate import SamplingOptions, find_tokenizer, generate
from andrea.errors import AndreaError
from andrea.tokenizer.harris import Tokenizer
from reports_fixtures import make_run

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def laid_out(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat")
    (tmp / "made").mkdir()
    r = make_run(tmp / "made", train_steps=5)
    root = tmp / "root"
    shutil.copytree(r.run, root / "runs" / "tiny" / "main")
    (root / "data" / "tokenizer" / "tiny").mkdir(parents=True)
    shutil.copyfile(r.tokenizer, root / "data" / "tokenizer" / "tiny" / "tokenizer.json")
    return r, root


def chat(run: Path, stdin: str, *extra) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "andrea", "chat", str(run), *extra]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_chat_needs_only_the_run_folder_and_matches_the_explicit_call(laid_out):
    r, root = laid_out
    run = root / "runs" / "tiny" / "main"
    talk = "What does len do?\nAnd print?\n"
    p = chat(run, talk, "--seed", "5", "--max-new-tokens", "10")
    assert p.returncode == 0, p.stderr
    assert "step 5" in p.stdout.splitlines()[0]
    explicit = subprocess.run([sys.executable, "-m", "andrea", "chat", *r.cli_params(), "--run", str(r.run),
                               "--tokenizer", str(r.tokenizer), "--seed", "5", "--max-new-tokens", "10"],
                              input=talk, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert explicit.returncode == 0, explicit.stderr
    assert p.stdout.splitlines()[1:] == explicit.stdout.splitlines()[1:]      # same model, config, tokenizer, seed


def test_chat_commands(laid_out):
    _, root = laid_out
    run = root / "runs" / "tiny" / "main"
    p = chat(run, "/help\n/temp 0\n/max 4\nhi\nhi\n/reset\n/temp nope\n/top_k 3\n/top_p 0.5\n/seed 9\n/settings\n"
                  "/system Be brief.\n/system\n/frobnicate\n/quit\nnever\n")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    for c in COMMANDS:
        assert c in out                                  # /help lists every command
    answers = [l for l in out.splitlines() if l.startswith("andrea: ")]
    assert len(answers) == 2
    assert "(temperature 0.0, top_k 20, top_p 0.95, max 4)" in out
    assert "(/temp: expected a number, got 'nope')" in out
    assert "(temperature 0.0, top_k 3, top_p 0.5, max 4, seed 9, system None)" in out
    assert "(system prompt set; conversation cleared)" in out and "(system prompt cleared; conversation cleared)" in out
    assert "(unknown command /frobnicate; /help lists them)" in out
    assert "never" not in out.split("you: /quit")[1]


def test_sample_needs_only_the_run_folder(laid_out, capsys, monkeypatch):
    r, root = laid_out
    monkeypatch.chdir(ROOT)
    args = ["--prompt", "the", "--max-new-tokens", "6", "--seed", "3", "--json"]
    assert cli_main(["sample", str(root / "runs" / "tiny" / "main"), *args]) == 0
    a = json.loads(capsys.readouterr().out)
    assert cli_main(["sample", *r.cli_params(), "--run", str(r.run), "--tokenizer", str(r.tokenizer), *args]) == 0
    assert json.loads(capsys.readouterr().out) == a


def test_tokenizer_of_another_sha_or_missing_is_named(laid_out, tmp_path, capsys, monkeypatch):
    r, root = laid_out
    monkeypatch.chdir(tmp_path)
    other = tmp_path / "runs" / "tiny" / "main"
    shutil.copytree(root / "runs" / "tiny" / "main", other)
    state = json.loads((other / "model.state.json").read_text())
    with pytest.raises(AndreaError, match="tokenizer not found at .*data/tokenizer/tiny/tokenizer.json"):
        find_tokenizer(other, state)
    (tmp_path / "data" / "tokenizer" / "tiny").mkdir(parents=True)
    (tmp_path / "data" / "tokenizer" / "tiny" / "tokenizer.json").write_text(Tokenizer(["zz", "qq"]).dumps())
    with pytest.raises(AndreaError, match="tokenizer_sha256 .* matches none of"):
        find_tokenizer(other, state)
    assert find_tokenizer(root / "runs" / "tiny" / "main", state) == root / "data" / "tokenizer" / "tiny" / "tokenizer.json"
    assert cli_main(["chat", str(other), "--params", str(ROOT / "params.yaml")]) == 2
    assert "pass the run's --tokenizer" in capsys.readouterr().err


def test_answer_stream_writes_whole_characters_and_never_a_stop_tag():
    tok = Tokenizer(["<|", "end", "|>", "ab"])
    ids = [int(i) for i in tok.encode("  ab é\nab")] + [int(i) for i in tok.encode("<|end|>tail")]
    assert tok.token_bytes(ids[ids.index(ord(" ")) + 1]) != "é".encode()     # é arrives as two byte tokens
    pieces = []
    s = AnswerStream(tok, ("<|end|>", "<|user|>"), pieces.append, indent="..")
    seen = []
    for i in ids:
        s.feed(i)
        seen.append("".join(pieces))
        assert "\ufffd" not in seen[-1] and "<" not in seen[-1]
    assert "".join(pieces) == "ab é\n..ab"
    assert s.chunks > 2                                  # written piece by piece, not at the end
    s.finish("  ab é\nab  ")
    assert "".join(pieces) == "ab é\n..ab"


def test_streamed_text_is_the_answer(tmp_path):
    from andrea.generate import load_model
    from andrea.reports.audit import answer_stops

    r = make_run(tmp_path, train_steps=5)
    lm = load_model(r.run, r.tokenizer, r.cfg)
    stops = answer_stops()
    for seed in range(4):
        pieces = []
        s = AnswerStream(lm.tokenizer, stops, pieces.append, indent="")
        g = generate(lm.model, lm.tokenizer.encode("<|user|>\nhi<|end|>\n<|assistant|>\n"),
                     SamplingOptions(max_new_tokens=24, temperature=1.0, stop_strings=stops), np.random.default_rng(seed),
                     eot_id=lm.tokenizer.eot_id, tokenizer=lm.tokenizer, on_token=s.feed)
        streamed = "".join(pieces)
        assert (g.text or "").strip().startswith(streamed)
        s.finish(g.text or "")
        assert "".join(pieces) == (g.text or "").strip()


def test_sample_and_chat_hand_the_weights_to_the_graph_decoder_on_cupy(laid_out, monkeypatch, capsys):
    """The wiring of ``fast_model`` without a GPU: a backend named cupy gets the CUDA-graph
    decoder, built from the loaded config, the very flat weight buffer and --decode-precision
    (the decoder itself is checked against InferenceModel on the device: test_generate_decode_gpu.py)."""
    import io
    import types

    import andrea.backends
    import andrea.cuda.decode
    from andrea.engine.backend import NumpyBackend
    from andrea.generate import InferenceModel

    made = []

    class FakeCupy(NumpyBackend):
        name = "cupy"

    class FakeDecoder(InferenceModel):
        def __init__(self, mc, params, precision):
            made.append((mc, params, precision))
            super().__init__(mc, params)

    monkeypatch.setattr(andrea.backends, "select_backend", lambda name: (FakeCupy(), "test double"))
    monkeypatch.setattr(andrea.cuda.decode, "GraphDecoder", FakeDecoder)
    r, root = laid_out
    run = str(root / "runs" / "tiny" / "main")
    monkeypatch.chdir(ROOT)
    args = ["--prompt", "the", "--max-new-tokens", "6", "--seed", "3", "--json"]
    assert cli_main(["sample", run, *args, "--backend", "cupy", "--decode-precision", "bf16"]) == 0
    got = json.loads(capsys.readouterr().out)
    (mc, params, prec), = made
    assert prec == "bf16" and mc.d_model == r.cfg["model"]["d_model"] and params.shape == (r.engine.n_params,)
    assert np.array_equal(params, r.engine.w)
    monkeypatch.setattr(andrea.backends, "select_backend", lambda name: (NumpyBackend(), "test double"))
    assert cli_main(["sample", run, *args, "--backend", "numpy"]) == 0
    assert json.loads(capsys.readouterr().out) == got and len(made) == 1       # numpy: no decoder
    monkeypatch.setattr(andrea.backends, "select_backend", lambda name: (FakeCupy(), "test double"))
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(isatty=lambda: False, readline=io.StringIO("hi\n").readline))
    assert cli_main(["chat", run, "--backend", "cupy", "--max-new-tokens", "4"]) == 0
    assert made[-1][2] == "fp32" and "andrea: " in capsys.readouterr().out
