"""`andrea export`: the run loads in plain `transformers` and computes what ANDREA computes.

    pytest tests/test_export.py          (needs the oracle extra: transformers, torch, safetensors)

The tokenizer is the tiny profile's, trained here on the embedded corpus's train split
(the tiny DAG's own tokenizer.json, byte for byte, in ~5 s); the shipped tokenizer class
must give andrea's ids over the WHOLE embedded val split. The run is a small model with
random weights at a large scale (so every tensor matters, including LayerNorm's bias, and
the greedy arg-max is never a near tie) written through the run folder's files.

Tolerance of the logits: |ours - transformers| <= 1e-4 + 1e-5 * |ref|. Both sides compute in
fp32 the same function; they differ only in the order of the sums (NumPy's BLAS and our
LayerNorm vs torch's kernels) and the form of GELU (our exp/sigmoid form of tanh-GELU vs
torch's tanh): a few fp32 ulps per op, observed 1e-5 at |logit| ~ 15 over 4 layers. The
bound is 10x that and still far below the gaps the greedy check relies on.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the oracle extra)")
torch = pytest.importorskip("torch", reason="torch is not installed (the oracle extra)")
pytest.importorskip("safetensors", reason="safetensors is not installed")

import pyarrow.parquet as pq  # noqa: E402
import yaml  # noqa: E402

from andrea.cli import main as cli_main  # noqa: E402
from andrea.config import config_hash, load_config  # noqa: E402
from andrea.engine import checkpoint as ck  # noqa: E402
from andrea.engine.model import ModelConfig, param_layout  # noqa: E402
from andrea.errors import AndreaError  # noqa: E402
from andrea.export import export  # noqa: E402
from andrea.generate import InferenceModel, SamplingOptions, generate  # noqa: E402
from andrea.tokenizer import load as load_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PARAMS = str(ROOT / "params.yaml")
SMALL = ["model.d_model=32", "model.n_head=2", "model.n_layer=2", "model.context=48",
         "audit.temperature=0.7", "audit.top_k=17", "audit.top_p=0.9", "audit.max_new_tokens=20"]
ATOL, RTOL = 1e-4, 1e-5
FIXED = "def add(a, b):\n    return a + b\n<|user|>\nWhat does len() do?<|end|>\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """megachat of the embedded corpus and the tiny profile's tokenizer trained on its train split."""
    from andrea.data import hermes3, megachat

    root = tmp_path_factory.mktemp("corpus")
    cfg = load_config(PARAMS, "tiny", [])
    raw = root / "data" / "raw" / "hermes3" / "embedded"
    raw.mkdir(parents=True)
    (raw / "MANIFEST.json").write_text(json.dumps(hermes3.pull_embedded(cfg, ROOT / "data" / "embedded", raw)))
    shutil.copytree(ROOT / "data" / "embedded", root / "data" / "embedded")
    megachat.prep(cfg, raw, ROOT / "data" / "embedded", root / "megachat")
    out = root / "data" / "tokenizer" / "tiny"
    assert cli_main(["tokenizer", "--params", PARAMS, "--profile", "tiny", "--train",
                     str(root / "megachat" / "train.parquet"), "--out", str(out)]) == 0
    return root, out / "tokenizer.json"


def make_run(root: Path, tok_path: Path, seed: int = 0) -> tuple[dict, Path, np.ndarray]:
    """runs/tiny/main under ``root`` with large random weights, its state (with the config) and a
    loss history; reports/tiny with a metrics.json and an audit.json in the stages' formats."""
    tok = load_tokenizer(tok_path)
    cfg = load_config(PARAMS, "tiny", SMALL)
    mc = ModelConfig.from_cfg(cfg, tok.vocab_size)
    lay = param_layout(mc)
    rng = np.random.default_rng(seed)
    w = np.empty(lay.n_params, dtype=np.float32)
    for t in lay.tensors:
        if t.name.endswith(".g"):
            v = 1.0 + 0.2 * rng.standard_normal(t.shape)
        elif t.name.endswith(".b"):
            v = 0.2 * rng.standard_normal(t.shape)
        else:
            v = rng.standard_normal(t.shape) * (0.5 if t.name in ("wte", "wpe") else 1.0 / np.sqrt(t.shape[0]))
        w[t.offset:t.offset + t.size] = v.reshape(-1)
    run = root / "runs" / "tiny" / "main"
    ck.write_checkpoint(run / "model.bin", 42, w, np.zeros_like(w), np.zeros_like(w))
    state = {"format": "andrea.state/1", "step": 42, "phase": "main", "config_hash": config_hash(cfg),
             "tokenizer_sha256": tok.sha256, "n_params": lay.n_params, "halt": None, "precision": "bf16",
             "backend": "cupy", "steps": {"phase_start": 10, "phase_end": 42, "max_steps": 42},
             "model": {"vocab_size": tok.vocab_size, **{k: cfg["model"][k] for k in ("d_model", "n_head", "n_layer", "context")}},
             "train_shards": {"py-code": [1, 2, 3]}, "config": cfg}
    (run / "model.state.json").write_text(json.dumps(state), encoding="utf-8")
    (run / "model.loss.json").write_text(json.dumps({"format": "andrea.loss/1", "train": [], "pulls": [], "events": [],
        "val": [{"step": 42, "loss": 4.25, "per_source": {"py-code": 4.5}, "unigram": 5.75,
                 "unigram_per_source": {"py-code": 5.5}}]}), encoding="utf-8")
    rep = root / "reports" / "tiny"
    rep.mkdir(parents=True, exist_ok=True)
    (rep / "metrics.json").write_text(json.dumps({"val_loss": 4.25, "val_bpb": 2.3456, "unigram_bpb": 3.2109, "step": 42,
        "per_source": {"py-code": {"loss": 4.5, "bpb": 2.4681}, "chat-system": {"loss": 3.1, "bpb": 1.7531}}}))
    (rep / "audit.json").write_text(json.dumps({"format": "andrea.audit/1", "options": {"temperature": 0.7},
        "final": {"step": 42, "summary": {"n_flagged": 1, "n_samples": 24}},
        "flags": [{"step": 42, "id": "code-02", "domain": "code", "sample": 0, "flags": ["char 0.97 > 0.60"]}]}))
    return cfg, run, w


@pytest.fixture(scope="module")
def exported(corpus, tmp_path_factory):
    root, tok_path = corpus
    cfg, run, w = make_run(root, tok_path)
    out = tmp_path_factory.mktemp("exp") / "tiny"
    export(run, out, tokenizer=tok_path, reports=root / "reports" / "tiny", data=root / "data")
    return cfg, run, w, out, load_tokenizer(tok_path)


def test_tokenizer_json_is_the_tiny_dags_and_the_class_gives_andreas_ids_on_the_whole_val_split(corpus, exported):
    _, tok_path = corpus
    _, _, _, out, tok = exported
    hf = transformers.AutoTokenizer.from_pretrained(str(out), trust_remote_code=True)
    assert (out / "harris.json").read_bytes() == tok_path.read_bytes()
    texts = pq.read_table(corpus[0] / "megachat" / "val.parquet").column("text").to_pylist()
    assert len(texts) > 100
    n = 0
    for text in texts:
        ours = tok.encode(text).tolist()
        assert hf(text)["input_ids"] == ours
        assert hf.decode(ours, skip_special_tokens=True) == tok.decode(ours)
        n += len(ours)
    assert n > 50_000
    for s in ("<|endoftext|> x", "日本語 über", "\r\n\t  x", "a\ud800b", ""):
        assert hf(s)["input_ids"] == tok.encode(s).tolist()
    assert hf.eos_token_id == tok.eot_id and hf.vocab_size == len(hf) == tok.vocab_size
    assert hf.decode([tok.eot_id, 104, 105], skip_special_tokens=True) == "hi"


def test_transformers_logits_and_greedy_continuations_match_ours(exported):
    cfg, run, w, out, tok = exported
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    mc = ModelConfig.from_cfg(cfg, tok.vocab_size)
    assert model.config.n_positions == mc.context and model.config.activation_function == "gelu_new"
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()   # tied
    im = InferenceModel(mc, w.copy())
    ids = tok.encode(FIXED)
    assert 20 < ids.size < mc.context - 12
    ours = im.forward(ids, all_logits=True).copy()
    with torch.no_grad():
        ref = model(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    assert ours.shape == ref.shape == (ids.size, tok.vocab_size)
    err = np.abs(ours - ref)
    assert (err <= ATOL + RTOL * np.abs(ref)).all(), float(err.max())
    assert np.abs(ref).max() > 5          # large enough weights that the check means something
    for prompt in (FIXED[:30], "What does", "import os\n"):
        p = tok.encode(prompt)
        n_new = mc.context - p.size - 1
        g = generate(im, p, SamplingOptions(max_new_tokens=n_new, temperature=0, stop_at_eot=False), rng=0)
        with torch.no_grad():
            hf_ids = model.generate(torch.tensor(p[None].astype(np.int64)), max_new_tokens=n_new, do_sample=False,
                                    eos_token_id=None, pad_token_id=tok.eot_id)[0, p.size:].tolist()
        assert g.ids == hf_ids and len(hf_ids) == n_new


def test_config_generation_config_and_card(exported):
    cfg, run, w, out, tok = exported
    c = json.loads((out / "config.json").read_text())
    assert (c["model_type"], c["n_embd"], c["n_layer"], c["n_head"], c["n_positions"], c["vocab_size"]) == \
           ("gpt2", 32, 2, 2, 48, tok.vocab_size)
    assert c["layer_norm_epsilon"] == 1e-5 and c["tie_word_embeddings"] is True
    g = transformers.GenerationConfig.from_pretrained(str(out))
    assert (g.do_sample, g.temperature, g.top_k, g.top_p, g.max_new_tokens, g.eos_token_id) == \
           (True, 0.7, 17, 0.9, 20, tok.eot_id)
    from safetensors.numpy import load_file
    st = load_file(str(out / "model.safetensors"))
    lay = param_layout(ModelConfig.from_cfg(cfg, tok.vocab_size))
    assert sum(a.size for n, a in st.items() if not n.endswith(("attn.bias", "c_fc.bias", "c_proj.bias"))) == lay.n_params
    assert all(not a.any() for n, a in st.items() if n.endswith(("c_attn.bias", "c_fc.bias", "c_proj.bias")))
    card = (out / "README.md").read_text()
    head = yaml.safe_load(card.split("---\n")[1])
    assert head["library_name"] == "transformers" and head["pipeline_tag"] == "text-generation"
    assert head["andrea"]["n_params"] == lay.n_params and head["andrea"]["step"] == 42
    assert head["andrea"]["precision"] == "bf16"
    assert head["andrea"]["tokenizer_sha256"] == tok.sha256
    metrics = {m["name"]: m["value"] for m in head["model-index"][0]["results"][0]["metrics"]}
    assert metrics["held-out bits/byte (all sources)"] == 2.3456 and metrics["held-out bits/byte: py-code"] == 2.4681
    assert metrics["unigram baseline bits/byte"] == 3.2109
    body = card.split("---\n", 2)[2]
    recipe = yaml.safe_load(body.split("```yaml\n")[1].split("```")[0])
    assert recipe == cfg                                  # the recipe IS the resolved params
    for s in ("char 0.97 > 0.60", "code-02", f"{lay.n_params:,}", "2.4681", "1.7531", "3.2109", "5.7500",
              json.loads((corpus_root(run) / "data" / "embedded" / "PROVENANCE.json").read_text())["sources"][0]["sha256"],
              "revision `embedded:", "bf16"):
        assert s in body, s


def corpus_root(run: Path) -> Path:
    return run.parents[2]


def test_cli_finds_the_tokenizer_by_the_standard_layout_and_refuses_bad_runs(corpus, tmp_path, capsys, monkeypatch):
    root, tok_path = corpus
    monkeypatch.chdir(tmp_path)                           # neither data/ nor reports/ here: found beside runs/
    _, run, w = make_run(root, tok_path, seed=1)
    out = tmp_path / "exp"
    assert cli_main(["export", str(run), "--out", str(out)]) == 0       # no params.yaml here: the run's config
    assert (out / "harris.json").read_bytes() == tok_path.read_bytes()
    assert "No `reports/tiny/metrics.json`" in (out / "README.md").read_text()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # a run whose weights went NaN: refused with one line, the previous export untouched
    bad = tmp_path / "runs" / "tiny" / "main"
    shutil.copytree(run, bad)
    w2 = w.copy()
    w2[5] = np.nan
    ck.write_checkpoint(bad / "model.bin", 42, w2, np.zeros_like(w2), np.zeros_like(w2))
    shutil.copytree(tok_path.parent, tmp_path / "data" / "tokenizer" / "tiny")
    assert cli_main(["export", str(bad), "--out", str(out)]) == 2
    assert "NaN or inf" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # another tokenizer at the standard place: named, refused
    (tmp_path / "data" / "tokenizer" / "tiny" / "tokenizer.json").write_text("{}")
    assert cli_main(["export", str(bad), "--out", str(tmp_path / "e2")]) == 2
    err = capsys.readouterr().err
    assert "tokenizer_sha256" in err and "data/tokenizer/tiny/tokenizer.json" in err and "Traceback" not in err
    st = json.loads((bad / "model.state.json").read_text())
    del st["config"]
    (bad / "model.state.json").write_text(json.dumps(st))
    with pytest.raises(AndreaError, match="no 'config' in the run state"):
        export(bad, tmp_path / "e3", tokenizer=tok_path)
    (bad / "model.state.json").unlink()
    with pytest.raises(AndreaError, match="model.state.json"):
        export(bad, tmp_path / "e3", tokenizer=tok_path)
    assert not (tmp_path / "e2").exists() and not (tmp_path / "e3").exists()
