"""The readers of prep-megachat (andrea/data/sources.py): one per `from` value, picked from READERS.

    pytest tests/test_data_sources.py

A reader hands over one (file:row, document or drop reason) per input row; the merge in
andrea/data/megachat.py counts, filters, dedupes and splits. These tests hold the readers
to that contract, show that a source kind added to READERS is merged like the built-in
ones, and keep the schema's `from` enum and READERS in step.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from andrea.config import SCHEMA_RELPATH, load_config
from andrea.data import megachat, sources
from andrea.data.hermes3 import RAW_SCHEMA
from andrea.data.sources import READERS, Doc, EmbeddedTexts, Hermes3Chats, Reading
from andrea.data.template import render_conversation
from andrea.errors import AndreaError

ROOT = Path(__file__).resolve().parents[1]
CHAT_ANY = {"name": "chat-any", "kind": "chat", "from": "hermes3", "turns": "any"}
QA = [{"from": "human", "value": "Name a prime number."}, {"from": "gpt", "value": "Seven is prime."}]
PROSE = "A paragraph of prose that is long enough to keep."


@pytest.fixture(scope="module")
def base_cfg():
    return load_config(ROOT / "params.yaml", None, [])


def cfg_with(base: dict, *entries: dict) -> dict:
    cfg = copy.deepcopy(base)
    cfg["megachat"]["sources"] = [copy.deepcopy(e) for e in entries]
    return cfg


def write_raw(raw: Path, rows: list) -> Path:
    raw.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([{"conversations": c} for c in rows], schema=RAW_SCHEMA), raw / "a.parquet")
    return raw


def write_embedded(emb: Path, texts: list) -> Path:
    emb.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"doc_id": [str(i) for i in range(len(texts))], "text": pa.array(texts, pa.binary())}),
                   emb / "notes.parquet")
    (emb / "PROVENANCE.json").write_text(json.dumps({"format": "andrea.embedded/1", "sources": [
        {"name": "notes", "kind": "prose", "file": "notes.parquet"}]}))
    return emb


def read_all(reader, batch_rows: int = 2) -> tuple[list, list, list]:
    seen: list[int] = []
    reading = Reading(batch_rows, seen.append)
    items = [(name, where, got) for name, its in reader.inputs(reading) for where, got in its]
    return items, seen, reading.files


def test_readers_and_the_schema_agree():
    schema = yaml.safe_load((ROOT / SCHEMA_RELPATH).read_text())
    allowed = schema["properties"]["megachat"]["properties"]["sources"]["items"]["properties"]["from"]["enum"]
    assert sorted(READERS) == sorted(allowed)


def test_hermes3_reader_gives_one_item_per_row(base_cfg, tmp_path):
    raw = write_raw(tmp_path / "raw", [QA, [{"from": "gpt", "value": "answer first"}], None, QA])
    cfg = cfg_with(base_cfg, CHAT_ANY)
    reader = Hermes3Chats([(0, CHAT_ANY)], {"raw": raw, "embedded": tmp_path / "unused"}, cfg["megachat"])
    assert reader.paths == [raw / "a.parquet"] and reader.locations == [str(raw)]
    items, progress, files = read_all(reader)
    doc = Doc("chat-any", "chat", render_conversation(QA), 2, False)
    # the reader does not dedupe: both copies of QA come through, the merge drops the second
    assert items == [("hermes3", "raw/a.parquet:0", doc), ("hermes3", "raw/a.parquet:1", "bad_order"),
                     ("hermes3", "raw/a.parquet:2", "no_turns"), ("hermes3", "raw/a.parquet:3", doc)]
    assert progress == [2, 2]
    assert files == [{"file": "raw/a.parquet", "bytes": (raw / "a.parquet").stat().st_size, "rows": 4}]


def test_embedded_reader_gives_one_input_per_source(base_cfg, tmp_path):
    emb = write_embedded(tmp_path / "emb", [PROSE.encode(), b"  ", b"\xff bad", None])
    entry = {"name": "notes", "kind": "prose", "from": "embedded"}
    reader = EmbeddedTexts([(3, entry)], {"raw": tmp_path / "unused", "embedded": emb}, base_cfg["megachat"])
    assert reader.locations == [str(emb / "notes.parquet")]
    items, progress, _ = read_all(reader, batch_rows=3)
    assert items == [("notes", "emb/notes.parquet:0", Doc("notes", "prose", PROSE, 0, False)),
                     ("notes", "emb/notes.parquet:1", "empty_text"), ("notes", "emb/notes.parquet:2", "invalid_utf8"),
                     ("notes", "emb/notes.parquet:3", "empty_text")]
    assert progress == [3, 1]
    with pytest.raises(AndreaError, match=r"megachat.sources\[3\].kind=code: notes in .* is prose"):
        EmbeddedTexts([(3, dict(entry, kind="code"))], {"embedded": emb}, base_cfg["megachat"])


def test_hermes3_is_read_first_whatever_the_config_order(base_cfg, tmp_path):
    # the embedded text equals the rendered conversation: dedupe keeps the hermes3 copy, as before READERS
    raw = write_raw(tmp_path / "raw", [QA])
    emb = write_embedded(tmp_path / "emb", [render_conversation(QA).encode(), PROSE.encode()])
    cfg = cfg_with(base_cfg, {"name": "notes", "kind": "prose", "from": "embedded"}, CHAT_ANY)
    report = megachat.prep(cfg, raw, emb, tmp_path / "out")
    assert list(report["per_input"]) == ["hermes3", "notes"]
    assert report["per_input"]["notes"]["dropped"] == {"duplicate": 1}
    assert report["examples"]["duplicate"] == "emb/notes.parquet:0"
    assert report["per_source"]["chat-any"]["kept"] == 1 and report["per_source"]["notes"]["kept"] == 1


def test_a_from_value_without_a_reader_names_the_key(base_cfg, tmp_path):
    cfg = cfg_with(base_cfg, CHAT_ANY, {"name": "elsewhere", "kind": "prose", "from": "nowhere"})
    with pytest.raises(AndreaError, match=r"megachat.sources\[1\].from=nowhere: no reader for it "
                                          r"\(known: hermes3, embedded\)"):
        megachat.prep(cfg, write_raw(tmp_path / "raw", [QA]), tmp_path / "emb", tmp_path / "out")
    assert not (tmp_path / "out").exists()


class InlineTexts:
    """A source kind of this test only: texts written in the config entry itself."""

    def __init__(self, entries, folders, m):
        self.entries = [s for _, s in entries]
        self.paths, self.locations = [], [f"megachat.sources[{i}].texts" for i, _ in entries]

    def inputs(self, reading):
        for s in self.entries:
            yield s["name"], ((f"{s['name']}:{row}", Doc(s["name"], s["kind"], t, 0, False) if t else "empty_text")
                              for row, t in enumerate(s["texts"]))


def test_a_reader_added_to_the_dict_is_merged_like_the_others(base_cfg, tmp_path, monkeypatch):
    monkeypatch.setitem(sources.READERS, "inline", InlineTexts)
    raw = write_raw(tmp_path / "raw", [QA])
    inline = {"name": "faq", "kind": "prose", "from": "inline",
              "texts": [PROSE, "", "short", render_conversation(QA), PROSE + " More."]}
    cfg = cfg_with(base_cfg, inline, CHAT_ANY)
    out = tmp_path / "out"
    report = megachat.prep(cfg, raw, tmp_path / "unused", out)
    assert list(report["per_input"]) == ["hermes3", "faq"]           # READERS order: the added kind comes last
    assert report["per_input"]["faq"] == {"rows_in": 5, "kept": 2,
                                          "dropped": {"duplicate": 1, "empty_text": 1, "too_short": 1}}
    assert report["examples"]["too_short"] == "faq:2" and report["per_source"]["faq"]["from"] == "inline"
    rows = [r for s in megachat.SPLITS for r in pq.read_table(out / f"{s}.parquet").to_pylist()]
    assert sorted(r["text"] for r in rows if r["source"] == "faq") == [PROSE, PROSE + " More."]
    assert all(r["doc_id"] == megachat.doc_id_of(r["text"]) for r in rows)

    cfg = cfg_with(base_cfg, dict(inline, texts=["", "tiny"]))
    with pytest.raises(AndreaError, match=r"no usable rows: 2 rows read from megachat.sources\[0\].texts"):
        megachat.prep(cfg, raw, tmp_path / "unused", tmp_path / "out2")
