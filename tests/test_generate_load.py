"""Loading a run for generation: checkpoint + tokenizer + config, mismatches refused; `andrea sample`.

    pytest tests/test_generate_load.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from andrea.cli import main as cli_main
from andrea.config import config_hash, load_config
from andrea.engine import checkpoint as ck
from andrea.engine.backend import NumpyBackend
from andrea.engine.engine import Engine
from andrea.engine.model import ModelConfig
from andrea.errors import AndreaError
from andrea.generate import load_model
from andrea.tokenizer.harris import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.d_model=16", "model.n_head=2", "model.n_layer=1", "model.context=32"]


def make_run(tmp_path: Path, overrides=SMALL, morphemes=("the", "and", "ing", "er", "ion")):
    """A tokenizer.json and a run folder with a real checkpoint and state, through the engine's API."""
    tok = Tokenizer(list(morphemes))
    tok_path = tmp_path / "tokenizer.json"
    tok_path.write_text(tok.dumps(), encoding="utf-8")
    cfg = load_config(ROOT / "params.yaml", "tiny", list(overrides))
    mc = ModelConfig.from_cfg(cfg, tok.vocab_size)
    eng = Engine(mc, batch_size=1, backend=NumpyBackend())
    eng.init_weights(seed=3)
    run = tmp_path / "run"
    ck.write_checkpoint(run / "model.bin", 12, eng.w, eng.m, eng.v)
    from andrea.tokenizer import load
    state = {"format": "andrea.state/1", "step": 12, "phase": "main", "config_hash": config_hash(cfg),
             "tokenizer_sha256": load(tok_path).sha256, "halt": None}
    (run / "model.state.json").write_text(json.dumps(state), encoding="utf-8")
    return cfg, tok_path, run


def test_load_and_sample(tmp_path, capsys):
    cfg, tok_path, run = make_run(tmp_path)
    lm = load_model(run, tok_path, cfg)
    assert lm.step == 12 and lm.model.n_params == Engine(lm.config, 1, NumpyBackend()).n_params
    rc = cli_main(["sample", "--params", str(ROOT / "params.yaml"), "--profile", "tiny", *sum((["-S", o] for o in SMALL), []),
                   "--run", str(run), "--tokenizer", str(tok_path), "--prompt", "the", "--max-new-tokens", "8",
                   "--seed", "4", "--json", "--n", "2"])
    assert rc == 0
    lines = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2 and all(l["step"] == 12 and l["prompt"] == "the" for l in lines)
    assert all(l["n_tokens"] <= 8 for l in lines)
    rc = cli_main(["sample", "--params", str(ROOT / "params.yaml"), "--profile", "tiny", *sum((["-S", o] for o in SMALL), []),
                   "--run", str(run), "--tokenizer", str(tok_path), "--prompt", "the", "--max-new-tokens", "8",
                   "--seed", "4", "--json", "--n", "2"])
    assert [json.loads(l) for l in capsys.readouterr().out.splitlines()] == lines     # same seed, same text


def test_refuses_another_tokenizer(tmp_path):
    cfg, tok_path, run = make_run(tmp_path)
    other = tmp_path / "other.json"
    other.write_text(Tokenizer(["the", "and", "ing", "er", "ed"]).dumps(), encoding="utf-8")   # same size, other sha
    with pytest.raises(AndreaError, match="tokenizer_sha256 .* another tokenizer"):
        load_model(run, other, cfg)


def test_refuses_another_model_shape(tmp_path):
    cfg, tok_path, run = make_run(tmp_path)
    wider = load_config(ROOT / "params.yaml", "tiny", [*SMALL, "model.d_model=32"])
    with pytest.raises(AndreaError, match="n_params .* but the model has"):
        load_model(run, tok_path, wider)


def test_refuses_truncated_and_missing(tmp_path):
    cfg, tok_path, run = make_run(tmp_path)
    data = (run / "model.bin").read_bytes()
    (run / "model.bin").write_bytes(data[:-4])
    with pytest.raises(AndreaError, match="truncated"):
        load_model(run, tok_path, cfg)
    with pytest.raises(AndreaError, match="checkpoint not found"):
        load_model(tmp_path / "nowhere", tok_path, cfg)


def test_refuses_model_section_recorded_in_state(tmp_path):
    cfg, tok_path, run = make_run(tmp_path)
    st = json.loads((run / "model.state.json").read_text())
    st["config"] = {"model": {**cfg["model"], "n_head": 4}}          # same n_params, other head split
    (run / "model.state.json").write_text(json.dumps(st))
    with pytest.raises(AndreaError, match="model.n_head=4 in the run"):
        load_model(run, tok_path, cfg)


def test_sample_reads_a_prompt_file_and_greedy_is_repeatable(tmp_path, capsys):
    cfg, tok_path, run = make_run(tmp_path)
    pf = tmp_path / "prompt.txt"
    pf.write_text("the module", encoding="utf-8")
    base = ["sample", "--params", str(ROOT / "params.yaml"), "--profile", "tiny", *sum((["-S", o] for o in SMALL), []),
            "--run", str(run), "--tokenizer", str(tok_path), "--max-new-tokens", "6", "--temperature", "0", "--json"]
    assert cli_main([*base, "--prompt-file", str(pf), "--seed", "1"]) == 0
    a = json.loads(capsys.readouterr().out)
    assert cli_main([*base, "--prompt-file", str(pf), "--seed", "2"]) == 0
    b = json.loads(capsys.readouterr().out)
    assert a["prompt"] == "the module" and a["text"] == b["text"]          # greedy: the seed does not matter
