"""Merge, filter, dedupe and split every source into megachat: `andrea prep-megachat`.

    andrea prep-megachat -S hermes3.source=embedded --raw data/raw/hermes3/embedded \\
        --embedded data/embedded --out data/megachat/embedded

Reads the raw Hermes-3 Parquet files (``--raw``, as written by pull-hermes3) and the
embedded prose/code sources named in ``megachat.sources``, and writes ``<out>/train.parquet``,
``<out>/val.parquet`` (columns ``COLUMNS``) and ``<out>/prep_report.json``, all in one
atomic folder swap.

* Conversations are checked by shape (``andrea.data.template.conversation_problem``),
  rendered with the one chat template and carved into the ``from: hermes3`` sources by
  shape: ``system_prompt`` (``has_system_prompt_shape``) and ``turns`` (single = one
  answer, multi = more, any); the first matching source wins.
* ``doc_id`` is the first 32 hex digits of sha256(text): exact dedupe keeps the first
  occurrence (hermes3 files in order, then the embedded sources in config order).
* ``split`` is ``val`` when the doc_id, read as a fraction of 2^128, is below
  ``megachat.val_fraction``: a document lands on the same side in every run.
* ``n_turns`` counts the turns of a conversation including a system turn; 0 for prose and code.

Input is read in Arrow batches of ``megachat.batch_rows`` rows and output written in row
groups of the same size, so memory is bounded by a batch (plus 8 bytes per distinct
document for dedupe). Bad input never ends in a traceback: a row that is unusable
(``wrong_type``, ``no_turns``, ``missing_role``, ``unknown_role``, ``empty_turn``, ``bad_order``,
``invalid_utf8``, ``empty_text``, ``too_long`` over ``megachat.max_doc_bytes``, ``too_short`` under
``megachat.min_doc_chars``, ``no_source`` when no configured source takes its shape,
``duplicate``) is dropped and counted by reason with its first file:row in the report; a
0-byte input file is skipped and listed; a file that is not readable Parquet (truncated,
corrupt) or lacks the needed column stops the stage with an error naming the file (and
the row where reading broke). Zero rows kept in all stops the stage with an error naming
the inputs and the drop counts (nothing is written); an input (the hermes3 folder or an
embedded source) that keeps none while others keep some, or an empty split, is a
warning naming it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from andrea.data.template import (conversation_problem, has_system_prompt_shape, n_exchanges,
                                  render_conversation)
from andrea.errors import AndreaError
from andrea.fsutil import atomic_dir, atomic_write_json

REPORT_FORMAT = "andrea.prep_report/1"
SCHEMA = pa.schema([("source", pa.string()), ("kind", pa.string()), ("doc_id", pa.string()), ("text", pa.string()),
                    ("n_turns", pa.int32()), ("has_system_prompt", pa.bool_()), ("split", pa.string())])
COLUMNS = tuple(SCHEMA.names)
SPLITS = ("train", "val")
WRITE_OPTIONS = dict(compression="zstd", compression_level=3, use_dictionary=["source", "kind", "split"],
                     write_statistics=False)
_BIN_TURNS = pa.list_(pa.struct([("from", pa.binary()), ("value", pa.binary())]))


def doc_id_of(text: str) -> str:
    """The stable content hash of a document: 32 hex digits of sha256 over its UTF-8 bytes."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def split_of(doc_id: str, val_fraction: float) -> str:
    """``val`` when the doc_id, as a fraction of 2^128, is below ``val_fraction``; else ``train``."""
    return "val" if int(doc_id, 16) < val_fraction * (1 << 128) else "train"


class SeenSet:
    """Exact-dedupe memory: 64-bit keys, a small Python set merged into a sorted uint64 array."""

    def __init__(self, spill: int = 1 << 18):
        self.recent: set[int] = set()
        self.sorted = np.empty(0, dtype=np.uint64)
        self.spill = spill

    def add(self, key: int) -> bool:
        """Record ``key``; False if it was already there."""
        if key in self.recent:
            return False
        if self.sorted.size:
            i = int(np.searchsorted(self.sorted, np.uint64(key)))
            if i < self.sorted.size and int(self.sorted[i]) == key:
                return False
        self.recent.add(key)
        if len(self.recent) >= self.spill:
            self.sorted = np.union1d(self.sorted, np.fromiter(self.recent, dtype=np.uint64, count=len(self.recent)))
            self.recent.clear()
        return True

    def __len__(self) -> int:
        return len(self.recent) + int(self.sorted.size)


@dataclass
class Counts:
    rows_in: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {"rows_in": self.rows_in, "kept": self.kept, "dropped": dict(sorted(self.dropped.items()))}


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


_BAD_UTF8 = object()


class Prep:
    """The running merge: classifies rows, dedupes, splits and streams them into train/val."""

    def __init__(self, cfg: dict, out: Path):
        m = cfg["megachat"]
        self.val_fraction, self.min_chars = float(m["val_fraction"]), int(m["min_doc_chars"])
        self.max_bytes, self.batch_rows = int(m["max_doc_bytes"]), int(m["batch_rows"])
        self.chat_sources = [s for s in m["sources"] if s["from"] == "hermes3"]
        self.seen = SeenSet()
        self.inputs: dict[str, Counts] = {}
        self.per_source: dict[str, dict] = {
            s["name"]: {"kind": s["kind"], "from": s["from"], "kept": 0, "train": 0, "val": 0, "text_bytes": 0}
            for s in m["sources"]}
        self.examples: dict[str, str] = {}
        self.files: list[dict] = []
        self.buffers: dict[str, list[tuple]] = {s: [] for s in SPLITS}
        self.writers = {s: pq.ParquetWriter(out / f"{s}.parquet", SCHEMA, **WRITE_OPTIONS) for s in SPLITS}

    # -- bookkeeping
    def drop(self, counts: Counts, reason: str, where: str) -> None:
        counts.dropped[reason] += 1
        self.examples.setdefault(reason, where)

    def emit(self, counts: Counts, where: str, source: str, kind: str, text: str, n_turns: int,
             has_sys: bool) -> None:
        size = len(text.encode("utf-8"))
        if size > self.max_bytes:
            return self.drop(counts, "too_long", where)
        if len(text) < self.min_chars:
            return self.drop(counts, "too_short", where)
        doc_id = doc_id_of(text)
        if not self.seen.add(int(doc_id[:16], 16)):
            return self.drop(counts, "duplicate", where)
        split = split_of(doc_id, self.val_fraction)
        counts.kept += 1
        ps = self.per_source[source]
        ps["kept"] += 1
        ps[split] += 1
        ps["text_bytes"] += size
        buf = self.buffers[split]
        buf.append((source, kind, doc_id, text, n_turns, has_sys, split))
        if len(buf) >= self.batch_rows:
            self.flush(split)

    def flush(self, split: str) -> None:
        buf = self.buffers[split]
        if buf:
            cols = list(zip(*buf))
            self.writers[split].write_table(pa.Table.from_arrays(
                [pa.array(c, type=f.type) for c, f in zip(cols, SCHEMA)], schema=SCHEMA), row_group_size=len(buf))
            buf.clear()

    def close(self) -> None:
        for s in SPLITS:
            self.flush(s)
            self.writers[s].close()

    # -- reading
    def batches(self, path: Path, label: str, column: str, counts: Counts) -> Iterator[pa.Array]:
        """The ``column`` of ``path`` in batches; a 0-byte file is skipped, an unreadable one stops the stage."""
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
            yield batch.column(0)
            row += batch.num_rows

    def chat_file(self, path: Path, label: str, counts: Counts, progress) -> None:
        row = 0
        for col in self.batches(path, label, "conversations", counts):
            for conv in _column_pylist(col, _BIN_TURNS):
                self.chat_row(conv, f"{label}:{row}", counts)
                row += 1
            progress(len(col))

    def chat_row(self, conv: Any, where: str, counts: Counts) -> None:
        counts.rows_in += 1
        if conv is _BAD_UTF8:
            return self.drop(counts, "invalid_utf8", where)
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
                    return self.drop(counts, "invalid_utf8", where)
            if total > self.max_bytes:
                return self.drop(counts, "too_long", where)
            conv = turns if turns is not None else conv
        problem = conversation_problem(conv)
        if problem:
            return self.drop(counts, problem, where)
        has_sys = has_system_prompt_shape(conv)
        answers = n_exchanges(conv)
        for s in self.chat_sources:
            want_sys = s.get("system_prompt")
            turns_rule = s.get("turns", "any")
            if want_sys is not None and want_sys != has_sys:
                continue
            if (turns_rule == "single" and answers != 1) or (turns_rule == "multi" and answers < 2):
                continue
            return self.emit(counts, where, s["name"], s["kind"], render_conversation(conv), len(conv), has_sys)
        return self.drop(counts, "no_source", where)

    def text_file(self, path: Path, label: str, source: dict, counts: Counts, progress) -> None:
        row = 0
        for col in self.batches(path, label, "text", counts):
            for text in _column_pylist(col, pa.binary()):
                where = f"{label}:{row}"
                row += 1
                counts.rows_in += 1
                if text is _BAD_UTF8:
                    self.drop(counts, "invalid_utf8", where)
                    continue
                if isinstance(text, (bytes, bytearray)):
                    if len(text) > self.max_bytes:
                        self.drop(counts, "too_long", where)
                        continue
                    try:
                        text = text.decode("utf-8")
                    except UnicodeDecodeError:
                        self.drop(counts, "invalid_utf8", where)
                        continue
                if text is None:
                    self.drop(counts, "empty_text", where)
                elif not isinstance(text, str):
                    self.drop(counts, "wrong_type", where)
                elif not text.strip():
                    self.drop(counts, "empty_text", where)
                else:
                    self.emit(counts, where, source["name"], source["kind"], text, 0, False)
            progress(len(col))

    def report(self, corpus: str, cfg: dict) -> dict:
        total = Counts()
        for c in self.inputs.values():
            total.rows_in += c.rows_in
            total.kept += c.kept
            total.dropped.update(c.dropped)
        return {
            "format": REPORT_FORMAT,
            "corpus": corpus,
            "params": {k: cfg["megachat"][k] for k in ("val_fraction", "min_doc_chars", "max_doc_bytes", "batch_rows")},
            **total.as_dict(),
            "train": sum(s["train"] for s in self.per_source.values()),
            "val": sum(s["val"] for s in self.per_source.values()),
            "distinct_docs": len(self.seen),
            "per_input": {k: v.as_dict() for k, v in self.inputs.items()},
            "per_source": self.per_source,
            "examples": dict(sorted(self.examples.items())),
            "files": self.files,
        }


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


def embedded_files(cfg: dict, embedded: Path) -> list[tuple[dict, Path]]:
    """(source entry, file) for every ``from: embedded`` source, checked against PROVENANCE.json."""
    wanted = [(i, s) for i, s in enumerate(cfg["megachat"]["sources"]) if s["from"] == "embedded"]
    if not wanted:
        return []
    from andrea.data.embedded import read_provenance

    prov = {s["name"]: s for s in read_provenance(embedded)["sources"]}
    out = []
    for i, s in wanted:
        have = prov.get(s["name"])
        if have is None:
            raise AndreaError(f"megachat.sources[{i}].name={s['name']}: not in {embedded / 'PROVENANCE.json'} "
                              f"(has: {', '.join(sorted(prov))})")
        if have["kind"] == "chat" or have["kind"] != s["kind"]:
            raise AndreaError(f"megachat.sources[{i}].kind={s['kind']}: {s['name']} in {embedded} is {have['kind']}"
                              + ("; chat sources come in through pull-hermes3 (from: hermes3)" if have["kind"] == "chat"
                                 else ""))
        out.append((s, embedded / have["file"]))
    return out


def prep(cfg: dict, raw: Path, embedded: Path, out: Path, progress_factory=None) -> dict:
    """The whole stage; returns the report (also written to ``out/prep_report.json``)."""
    sources = cfg["megachat"]["sources"]
    names = [s["name"] for s in sources]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise AndreaError(f"megachat.sources: name {dup[0]} appears twice")
    wants_chat = any(s["from"] == "hermes3" for s in sources)
    chat_paths = raw_files(raw) if wants_chat else []
    text_inputs = embedded_files(cfg, embedded)
    totals = []
    for p in chat_paths + [p for _, p in text_inputs]:
        try:
            totals.append(pq.ParquetFile(p).metadata.num_rows if p.stat().st_size else 0)
        except (pa.ArrowException, OSError):
            totals.append(0)
    with atomic_dir(out) as tmp:
        job = Prep(cfg, tmp)
        try:
            with (progress_factory(sum(totals)) if progress_factory else _null_progress()) as advance:
                if chat_paths:
                    counts = job.inputs.setdefault("hermes3", Counts())
                    for p in chat_paths:
                        job.chat_file(p, f"{raw.name}/{p.name}", counts, advance)
                for s, p in text_inputs:
                    counts = job.inputs.setdefault(s["name"], Counts())
                    job.text_file(p, f"{embedded.name}/{p.name}", s, counts, advance)
        finally:
            job.close()
        report = job.report(cfg["hermes3"]["source"], cfg)
        if not report["kept"]:
            inputs = ([str(raw)] if chat_paths else []) + [str(p) for _, p in text_inputs]
            raise AndreaError(f"no usable rows: {report['rows_in']} rows read from {', '.join(inputs) or 'no input'}, "
                              f"none kept (dropped: {_drops(report['dropped'], report['examples'])}); "
                              "nothing was written")
        atomic_write_json(tmp / "prep_report.json", report)
    return report


def _drops(dropped: dict, examples: dict) -> str:
    return ", ".join(f"{k} {n}, first at {examples.get(k, '?')}" for k, n in dropped.items()) or "none"


def warnings_of(report: dict, raw: Path, embedded: Path) -> list[str]:
    """One line per input that kept no rows and per empty split, for a stage that still succeeded."""
    out = []
    for name, c in report["per_input"].items():
        if not c["kept"]:
            where = raw if name == "hermes3" else embedded
            out.append(f"input {name} ({where}) kept 0 of {c['rows_in']} rows "
                       f"(dropped: {_drops(c['dropped'], report['examples'])})")
    for split in SPLITS:
        if not report[split]:
            out.append(f"the {split} split is empty ({report['kept']} rows kept, "
                       f"megachat.val_fraction={report['params']['val_fraction']})")
    return out


class _null_progress:
    def __enter__(self):
        return lambda n: None

    def __exit__(self, *exc):
        return False


def _rich_progress(total: int):
    import contextlib

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    @contextlib.contextmanager
    def cm():
        with Progress(TextColumn("prep-megachat"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("rows", total=total)
            yield lambda n: bar.advance(task, n)

    return cm()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--raw", required=True, help="pull-hermes3 output folder, e.g. data/raw/hermes3/<corpus>")
    p.add_argument("--embedded", default="data/embedded", help="embedded corpus folder (default: %(default)s)")
    p.add_argument("--out", required=True, help="output folder, e.g. data/megachat/<corpus> (replaced atomically)")


def run(args: argparse.Namespace, cfg: dict) -> int:
    from rich.console import Console

    report = prep(cfg, Path(args.raw), Path(args.embedded), Path(args.out), _rich_progress)
    console = Console(stderr=True)
    for w in warnings_of(report, Path(args.raw), Path(args.embedded)):
        console.print(f"prep-megachat: warning: {w}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"prep-megachat: {report['rows_in']} rows in, {report['kept']} kept "
                  f"(train {report['train']}, val {report['val']}), dropped {report['dropped']} -> {args.out}")
    return 0
