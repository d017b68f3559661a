"""prep-megachat: shape filters, dedupe, split, the report, and every kind of bad input.

    pytest tests/test_data_megachat.py

Each bad input from the issue has its own test: missing and unknown roles, empty turns,
wrong types, invalid UTF-8, a 10 MB single document, an empty file, a truncated Parquet
file. Each is either counted and skipped (with its file:row in the report) or stops the
stage with one line naming the file, never a traceback, and never with output lost.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from andrea.config import load_config
from andrea.data import megachat
from andrea.data.hermes3 import RAW_SCHEMA
from andrea.data.template import render_conversation
from andrea.errors import AndreaError

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "data" / "embedded"
CHAT_SOURCES = [
    {"name": "chat-system", "kind": "chat", "from": "hermes3", "system_prompt": True, "turns": "any"},
    {"name": "chat-single", "kind": "chat", "from": "hermes3", "system_prompt": False, "turns": "single"},
    {"name": "chat-multi", "kind": "chat", "from": "hermes3", "system_prompt": False, "turns": "multi"},
]


def T(role, value):
    return {"from": role, "value": value}


GOOD = [
    [T("system", "You are terse."), T("human", "What is 2+2?"), T("gpt", "Four.")],
    [T("human", "Name a prime number."), T("gpt", "Seven is prime.")],
    [T("human", "Say hi."), T("gpt", "Hi!"), T("human", "Again?"), T("gpt", "Hi again!")],
]


@pytest.fixture(scope="module")
def base_cfg():
    return load_config(ROOT / "params.yaml", None, [])


def chat_cfg(base, **megachat_overrides):
    cfg = copy.deepcopy(base)
    cfg["megachat"]["sources"] = copy.deepcopy(CHAT_SOURCES)
    cfg["megachat"].update(megachat_overrides)
    return cfg


def write_raw(raw: Path, name: str, rows: list, schema=RAW_SCHEMA) -> Path:
    raw.mkdir(parents=True, exist_ok=True)
    path = raw / name
    pq.write_table(pa.Table.from_pylist([{"conversations": c} for c in rows], schema=schema), path)
    return path


def run_prep(cfg, raw, tmp_path, embedded=EMBEDDED):
    out = tmp_path / "out"
    report = megachat.prep(cfg, raw, embedded, out)
    rows = {s: pq.read_table(out / f"{s}.parquet").to_pylist() for s in megachat.SPLITS}
    assert json.loads((out / "prep_report.json").read_text()) == json.loads(json.dumps(report))
    return report, rows["train"] + rows["val"]


def test_good_conversations_are_rendered_and_carved_by_shape(base_cfg, tmp_path):
    write_raw(tmp_path / "raw", "a.parquet", GOOD)
    report, rows = run_prep(chat_cfg(base_cfg), tmp_path / "raw", tmp_path)
    assert report["rows_in"] == 3 and report["kept"] == 3 and report["dropped"] == {}
    by_source = {r["source"]: r for r in rows}
    assert set(by_source) == {"chat-system", "chat-single", "chat-multi"}
    assert by_source["chat-system"]["has_system_prompt"] is True
    assert by_source["chat-system"]["text"] == render_conversation(GOOD[0])
    assert by_source["chat-multi"]["n_turns"] == 4 and by_source["chat-single"]["n_turns"] == 2
    for r in rows:
        assert list(r) == list(megachat.COLUMNS)
        assert r["kind"] == "chat" and r["doc_id"] == megachat.doc_id_of(r["text"])
        assert r["split"] == megachat.split_of(r["doc_id"], base_cfg["megachat"]["val_fraction"])


def test_system_prompt_is_decided_by_structure(base_cfg, tmp_path):
    # a system turn that is only whitespace is an empty turn, and text that *looks* like a prompt is not one
    rows = [[T("system", "   "), T("human", "q?"), T("gpt", "an answer")],
            [T("human", "<|system|> You are a bot"), T("gpt", "fine answer")]]
    write_raw(tmp_path / "raw", "a.parquet", rows)
    report, kept = run_prep(chat_cfg(base_cfg), tmp_path / "raw", tmp_path)
    assert report["dropped"] == {"empty_turn": 1}
    assert [(r["source"], r["has_system_prompt"]) for r in kept] == [("chat-single", False)]


def test_missing_and_unknown_roles(base_cfg, tmp_path):
    rows = [[{"value": "no role"}, T("gpt", "answer")],
            [T("human", "q"), T("bot", "answer")],
            [T(None, "q"), T("gpt", "answer")], GOOD[1]]       # one good row: zero kept in all is an error
    write_raw(tmp_path / "raw", "a.parquet", rows)
    report, kept = run_prep(chat_cfg(base_cfg), tmp_path / "raw", tmp_path)
    assert [r["text"] for r in kept] == [render_conversation(GOOD[1])]
    assert report["dropped"] == {"missing_role": 2, "unknown_role": 1}
    assert report["examples"]["missing_role"] == "raw/a.parquet:0"
    assert report["examples"]["unknown_role"] == "raw/a.parquet:1"


def test_empty_turns_no_turns_and_bad_order(base_cfg, tmp_path):
    rows = [[T("human", ""), T("gpt", "answer")], [T("human", "q"), T("gpt", None)], [], None,
            [T("gpt", "answer first"), T("human", "q")], [T("human", "q"), T("gpt", "a"), T("system", "late")],
            [T("system", "only a system prompt")], GOOD[1]]
    write_raw(tmp_path / "raw", "a.parquet", rows)
    report, kept = run_prep(chat_cfg(base_cfg), tmp_path / "raw", tmp_path)
    assert [r["text"] for r in kept] == [render_conversation(GOOD[1])]
    assert report["dropped"] == {"empty_turn": 2, "no_turns": 2, "bad_order": 3}


def test_wrong_types_per_row_and_per_column(base_cfg, tmp_path):
    raw = tmp_path / "raw"
    int_values = pa.schema([("conversations", pa.list_(pa.struct([("from", pa.string()), ("value", pa.int64())])))])
    write_raw(raw, "a-ints.parquet", [[{"from": "human", "value": 1}, {"from": "gpt", "value": 2}]], int_values)
    pq.write_table(pa.table({"conversations": ['[{"from": "human", "value": "json text"}]', "x"]}),
                   raw / "b-strings.parquet")
    write_raw(raw, "c-good.parquet", GOOD[1:2])
    report, kept = run_prep(chat_cfg(base_cfg), raw, tmp_path)
    assert report["dropped"] == {"wrong_type": 3}
    assert report["examples"]["wrong_type"] == "raw/a-ints.parquet:0"
    assert len(kept) == 1


def test_invalid_utf8_in_binary_and_in_string_columns(base_cfg, tmp_path):
    raw = tmp_path / "raw"
    binary = pa.schema([("conversations", pa.list_(pa.struct([("from", pa.binary()), ("value", pa.binary())])))])
    write_raw(raw, "a-binary.parquet", [[{"from": b"human", "value": b"caf\xe9"}, {"from": b"gpt", "value": b"ok"}],
                                       [{"from": b"human", "value": "café".encode()}, {"from": b"gpt", "value": b"yes"}]],
              binary)
    # a string column whose bytes are not UTF-8 (Arrow does not validate views; Parquet does not on read)
    values = pa.array([b"\xff\xfe bad", b"fine answer"], pa.binary()).view(pa.string())
    structs = pa.StructArray.from_arrays([pa.array(["human", "gpt"]), values], names=["from", "value"])
    conv = pa.ListArray.from_arrays(pa.array([0, 2], pa.int32()), structs)
    pq.write_table(pa.table({"conversations": conv}), raw / "b-string.parquet")
    report, kept = run_prep(chat_cfg(base_cfg), raw, tmp_path)
    assert report["dropped"] == {"invalid_utf8": 2}
    assert [r["text"] for r in kept] == [render_conversation([T("human", "café"), T("gpt", "yes")])]


def test_a_10mb_single_document_is_dropped_as_too_long(base_cfg, tmp_path):
    big = "word " * (2 * 1024 * 1024)  # 10 MiB in one turn
    write_raw(tmp_path / "raw", "a.parquet", [[T("human", "long?"), T("gpt", big)], GOOD[1]])
    report, kept = run_prep(chat_cfg(base_cfg), tmp_path / "raw", tmp_path)
    assert report["dropped"] == {"too_long": 1} and report["examples"]["too_long"] == "raw/a.parquet:0"
    assert len(kept) == 1 and max(len(r["text"]) for r in kept) < 1000


def test_an_empty_file_is_skipped_and_listed(base_cfg, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a-empty.parquet").write_bytes(b"")
    write_raw(raw, "b-zero-rows.parquet", [])
    write_raw(raw, "c.parquet", GOOD)
    report, kept = run_prep(chat_cfg(base_cfg), raw, tmp_path)
    assert len(kept) == 3
    assert report["files"][0] == {"file": "raw/a-empty.parquet", "bytes": 0, "rows": 0, "skipped": "empty_file"}
    assert report["files"][1]["rows"] == 0 and "skipped" not in report["files"][1]


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_a_truncated_parquet_file_stops_with_its_name(base_cfg, tmp_path):
    raw = tmp_path / "raw"
    _truncate(write_raw(raw, "a.parquet", GOOD * 50))
    out = tmp_path / "out"
    out.mkdir()
    (out / "train.parquet").write_bytes(b"previous")
    with pytest.raises(AndreaError, match=r"raw/a\.parquet: not a readable Parquet file"):
        megachat.prep(chat_cfg(base_cfg), raw, EMBEDDED, out)
    assert (out / "train.parquet").read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "raw"]  # no temp folder left behind


def test_a_truncated_file_listed_in_the_manifest_is_caught_by_size(base_cfg, tmp_path):
    raw = tmp_path / "raw"
    path = write_raw(raw, "a.parquet", GOOD)
    (raw / "MANIFEST.json").write_text(json.dumps({"files": [{"file": "a.parquet", "bytes": path.stat().st_size}]}))
    _truncate(path)
    with pytest.raises(AndreaError, match=r"a\.parquet: \d+ bytes, MANIFEST.json says \d+"):
        megachat.prep(chat_cfg(base_cfg), raw, EMBEDDED, tmp_path / "out")


def test_the_cli_reports_bad_input_in_one_line(tmp_path):
    raw = tmp_path / "raw"
    _truncate(write_raw(raw, "a.parquet", GOOD * 50))
    r = subprocess.run([sys.executable, "-m", "andrea", "prep-megachat", "--params", str(ROOT / "params.yaml"),
                        "-S", "hermes3.source=embedded", "--raw", str(raw), "--embedded", str(EMBEDDED),
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "a.parquet" in r.stderr and not (tmp_path / "out").exists()


def test_missing_conversations_column_names_the_file(base_cfg, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    pq.write_table(pa.table({"messages": ["x"]}), raw / "a.parquet")
    with pytest.raises(AndreaError, match=r"raw/a\.parquet: no `conversations` column \(columns: messages\)"):
        megachat.prep(chat_cfg(base_cfg), raw, EMBEDDED, tmp_path / "out")


def test_dedupe_no_source_and_too_short(base_cfg, tmp_path):
    cfg = chat_cfg(base_cfg, min_doc_chars=60)
    cfg["megachat"]["sources"] = cfg["megachat"]["sources"][:2]  # nobody takes multi-turn without a system prompt
    write_raw(tmp_path / "raw", "a.parquet", [GOOD[0], GOOD[0], GOOD[2], [T("human", "q"), T("gpt", "a")]])
    report, kept = run_prep(cfg, tmp_path / "raw", tmp_path)
    assert report["dropped"] == {"duplicate": 1, "no_source": 1, "too_short": 1}
    assert report["examples"]["duplicate"] == "raw/a.parquet:1"
    assert len(kept) == 1


def test_embedded_prose_bad_rows(base_cfg, tmp_path):
    emb = tmp_path / "emb"
    emb.mkdir()
    texts = pa.array([b"a fine paragraph of prose text", b"", None, b"\xff bad", b"a fine paragraph of prose text"],
                     pa.binary())
    pq.write_table(pa.table({"doc_id": [str(i) for i in range(5)], "text": texts}), emb / "notes.parquet")
    (emb / "PROVENANCE.json").write_text(json.dumps({"format": "andrea.embedded/1", "sources": [
        {"name": "notes", "kind": "prose", "file": "notes.parquet"}]}))
    cfg = copy.deepcopy(base_cfg)
    cfg["megachat"]["sources"] = [{"name": "notes", "kind": "prose", "from": "embedded"}]
    report, kept = run_prep(cfg, tmp_path / "unused", tmp_path, embedded=emb)
    assert report["per_input"]["notes"] == {"rows_in": 5, "kept": 1,
                                            "dropped": {"duplicate": 1, "empty_text": 2, "invalid_utf8": 1}}
    assert kept[0]["kind"] == "prose" and kept[0]["n_turns"] == 0 and kept[0]["has_system_prompt"] is False


def test_unknown_embedded_source_names_the_key(base_cfg, tmp_path):
    cfg = copy.deepcopy(base_cfg)
    cfg["megachat"]["sources"] = [{"name": "py-nowhere", "kind": "prose", "from": "embedded"}]
    with pytest.raises(AndreaError, match=r"megachat.sources\[0\].name=py-nowhere"):
        megachat.prep(cfg, tmp_path, EMBEDDED, tmp_path / "out")


def test_split_is_a_pure_function_of_doc_id():
    ids = [megachat.doc_id_of(f"document {i}") for i in range(4000)]
    val = [i for i in ids if megachat.split_of(i, 0.1) == "val"]
    assert 300 < len(val) < 500
    assert all(megachat.split_of(i, 0.2) == "val" for i in val)  # a larger fraction only adds to val


def test_seen_set_spills_to_the_sorted_array():
    s = megachat.SeenSet(spill=4)
    keys = [7, 3, 2**63 + 5, 11, 3, 42, 7, 2**64 - 1]
    assert [s.add(k) for k in keys] == [True, True, True, True, False, True, False, True]
    assert s.sorted.size == 4 and len(s) == 6


def test_embedded_corpus_end_to_end_is_deterministic(base_cfg, tmp_path):
    from andrea.data import hermes3

    cfg = copy.deepcopy(base_cfg)
    cfg["hermes3"]["source"] = "embedded"
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "MANIFEST.json").write_text(json.dumps(hermes3.pull_embedded(cfg, EMBEDDED, raw)))
    a = megachat.prep(cfg, raw, EMBEDDED, tmp_path / "a")
    b = megachat.prep(cfg, raw, EMBEDDED, tmp_path / "b")
    assert a == b
    for name in ("train.parquet", "val.parquet", "prep_report.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    names = {s["name"] for s in cfg["megachat"]["sources"]}
    assert {k for k, v in a["per_source"].items() if v["kept"] > 0} == names
    assert all(v["val"] > 0 for v in a["per_source"].values())
    table = pq.read_table(tmp_path / "a" / "train.parquet")
    assert table.schema == megachat.SCHEMA
    doc_ids = table.column("doc_id").to_pylist() + pq.read_table(tmp_path / "a" / "val.parquet").column("doc_id").to_pylist()
    assert len(doc_ids) == len(set(doc_ids)) == a["kept"] > 5000
