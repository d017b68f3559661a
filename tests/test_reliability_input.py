"""Hostile input to the data stages, as real files: each class ends in a counted drop or one clear line.

    pytest tests/test_reliability_input.py

Every file is generated here, small. ``andrea pull-hermes3 -S hermes3.source=local`` and
``andrea prep-megachat`` run through the CLI's entry point (its exit codes and its stderr),
so a traceback fails the test. Per class (the decision is in andrea/data/hermes3.py):

* a row-level fault (lone surrogate escape, JSON nested past the parser's depth, bad JSON)
  drops that line, counted by reason with its file:line;
* an integer literal of thousands of digits is valid JSON: outside the turns it is kept;
* a UTF-8 byte order mark is not part of row 1;
* a corrupt .gz (bytes flipped, not truncated) or an unparseable JSON array file stops the
  stage (exit 2) naming the file; nothing is written and a previous output survives;
* empty, whitespace-only or all-bad input stops the stage (exit 2) naming the folder and
  each file's reason; one empty file among good ones is a warning naming it.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from andrea.cli import main as cli_main
from andrea.data.hermes3 import RAW_SCHEMA

ROOT = Path(__file__).resolve().parents[1]
GOOD = {"conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "Four."}]}
GOOD_LINE = json.dumps(GOOD).encode() + b"\n"


def pull(tmp_path: Path, files: dict[str, bytes], capsys, out: Path | None = None):
    """Write ``files`` into a fresh local_dir, run pull-hermes3 on it: (exit code, stderr lines, manifest)."""
    src = tmp_path / "src"
    src.mkdir()
    for name, data in files.items():
        (src / name).write_bytes(data)
    out = out or tmp_path / "out"
    rc = cli_main(["pull-hermes3", "--params", str(ROOT / "params.yaml"), "-S", "hermes3.source=local",
                   "-S", f"hermes3.local_dir={src}", "--out", str(out)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert not any("Traceback" in line for line in err), err
    manifest = json.loads((out / "MANIFEST.json").read_text()) if rc == 0 else None
    return rc, err, manifest


def _one_error_line(err: list[str], *words: str) -> str:
    assert len(err) == 1, err
    for w in words:
        assert w in err[0], err[0]
    return err[0]


def test_lone_surrogate_escape_is_a_counted_drop(tmp_path, capsys):
    bad = b'{"conversations": [{"from": "human", "value": "a\\ud800b"}, {"from": "gpt", "value": "x"}]}\n'
    rc, err, m = pull(tmp_path, {"x.jsonl": GOOD_LINE + bad + GOOD_LINE}, capsys)
    assert rc == 0, err
    assert m["rows"] == 2 and m["skipped"] == {"lone_surrogate": 1}
    assert m["skipped_examples"] == {"lone_surrogate": "x.jsonl:2"}
    # a proper surrogate pair is one character and is kept
    pair = b'{"conversations": [{"from": "human", "value": "\\ud83d\\ude00"}, {"from": "gpt", "value": "ok"}]}\n'
    (tmp_path / "pair").mkdir()
    rc, err, m = pull(tmp_path / "pair", {"x.jsonl": pair}, capsys)
    assert rc == 0 and m["rows"] == 1 and m["skipped"] == {}


def test_lone_surrogate_in_a_json_array_file(tmp_path, capsys):
    arr = json.dumps([GOOD, {"conversations": [{"from": "human", "value": "\ud800"}]}]).encode()
    rc, err, m = pull(tmp_path, {"x.json": arr}, capsys)
    assert rc == 0, err
    assert m["rows"] == 1 and m["skipped"] == {"lone_surrogate": 1} and m["skipped_examples"]["lone_surrogate"] == "x.json:2"


def test_huge_integer_literal(tmp_path, capsys):
    digits = b"9" * 5000                                   # past Python's 4300-digit int conversion limit
    outside = b'{"id": ' + digits + b', "conversations": ' + json.dumps(GOOD["conversations"]).encode() + b"}\n"
    inside = b'{"conversations": [{"from": "human", "value": ' + digits + b"}]}\n"
    rc, err, m = pull(tmp_path, {"x.jsonl": outside + inside}, capsys)
    assert rc == 0, err
    assert m["rows"] == 1 and m["skipped"] == {"wrong_type": 1} and m["skipped_examples"]["wrong_type"] == "x.jsonl:2"
    rows = pq.read_table(tmp_path / "out" / "x.parquet").to_pylist()
    assert rows == [{"conversations": GOOD["conversations"]}]


def test_deeply_nested_json(tmp_path, capsys):
    deep = b'{"conversations": [], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
    rc, err, m = pull(tmp_path, {"x.jsonl": GOOD_LINE + deep}, capsys)
    assert rc == 0, err
    assert m["rows"] == 1 and m["skipped"] == {"too_deeply_nested": 1}
    assert m["skipped_examples"]["too_deeply_nested"] == "x.jsonl:2"


def test_deeply_nested_json_array_file_is_an_error_naming_it(tmp_path, capsys):
    rc, err, _ = pull(tmp_path, {"a.jsonl": GOOD_LINE, "b.json": b"[" * 100_000 + b"]" * 100_000}, capsys)
    # b.json is not read at all: .json only counts when there is no .jsonl; so give it alone
    assert rc == 0
    (tmp_path / "alone").mkdir()
    rc, err, _ = pull(tmp_path / "alone", {"b.json": b"[" * 100_000 + b"]" * 100_000}, capsys)
    assert rc == 2
    _one_error_line(err, "b.json", "nested too deeply", "hermes3.local_dir=")
    assert not (tmp_path / "alone" / "out").exists()


def test_corrupt_gzip_is_an_error_naming_the_file_and_keeps_previous_output(tmp_path, capsys):
    data = bytearray(gzip.compress(GOOD_LINE * 3000, mtime=0))
    full = len(data)
    for i in range(len(data) // 3, len(data) - 16, 101):   # flip bytes in the deflate stream; length unchanged
        data[i] ^= 0x5A
    assert len(data) == full
    out = tmp_path / "out"
    out.mkdir()
    (out / "MANIFEST.json").write_text("previous")
    rc, err, _ = pull(tmp_path, {"x.jsonl.gz": bytes(data)}, capsys, out=out)
    assert rc == 2
    _one_error_line(err, "x.jsonl.gz", "corrupt", "hermes3.local_dir=")
    assert (out / "MANIFEST.json").read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]     # no temp folder left


def test_truncated_gzip_is_an_error_naming_the_file(tmp_path, capsys):
    data = gzip.compress(GOOD_LINE * 3000, mtime=0)
    rc, err, _ = pull(tmp_path, {"x.jsonl.gz": data[: len(data) // 2]}, capsys)
    assert rc == 2
    _one_error_line(err, "x.jsonl.gz", "truncated")


def test_utf8_bom_does_not_spoil_row_one(tmp_path, capsys):
    rc, err, m = pull(tmp_path, {"x.jsonl": b"\xef\xbb\xbf" + GOOD_LINE * 2,
                                 "y.jsonl.gz": gzip.compress(b"\xef\xbb\xbf" + GOOD_LINE, mtime=0)}, capsys)
    assert rc == 0, err
    assert m["rows"] == 3 and m["skipped"] == {}
    (tmp_path / "arr").mkdir()
    rc, err, m = pull(tmp_path / "arr", {"x.json": b"\xef\xbb\xbf" + json.dumps([GOOD, GOOD]).encode()}, capsys)
    assert rc == 0 and m["rows"] == 2 and m["skipped"] == {}


@pytest.mark.parametrize("name,data,why", [
    ("empty", b"", "no JSON rows"),
    ("blank", b"  \n\n\t \n", "no JSON rows"),
    ("allbad", b"not json\n{\n[1, 2]\n", "3 line(s), none usable (invalid_json 2, first at x.jsonl:1, no_conversations 1"),
])
def test_zero_usable_rows_is_an_error_naming_the_input(tmp_path, capsys, name, data, why):
    rc, err, _ = pull(tmp_path, {"x.jsonl": data}, capsys)
    assert rc == 2
    _one_error_line(err, "no usable rows", f"hermes3.local_dir={tmp_path / 'src'}", "x.jsonl", why)
    assert not (tmp_path / "out").exists()


def test_zero_row_parquet_alone_is_an_error(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(pa.Table.from_pylist([], schema=RAW_SCHEMA), src / "x.parquet")
    rc = cli_main(["pull-hermes3", "--params", str(ROOT / "params.yaml"), "-S", "hermes3.source=local",
                   "-S", f"hermes3.local_dir={src}", "--out", str(tmp_path / "out")])
    assert rc == 2
    _one_error_line([l for l in capsys.readouterr().err.splitlines() if l.strip()], "x.parquet", "0 rows")


def test_one_empty_file_among_good_ones_is_a_warning_naming_it(tmp_path, capsys):
    rc, err, m = pull(tmp_path, {"a.jsonl": GOOD_LINE, "b.jsonl": b"\n"}, capsys)
    assert rc == 0 and m["rows"] == 1
    warn = [line for line in err if "warning" in line]
    assert len(warn) == 1 and "b.jsonl" in warn[0] and "no rows" in warn[0], err
    assert "warnings" not in m                                   # the manifest holds no console text


# ----------------------------------------------------------------- prep-megachat
def _raw(folder: Path, rows: list) -> Path:
    folder.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{"conversations": c} for c in rows], schema=RAW_SCHEMA), folder / "a.parquet")
    return folder


def _prep(tmp_path: Path, raw: Path, *sets: str) -> int:
    return cli_main(["prep-megachat", "--params", str(ROOT / "params.yaml"), "-S", "hermes3.source=embedded",
                     *[a for s in sets for a in ("-S", s)], "--raw", str(raw),
                     "--embedded", str(ROOT / "data" / "embedded"), "--out", str(tmp_path / "mc")])


CHAT_ONLY = ('megachat.sources=[{"name": "chat-any", "kind": "chat", "from": "hermes3", "turns": "any"}]',)


def test_megachat_with_zero_usable_rows_fails_naming_the_input(tmp_path, capsys):
    raw = _raw(tmp_path / "raw", [[{"from": "gpt", "value": "answer first"}], [], None])
    rc = _prep(tmp_path, raw, *CHAT_ONLY)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2
    _one_error_line(err, "no usable rows", str(raw), "3 rows read", "bad_order 1, first at raw/a.parquet:0")
    assert not (tmp_path / "mc").exists()


def test_megachat_input_that_keeps_nothing_is_a_warning(tmp_path, capsys):
    raw = _raw(tmp_path / "raw", [[{"from": "gpt", "value": "answer first"}]])
    sets = ('megachat.sources=[{"name": "chat-any", "kind": "chat", "from": "hermes3", "turns": "any"}, '
            '{"name": "py-topics", "kind": "prose", "from": "embedded"}]',)
    assert _prep(tmp_path, raw, *sets) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    warn = [line for line in err.splitlines() if "warning" in line]
    assert any("input hermes3" in w and str(raw) in w and "kept 0 of 1" in w for w in warn), err
