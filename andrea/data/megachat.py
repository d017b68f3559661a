"""Merge, filter, dedupe and split every source into megachat: `andrea prep-megachat`.

    andrea prep-megachat -S hermes3.source=embedded --raw data/raw/hermes3/embedded \\
        --embedded data/embedded --out data/megachat/embedded

Each entry of ``megachat.sources`` is read by the reader its ``from`` names
(``andrea.data.sources.READERS``: ``hermes3`` reads the Parquet files of ``--raw`` as written
by pull-hermes3, ``embedded`` the prose/code files of ``--embedded``); this module merges what
they hand over and writes ``<out>/train.parquet``, ``<out>/val.parquet`` (columns ``COLUMNS``)
and ``<out>/prep_report.json``, all in one atomic folder swap.

* A reader turns each input row into a document (source, kind, text, n_turns,
  has_system_prompt) or a drop reason; conversations are carved into the ``from: hermes3``
  sources by shape (see ``Hermes3Chats``).
* ``doc_id`` is the first 32 hex digits of sha256(text): exact dedupe keeps the first
  occurrence (readers in ``READERS`` order: hermes3 files in order, then the embedded sources
  in config order).
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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from andrea.data.sources import READERS, Doc, Reading
from andrea.errors import AndreaError
from andrea.fsutil import atomic_dir, atomic_write_json

REPORT_FORMAT = "andrea.prep_report/1"
SCHEMA = pa.schema([("source", pa.string()), ("kind", pa.string()), ("doc_id", pa.string()), ("text", pa.string()),
                    ("n_turns", pa.int32()), ("has_system_prompt", pa.bool_()), ("split", pa.string())])
COLUMNS = tuple(SCHEMA.names)
SPLITS = ("train", "val")
WRITE_OPTIONS = dict(compression="zstd", compression_level=3, use_dictionary=["source", "kind", "split"],
                     write_statistics=False)


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


class Prep:
    """The running merge: filters the readers' documents by length, dedupes, splits, streams them to train/val."""

    def __init__(self, cfg: dict, out: Path):
        m = cfg["megachat"]
        self.val_fraction, self.min_chars = float(m["val_fraction"]), int(m["min_doc_chars"])
        self.max_bytes, self.batch_rows = int(m["max_doc_bytes"]), int(m["batch_rows"])
        self.seen = SeenSet()
        self.inputs: dict[str, Counts] = {}
        self.per_source: dict[str, dict] = {
            s["name"]: {"kind": s["kind"], "from": s["from"], "kept": 0, "train": 0, "val": 0, "text_bytes": 0}
            for s in m["sources"]}
        self.examples: dict[str, str] = {}
        self.buffers: dict[str, list[tuple]] = {s: [] for s in SPLITS}
        self.writers = {s: pq.ParquetWriter(out / f"{s}.parquet", SCHEMA, **WRITE_OPTIONS) for s in SPLITS}

    # -- bookkeeping
    def drop(self, counts: Counts, reason: str, where: str) -> None:
        counts.dropped[reason] += 1
        self.examples.setdefault(reason, where)

    def take(self, counts: Counts, where: str, got: Doc | str) -> None:
        """One input row as its reader saw it: a document to filter, dedupe and split, or a drop reason."""
        counts.rows_in += 1
        if isinstance(got, str):
            return self.drop(counts, got, where)
        source, kind, text, n_turns, has_sys = got
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

    def report(self, corpus: str, cfg: dict, files: list[dict]) -> dict:
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
            "files": files,
        }


def readers(cfg: dict, raw: Path, embedded: Path) -> list:
    """One reader per ``from`` value in the config, in ``READERS`` order, each given its entries."""
    sources = cfg["megachat"]["sources"]
    names = [s["name"] for s in sources]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise AndreaError(f"megachat.sources: name {dup[0]} appears twice")
    for i, s in enumerate(sources):
        if s["from"] not in READERS:
            raise AndreaError(f"megachat.sources[{i}].from={s['from']}: no reader for it "
                              f"(known: {', '.join(READERS)})")
    folders = {"raw": raw, "embedded": embedded}      # the CLI's --raw and --embedded
    out = []
    for kind, reader in READERS.items():
        entries = [(i, s) for i, s in enumerate(sources) if s["from"] == kind]
        if entries:
            out.append(reader(entries, folders, cfg["megachat"]))
    return out


def prep(cfg: dict, raw: Path, embedded: Path, out: Path, progress_factory=None) -> dict:
    """The whole stage; returns the report (also written to ``out/prep_report.json``)."""
    found = readers(cfg, raw, embedded)
    totals = []
    for p in (p for r in found for p in r.paths):
        try:
            totals.append(pq.ParquetFile(p).metadata.num_rows if p.stat().st_size else 0)
        except (pa.ArrowException, OSError):
            totals.append(0)
    with atomic_dir(out) as tmp:
        job = Prep(cfg, tmp)
        try:
            with (progress_factory(sum(totals)) if progress_factory else _null_progress()) as advance:
                reading = Reading(job.batch_rows, advance)
                for r in found:
                    for name, items in r.inputs(reading):
                        counts = job.inputs.setdefault(name, Counts())
                        for where, got in items:
                            job.take(counts, where, got)
        finally:
            job.close()
        report = job.report(cfg["hermes3"]["source"], cfg, reading.files)
        if not report["kept"]:
            inputs = [loc for r in found for loc in r.locations]
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
