"""`andrea diet-alignment`: token shards that decode back to the corpus, per-source figures,
the saturation curve and the warning for a badly served source.

    pytest tests/test_diet.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from andrea import cli
from andrea.diet import HashSample, knee, saturation
from andrea.shards import Shard
from andrea.tokenizer import load
from test_tokenizer_stage import PARAMS, SMALL, make_megachat

SWEEP = ["-S", "diet.sweep=[50, 100, 200, 400]", "-S", "diet.max_sample_bytes=400000"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("diet")
    make_megachat(root / "megachat")
    assert cli.main(["tokenizer", "--params", PARAMS, "--profile", "tiny", *SMALL,
                     "--train", str(root / "megachat" / "train.parquet"), "--out", str(root / "tok")]) == 0
    assert _diet(root) == 0
    return root


def _diet(root: Path, *extra: str) -> int:
    return cli.main(["diet-alignment", "--params", PARAMS, "--profile", "tiny", *SMALL, *SWEEP, *extra,
                     "--tokenizer", str(root / "tok" / "tokenizer.json"), "--megachat", str(root / "megachat"),
                     "--tokens", str(root / "tokens"), "--report", str(root / "report")])


def test_shards_decode_back_to_every_document(run_dir):
    tok = load(run_dir / "tok" / "tokenizer.json")
    for split in ("train", "val"):
        table = pq.read_table(run_dir / "megachat" / f"{split}.parquet").to_pydict()
        for source in sorted(set(table["source"])):
            texts = [t for s, t in zip(table["source"], table["text"]) if s == source]
            shard = Shard(run_dir / "tokens" / split / f"{source}.bin")
            assert shard.n_docs == len(texts) and shard.vocab_size == tok.vocab_size
            for i, text in enumerate(texts):
                doc = shard.doc(i)
                assert int(doc[-1]) == tok.eot_id
                assert tok.decode(doc[:-1]) == text


def test_report_per_source(run_dir):
    r = json.loads((run_dir / "report" / "diet.json").read_text())
    assert r["format"] == "andrea.diet/1"
    assert set(r["sources"]) == {"py-topics", "py-code", "chat-single", "zh-notes"}
    tok = load(run_dir / "tok" / "tokenizer.json")
    assert r["tokenizer"]["sha256"] == tok.sha256
    for name, d in r["sources"].items():
        assert d["bytes_per_token"] == pytest.approx(d["bytes"] / d["tokens"], rel=1e-5)
        assert 0 <= d["byte_fallback_rate"] <= 1 and 0 <= d["vocab_share_used"] <= 1
        assert (d["vocab_share_used"] > 0) == (name != "zh-notes")
        split_bytes = sum(r["splits"][s][name]["bytes"] for s in ("train", "val") if name in r["splits"][s])
        assert split_bytes == d["bytes"]
    prose = r["sources"]["py-topics"]
    assert prose["bytes_per_token"] > 1.8 and prose["nonascii_fallback_rate"] < 0.05
    assert prose["top_morphemes"] and prose["top_morphemes"][0]["count"] >= prose["top_morphemes"][-1]["count"]
    # random CJK: every character falls back to 3 bytes -> flagged
    zh = r["sources"]["zh-notes"]
    assert zh["served_badly"] and zh["nonascii_fallback_rate"] > 0.9
    assert [w["source"] for w in r["warnings"]] == ["zh-notes"]
    md = (run_dir / "report" / "diet.md").read_text()
    assert "| zh-notes |" in md and "served badly" in md and "Saturation" in md


def test_saturation_curve_is_measured(run_dir):
    sw = json.loads((run_dir / "report" / "diet.json").read_text())["sweep"]
    ns = [p["n"] for p in sw["points"]]
    assert ns == [50, 100, 200, 400]
    bpt = [p["bytes_per_token"] for p in sw["points"]]
    assert bpt == sorted(bpt) and bpt[-1] > bpt[0]           # more morphemes compress more
    assert sw["eval_split"] == "val" and sw["sample_eval_bytes"] > 0
    assert len(sw["steps"]) == 3 and sw["knee_n"] in (None, 100, 200)


def test_rerun_gives_identical_outputs(run_dir, tmp_path):
    before = {p: p.read_bytes() for p in sorted((run_dir / "tokens").rglob("*.bin"))}
    report = (run_dir / "report" / "diet.json").read_bytes()
    assert _diet(run_dir) == 0
    assert {p: p.read_bytes() for p in sorted((run_dir / "tokens").rglob("*.bin"))} == before
    assert (run_dir / "report" / "diet.json").read_bytes() == report


def test_saturation_point():
    pts = [{"n": 128, "bytes_per_token": 2.0}, {"n": 256, "bytes_per_token": 2.4},
           {"n": 512, "bytes_per_token": 2.6}, {"n": 1024, "bytes_per_token": 2.61}]
    sat, steps = saturation(pts, 0.01)
    assert sat == 512 and steps[0]["gain_per_doubling"] == pytest.approx(0.2)
    assert saturation(pts, 0.001)[0] is None
    # a step of two doublings is judged per doubling: 2.0 -> 2.2 over 4x is ~4.9% per doubling
    sat, steps = saturation([{"n": 100, "bytes_per_token": 2.0}, {"n": 400, "bytes_per_token": 2.2}], 0.04)
    assert sat is None and steps[0]["gain_per_doubling"] == pytest.approx(1.1 ** 0.5 - 1, abs=1e-6)


def test_knee():
    def steps(*gains):
        return [{"from": 2 ** i, "to": 2 ** (i + 1), "gain_per_doubling": g} for i, g in enumerate(gains)]

    assert knee(steps(0.11, 0.15, 0.21, 0.20, 0.16, 0.06)) == 8    # after 4 -> 8 every gain shrinks
    assert knee(steps(0.3, 0.2, 0.1)) == 2
    assert knee(steps(0.1, 0.2)) is None and knee(steps(0.1)) is None and knee([]) is None


def test_hash_sample_is_order_free_and_bounded():
    docs = [(f"id{i}", "s", "x" * (10 + i % 7), 10 + i % 7) for i in range(500)]
    a, b = HashSample(400), HashSample(400)
    for d in docs:
        a.offer(*d)
    for d in reversed(docs):
        b.offer(*d)
    assert a.docs() == b.docs()
    assert 400 <= a.n_bytes < 400 + 17


def test_missing_split_and_bad_source(run_dir, tmp_path, capsys):
    import shutil

    import pyarrow as pa

    mc = tmp_path / "mc"
    mc.mkdir()
    shutil.copy(run_dir / "megachat" / "train.parquet", mc / "train.parquet")
    args = ["diet-alignment", "--params", PARAMS, "--profile", "tiny", *SMALL, *SWEEP,
            "--tokenizer", str(run_dir / "tok" / "tokenizer.json"), "--megachat", str(mc),
            "--tokens", str(tmp_path / "tokens"), "--report", str(tmp_path / "rep")]
    assert cli.main(args) == 2
    assert "val split not found" in capsys.readouterr().err
    assert not (tmp_path / "tokens").exists()
    pq.write_table(pa.table({"source": ["ok", "../evil"], "kind": ["prose"] * 2, "doc_id": ["a", "b"],
                             "text": ["hello", "world"]}), mc / "val.parquet")
    assert cli.main(args) == 2
    assert "row 1 source '../evil'" in capsys.readouterr().err
    assert not (tmp_path / "tokens").exists() and not (tmp_path / "rep").exists()
