"""The readers of prep-megachat: one per ``megachat.sources[*].from`` value, picked from ``READERS``.

    from andrea.data.sources import READERS   # {"hermes3": Hermes3Chats, "embedded": EmbeddedTexts}

A reader is built from the config entries with its ``from`` value (``(index, entry)`` pairs,
in config order), the CLI's folders (``{"raw": --raw, "embedded": --embedded}``) and the
``megachat`` config; building it checks its files and raises ``AndreaError`` naming the key
or file that is wrong, before anything is read. It then offers:

* ``paths``: the files it will read (for the progress total);
* ``locations``: what it reads, as named in the "no usable rows" error;
* ``inputs(reading)``: ``(input name, items)`` per input of the report's ``per_input``, where
  ``items`` yields one ``(where, Doc or drop reason)`` per input row (``where`` is file:row).

A reader only turns rows into documents or names why a row is unusable; the merge
(``andrea.data.megachat``) counts, filters by length, dedupes, splits and writes. Inputs are
read in ``READERS`` order, so exact dedupe keeps the hermes3 copy of a text also found in an
embedded file. To add a source kind: write a reader with those three members, add it to
``READERS`` and to the ``from`` enum of ``workflow/schemas/params.schema.yaml``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Union

import pyarrow as pa
import pyarrow.parquet as pq

from andrea.data.template import (conversation_problem, has_system_prompt_shape, n_exchanges,
                                  render_conversation)
from andrea.errors import AndreaError

_BIN_TURNS = pa.list_(pa.struct([("from", pa.binary()), ("value", pa.binary())]))
_BAD_UTF8 = object()


class Doc(NamedTuple):
    """One usable document as a reader hands it over: a megachat row less ``doc_id`` and ``split``."""
    source: str
    kind: str
    text: str
    n_turns: int
    has_system_prompt: bool


Item = tuple[str, Union[Doc, str]]       # (file:row, the document or why the row was dropped)


def _decode(x: Any) -> Any:
    """bytes -> str (strict UTF-8; raises UnicodeDecodeError); anything else unchanged."""
    return x.decode("utf-8") if isinstance(x, (bytes, bytearray)) else x


def _column_pylist(col: pa.Array, binary_type: pa.DataType) -> list:
    """The column as Python values, strings as bytes where the type allows (so bad UTF-8 is seen per row)."""
    try:
        col = col.cast(binary_type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        pass                    # no binary view of this type (e.g. a nested column): read it as it is
    try:
        return col.to_pylist()
    except (UnicodeDecodeError, pa.ArrowException):
        out = []
        for i in range(len(col)):
            try:
                out.append(col[i].as_py())
            except (UnicodeDecodeError, pa.ArrowException):
                out.append(_BAD_UTF8)
        return out


class Reading:
    """Reads one column of Parquet files in batches, listing each file for the report's ``files``."""

    def __init__(self, batch_rows: int, progress: Callable[[int], None]):
        self.batch_rows, self.progress = batch_rows, progress
        self.files: list[dict] = []

    def values(self, path: Path, label: str, column: str, binary_type: pa.DataType) -> Iterator[Any]:
        """Each value of ``column`` (see ``_column_pylist``); a 0-byte file is skipped, an unreadable one stops."""
        size = path.stat().st_size
        if size == 0:
            self.files.append({"file": label, "bytes": 0, "rows": 0, "skipped": "empty_file"})
            return
        try:
            pf = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as e:
            raise AndreaError(f"{label}: not a readable Parquet file (truncated or corrupt?): {e}") from None
        names = pf.schema_arrow.names
        if column not in names:
            raise AndreaError(f"{label}: no `{column}` column (columns: {', '.join(names) or 'none'})")
        self.files.append({"file": label, "bytes": size, "rows": pf.metadata.num_rows})
        row = 0
        it = pf.iter_batches(batch_size=self.batch_rows, columns=[column])
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            except (pa.ArrowException, OSError) as e:
                raise AndreaError(f"{label}: unreadable from row {row}: {e}") from None
            yield from _column_pylist(batch.column(0), binary_type)
            self.progress(batch.num_rows)
            row += batch.num_rows


def _numbered(label: str, values: Iterator[Any]) -> Iterator[tuple[str, Any]]:
    return ((f"{label}:{row}", v) for row, v in enumerate(values))


# ----------------------------------------------------------------- from: hermes3
def raw_files(raw: Path) -> list[Path]:
    """The Parquet files of a pull-hermes3 folder; in MANIFEST.json order (checked) when there is one."""
    if not raw.is_dir():
        raise AndreaError(f"{raw}: raw Hermes-3 folder not found (run `andrea pull-hermes3 --out {raw}` first)")
    manifest = raw / "MANIFEST.json"
    found = sorted(p.name for p in raw.glob("*.parquet"))
    if manifest.is_file():
        try:
            entries = json.loads(manifest.read_text(encoding="utf-8"))["files"]
            listed = [(e["file"], int(e["bytes"])) for e in entries]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise AndreaError(f"{manifest}: unreadable manifest: {e}") from None
        for name, size in listed:
            p = raw / name
            if not p.is_file():
                raise AndreaError(f"{p}: listed in MANIFEST.json but missing")
            if p.stat().st_size != size:
                raise AndreaError(f"{p}: {p.stat().st_size} bytes, MANIFEST.json says {size} (truncated or changed?)")
        extra = sorted(set(found) - {n for n, _ in listed})
        if extra:
            raise AndreaError(f"{raw / extra[0]}: not listed in MANIFEST.json")
        return [raw / n for n, _ in listed]
    if not found:
        raise AndreaError(f"{raw}: no *.parquet files (run `andrea pull-hermes3 --out {raw}` first)")
    return [raw / n for n in found]


class Hermes3Chats:
    """Conversations (``conversations: list<struct<from, value>>``) of a pull-hermes3 folder, one input.

    Each is checked by shape (``conversation_problem``), rendered with the one chat template
    and given to the first of its sources whose ``system_prompt`` and ``turns`` take its shape
    (``no_source`` when none does). A conversation whose turn values pass ``max_doc_bytes`` is
    ``too_long`` before it is decoded.
    """

    def __init__(self, entries: list[tuple[int, dict]], folders: dict[str, Path], m: dict):
        self.sources = [s for _, s in entries]
        self.raw, self.max_bytes = folders["raw"], int(m["max_doc_bytes"])
        self.paths = raw_files(self.raw)
        self.locations = [str(self.raw)] if self.paths else []

    def inputs(self, reading: Reading) -> Iterator[tuple[str, Iterator[Item]]]:
        if self.paths:
            yield "hermes3", self.items(reading)

    def items(self, reading: Reading) -> Iterator[Item]:
        for p in self.paths:
            label = f"{self.raw.name}/{p.name}"
            for where, conv in _numbered(label, reading.values(p, label, "conversations", _BIN_TURNS)):
                yield where, self.doc(conv)

    def doc(self, conv: Any) -> Union[Doc, str]:
        if conv is _BAD_UTF8:
            return "invalid_utf8"
        if isinstance(conv, list):
            total = 0
            turns = []
            for t in conv:
                if not isinstance(t, dict):
                    turns = None
                    break
                v = t.get("value")
                total += len(v) if isinstance(v, (bytes, str)) else 0
                try:
                    turns.append({"from": _decode(t.get("from")), "value": _decode(v)})
                except UnicodeDecodeError:
                    return "invalid_utf8"
            if total > self.max_bytes:
                return "too_long"
            conv = turns if turns is not None else conv
        problem = conversation_problem(conv)
        if problem:
            return problem
        has_sys = has_system_prompt_shape(conv)
        answers = n_exchanges(conv)
        for s in self.sources:
            want_sys = s.get("system_prompt")
            turns_rule = s.get("turns", "any")
            if want_sys is not None and want_sys != has_sys:
                continue
            if (turns_rule == "single" and answers != 1) or (turns_rule == "multi" and answers < 2):
                continue
            return Doc(s["name"], s["kind"], render_conversation(conv), len(conv), has_sys)
        return "no_source"


# ----------------------------------------------------------------- from: embedded
class EmbeddedTexts:
    """Prose and code (a ``text`` column) of the embedded corpus, one input per source.

    Each source's file is the one ``PROVENANCE.json`` names for it, with the same kind (chat
    sources come in through pull-hermes3). A row is ``invalid_utf8``, ``empty_text`` (null or
    only whitespace), ``wrong_type`` or, past ``max_doc_bytes``, ``too_long`` before decoding.
    """

    def __init__(self, entries: list[tuple[int, dict]], folders: dict[str, Path], m: dict):
        from andrea.data.embedded import read_provenance

        embedded = self.embedded = folders["embedded"]
        self.max_bytes = int(m["max_doc_bytes"])
        prov = {s["name"]: s for s in read_provenance(embedded)["sources"]}
        self.files: list[tuple[dict, Path]] = []
        for i, s in entries:
            have = prov.get(s["name"])
            if have is None:
                raise AndreaError(f"megachat.sources[{i}].name={s['name']}: not in {embedded / 'PROVENANCE.json'} "
                                  f"(has: {', '.join(sorted(prov))})")
            if have["kind"] == "chat" or have["kind"] != s["kind"]:
                raise AndreaError(f"megachat.sources[{i}].kind={s['kind']}: {s['name']} in {embedded} is "
                                  f"{have['kind']}" + ("; chat sources come in through pull-hermes3 (from: hermes3)"
                                                        if have["kind"] == "chat" else ""))
            self.files.append((s, embedded / have["file"]))
        self.paths = [p for _, p in self.files]
        self.locations = [str(p) for p in self.paths]

    def inputs(self, reading: Reading) -> Iterator[tuple[str, Iterator[Item]]]:
        for s, p in self.files:
            yield s["name"], self.items(reading, s, p)

    def items(self, reading: Reading, s: dict, p: Path) -> Iterator[Item]:
        label = f"{self.embedded.name}/{p.name}"
        for where, text in _numbered(label, reading.values(p, label, "text", pa.binary())):
            yield where, self.doc(s, text)

    def doc(self, s: dict, text: Any) -> Union[Doc, str]:
        if text is _BAD_UTF8:
            return "invalid_utf8"
        if isinstance(text, (bytes, bytearray)):
            if len(text) > self.max_bytes:
                return "too_long"
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError:
                return "invalid_utf8"
        if text is None:
            return "empty_text"
        if not isinstance(text, str):
            return "wrong_type"
        if not text.strip():
            return "empty_text"
        return Doc(s["name"], s["kind"], text, 0, False)


READERS = {"hermes3": Hermes3Chats, "embedded": EmbeddedTexts}
