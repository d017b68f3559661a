"""`andrea tokenizer` end to end on a small megachat-shaped Parquet built from CPython's own text.

    pytest tests/test_tokenizer_stage.py

``make_megachat(folder)`` (also used by tests/test_diet.py) writes train.parquet and
val.parquet with the megachat columns: a prose source (pydoc topics), a code source
(stdlib modules), a chat source (docstrings in a chat shape) and a CJK source the
tokenizer will serve badly.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from andrea import cli
from andrea.tokenizer import load

ROOT = Path(__file__).resolve().parents[1]
PARAMS = str(ROOT / "params.yaml")
SMALL = ["-S", "tokenizer.n_morphemes=400", "-S", "tokenizer.min_count=2"]


def _docs(seed: int = 0) -> list[dict]:
    import argparse
    import json as json_mod
    import textwrap
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    rows = []

    def add(source, kind, text, n_turns=0, system=False):
        rows.append({"source": source, "kind": kind, "text": text, "n_turns": n_turns, "has_system_prompt": system})

    for k in sorted(topics)[:60]:
        add("py-topics", "prose", topics[k])
    for mod in (textwrap, json_mod.encoder, argparse):
        src = inspect.getsource(mod)
        for chunk in src.split("\n\n\n"):
            if chunk.strip():
                add("py-code", "code", chunk)
    names = sorted(n for n in dir(str) if not n.startswith("_"))
    for n in names:
        doc = inspect.getdoc(getattr(str, n)) or ""
        system = rng.random() < 0.3
        text = (("<|system|>\nYou are a helpful assistant.\n" if system else "")
                + f"<|user|>\nWhat does str.{n} do?\n<|assistant|>\n{doc}\n")
        add("chat-single", "chat", text, 1, system)
    for _ in range(40):
        add("zh-notes", "prose", "".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(rng.randrange(50, 300))))
    for r in rows:
        r["doc_id"] = hashlib.sha256(r["text"].encode()).hexdigest()[:16]
        r["split"] = "val" if int(r["doc_id"], 16) % 8 == 0 else "train"
    return rows


def make_megachat(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = _docs()
    for split in ("train", "val"):
        part = [r for r in rows if r["split"] == split]
        cols = {k: [r[k] for r in part] for k in ("source", "kind", "doc_id", "text", "n_turns", "has_system_prompt", "split")}
        pq.write_table(pa.table(cols), folder / f"{split}.parquet")
    return folder


@pytest.fixture(scope="module")
def megachat(tmp_path_factory) -> Path:
    return make_megachat(tmp_path_factory.mktemp("megachat"))


def _train(megachat: Path, out: Path, *extra: str) -> int:
    return cli.main(["tokenizer", "--params", PARAMS, "--profile", "tiny", *SMALL, *extra,
                     "--train", str(megachat / "train.parquet"), "--out", str(out)])


def test_stage_writes_tokenizer_and_sha(megachat, tmp_path):
    out = tmp_path / "tok"
    assert _train(megachat, out) == 0
    blob = (out / "tokenizer.json").read_bytes()
    digest = hashlib.sha256(blob).hexdigest()
    assert (out / "tokenizer.json.sha256").read_text().split() == [digest, "tokenizer.json"]
    obj = json.loads(blob)
    assert obj["format"] == "andrea.tokenizer/1" and obj["n_morphemes"] == 400 and obj["vocab_size"] == 657
    tok = load(out / "tokenizer.json")
    assert tok.sha256 == digest and tok.eot_id == 656
    text = pq.read_table(megachat / "val.parquet").column("text").to_pylist()[0]
    assert tok.decode(tok.encode(text)) == text
    # same input and config -> the same bytes
    again = tmp_path / "tok2"
    assert _train(megachat, again) == 0
    assert (again / "tokenizer.json").read_bytes() == blob


def test_max_train_bytes_limits_the_text_read(megachat, tmp_path):
    out = tmp_path / "tok"
    assert _train(megachat, out, "-S", "tokenizer.max_train_bytes=20000", "-S", "tokenizer.n_morphemes=50") == 0
    meta = json.loads((out / "tokenizer.json").read_text())["training"]
    total = sum(len(t.encode()) for t in pq.read_table(megachat / "train.parquet").column("text").to_pylist())
    assert 20000 <= meta["train_bytes"] < min(total, 20000 + 100_000)


def test_bad_inputs_are_one_line_errors(megachat, tmp_path, capsys):
    assert _train(tmp_path, tmp_path / "x") == 2
    assert "train.parquet: not found" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    pq.write_table(pa.table({"body": ["a"]}), bad / "train.parquet")
    assert _train(bad, tmp_path / "x") == 2
    assert "missing column(s) text" in capsys.readouterr().err
    pq.write_table(pa.table({"text": ["abc abc", None]}), bad / "train.parquet")
    assert _train(bad, tmp_path / "x") == 2
    assert "row 1 column 'text'" in capsys.readouterr().err
    assert _train(megachat, tmp_path / "big", "-S", "tokenizer.n_morphemes=60000") == 2
    assert "n_morphemes=60000" in capsys.readouterr().err
    assert not (tmp_path / "big").exists()


def test_tokenizer_ids_fit_uint16_shards(megachat, tmp_path):
    out = tmp_path / "tok"
    assert _train(megachat, out) == 0
    tok = load(out / "tokenizer.json")
    ids = tok.encode("".join(pq.read_table(megachat / "train.parquet").column("text").to_pylist()[:20]))
    assert ids.max() < tok.vocab_size <= 1 << 16 and np.all(ids >= 0)
