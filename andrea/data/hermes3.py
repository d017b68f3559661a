"""Fetch Hermes-3 into Parquet + MANIFEST.json: `andrea pull-hermes3`.

    andrea pull-hermes3 --embedded data/embedded --out data/raw/hermes3/hub           # hermes3.source=hub
    andrea pull-hermes3 -S hermes3.source=local -S hermes3.local_dir=/path/to/jsonl --out data/raw/hermes3/local
    andrea pull-hermes3 -S hermes3.source=embedded --embedded data/embedded --out data/raw/hermes3/embedded

``hermes3.source`` picks where the conversations come from:

* ``hub``: ``hermes3.repo_id`` (a dataset repo) at ``hermes3.revision``, resolved to a
  commit sha, downloaded with huggingface_hub (token from the env var named by
  ``hermes3.token_env``; endpoint from ``HF_ENDPOINT`` as usual). Its ``*.jsonl`` (also
  ``.jsonl.gz``; ``*.json`` only when there is no jsonl) become Parquet; ``*.parquet``
  files are taken as they are.
* ``local``: the same from the folder ``hermes3.local_dir`` (searched recursively).
* ``embedded``: the chat sources of the embedded corpus, copied byte for byte.

Output, one folder written atomically (nothing is left behind on error):
``<out>/*.parquet`` with a ``conversations: list<struct<from: string, value: string>>``
column (the Hermes-3 schema) and ``<out>/MANIFEST.json``: the resolved revision and per
file its sha256, rows and origin. JSON lines that cannot be put in that schema (not
UTF-8, not JSON, no ``conversations`` list, a turn that is not an object, a role or value
that is not a string) are skipped, counted by reason with the first file:line of each;
everything that fits the schema is kept for prep-megachat to judge. Conversion streams
in batches, so memory does not grow with the input. ``hermes3.max_rows`` (0 = all)
caps the rows taken, in file order.

Hostile input, decided per class: a line is one row, so a bad line is dropped and
counted (``invalid_utf8``, ``invalid_json``, ``too_deeply_nested`` for JSON nested past
the parser's depth, ``lone_surrogate`` for a role/value holding a ``\\ud800``-style escape
that is no Unicode character, plus the shape reasons above); an integer literal of any
length outside the turns is kept (it is never used) and one in a turn is ``wrong_type``.
A UTF-8 byte order mark at the start of a file is ignored. A file that cannot be read
to its end (corrupt or truncated ``.gz``, a JSON array that does not parse) stops the
stage with an error naming the file and the line reached. Input that yields zero rows in
all stops the stage with an error listing every file and why it gave none; one file
of several that gives none is a warning naming it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import tempfile
import zlib
from collections import Counter
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from andrea.errors import AndreaError
from andrea.fsutil import atomic_dir, atomic_write_json, sha256_file

MANIFEST_FORMAT = "andrea.hermes3_manifest/1"
TURN_TYPE = pa.struct([("from", pa.string()), ("value", pa.string())])
RAW_SCHEMA = pa.schema([("conversations", pa.list_(TURN_TYPE))])
WRITE_OPTIONS = dict(compression="zstd", compression_level=3, use_dictionary=False, write_statistics=False)
BATCH_ROWS = 8192
ALTERNATIVES = ("hermes3.source=local (a folder of JSONL/Parquet in hermes3.local_dir) or hermes3.source=embedded "
                "(the corpus in data/embedded, no network), e.g. `-S hermes3.source=embedded`")


class _Converter:
    """Streams rows into one Parquet file; counts rows kept and rows skipped by reason."""

    def __init__(self, dst: Path, budget: int | None):
        self.dst, self.budget = dst, budget
        self.writer: pq.ParquetWriter | None = None
        self.buf: list[dict] = []
        self.rows = 0
        self.skipped: Counter[str] = Counter()
        self.examples: dict[str, str] = {}
        self.lines = 0                      # lines (or array items) read

    @property
    def full(self) -> bool:
        return self.budget is not None and self.rows + len(self.buf) >= self.budget

    def skip(self, reason: str, where: str) -> None:
        self.skipped[reason] += 1
        self.examples.setdefault(reason, where)

    def add(self, row: dict) -> None:
        self.buf.append(row)
        if len(self.buf) >= BATCH_ROWS:
            self.flush()

    def flush(self) -> None:
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.dst, RAW_SCHEMA, **WRITE_OPTIONS)
        if self.buf:
            self.writer.write_table(pa.Table.from_pylist(self.buf, schema=RAW_SCHEMA))
            self.rows += len(self.buf)
            self.buf = []

    def close(self) -> None:
        self.flush()
        self.writer.close()


def _json_int(literal: str) -> int | Decimal:
    """An integer literal; past Python's int-conversion digit limit a Decimal (never a str, so never a value)."""
    try:
        return int(literal)
    except ValueError:
        return Decimal(literal)


_DECODER = json.JSONDecoder(parse_int=_json_int)
BOM = b"\xef\xbb\xbf"


def _loads(text: str):
    """json.loads that accepts integers of any length; RecursionError when nested past the parser's depth."""
    return _DECODER.decode(text)


def _is_text(x) -> bool:
    """None or a str that UTF-8 can hold (a lone surrogate from a ``\\ud800`` escape cannot)."""
    if x is None:
        return True
    try:
        x.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _coerce(obj) -> tuple[dict | None, str | None]:
    """A JSON value as a raw row ``{"conversations": [...]}``, or (None, reason) when it cannot be one."""
    if not isinstance(obj, dict) or "conversations" not in obj:
        return None, "no_conversations"
    conv = obj["conversations"]
    if conv is None:
        return {"conversations": None}, None
    if not isinstance(conv, list):
        return None, "wrong_type"
    turns = []
    for t in conv:
        if not isinstance(t, dict):
            return None, "wrong_type"
        role, value = t.get("from"), t.get("value")
        if not (role is None or isinstance(role, str)) or not (value is None or isinstance(value, str)):
            return None, "wrong_type"
        if not (_is_text(role) and _is_text(value)):
            return None, "lone_surrogate"
        turns.append({"from": role, "value": value})
    return {"conversations": turns}, None


def _open_text(path: Path):
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def convert_json(src: Path, dst: Path, label: str, budget: int | None) -> _Converter:
    """JSON lines (or one JSON array) in ``src`` -> Parquet ``dst`` in the raw schema."""
    conv = _Converter(dst, budget)
    lineno = 0
    try:
        with _open_text(src) as f:
            head = f.read(4096)
            f.seek(0)
            if head.startswith(BOM):
                f.read(len(BOM))
                head = head[len(BOM):]
            if head.lstrip().startswith(b"["):
                try:
                    items = _loads(f.read().decode("utf-8"))
                except (UnicodeDecodeError, ValueError) as e:
                    raise AndreaError(f"{label}: not a valid JSON array: {e}") from None
                except RecursionError:
                    raise AndreaError(f"{label}: not a valid JSON array: nested too deeply to parse") from None
                if not isinstance(items, list):
                    raise AndreaError(f"{label}: not a valid JSON array: a JSON {type(items).__name__}")
                lines = ((i, item) for i, item in enumerate(items, 1))
                parsed = True
            else:
                lines = enumerate(f, 1)
                parsed = False
            for lineno, item in lines:
                if conv.full:
                    break
                where = f"{label}:{lineno}"
                if not parsed:
                    if not item.strip():
                        continue
                    try:
                        item = _loads(item.decode("utf-8"))
                    except UnicodeDecodeError:
                        conv.skip("invalid_utf8", where)
                        continue
                    except ValueError:
                        conv.skip("invalid_json", where)
                        continue
                    except RecursionError:
                        conv.skip("too_deeply_nested", where)
                        continue
                row, reason = _coerce(item)
                if row is None:
                    conv.skip(reason, where)
                else:
                    conv.add(row)
    except (OSError, EOFError, zlib.error) as e:
        at = f" after line {lineno}" if lineno else ""
        why = "corrupt or truncated compressed data" if isinstance(e, (EOFError, zlib.error, gzip.BadGzipFile)) \
            else "cannot read"
        raise AndreaError(f"{label}: {why}{at} ({e}); re-download or re-create the file") from None
    conv.lines = lineno
    conv.close()
    return conv


def copy_parquet(src: Path, dst: Path, label: str, budget: int | None) -> int:
    """Take a Parquet file as it is (or its first ``budget`` rows); it must have a ``conversations`` column."""
    try:
        pf = pq.ParquetFile(src)
    except (pa.ArrowException, OSError) as e:
        raise AndreaError(f"{label}: not a readable Parquet file: {e}") from None
    if "conversations" not in pf.schema_arrow.names:
        raise AndreaError(f"{label}: no `conversations` column (columns: {', '.join(pf.schema_arrow.names)})")
    rows = pf.metadata.num_rows
    if budget is None or rows <= budget:
        shutil.copyfile(src, dst)
        return rows
    taken = 0
    schema = pf.schema_arrow
    with pq.ParquetWriter(dst, schema, **WRITE_OPTIONS) as w:
        for batch in pf.iter_batches(batch_size=BATCH_ROWS):
            batch = batch.slice(0, budget - taken)
            w.write_batch(batch)
            taken += batch.num_rows
            if taken >= budget:
                break
    return taken


def _out_name(rel: str) -> str:
    stem = rel
    for ext in (".jsonl.gz", ".json.gz", ".jsonl", ".json", ".parquet"):
        if stem.endswith(ext):
            stem = stem[: -len(ext)]
            break
    return stem.replace("/", "__") + ".parquet"


def data_files(names: list[str]) -> list[str]:
    """Which files of a dataset hold rows: parquet and jsonl; plain .json only when there is neither."""
    names = sorted(names)
    main = [n for n in names if n.endswith((".parquet", ".jsonl", ".jsonl.gz"))]
    return main or [n for n in names if n.endswith((".json", ".json.gz")) and not n.startswith(".")]


def convert_files(files: list[tuple[str, Path]], out: Path, max_rows: int, progress=None) -> dict:
    """Every (relative name, path) into ``out``: the manifest's ``files``, ``rows`` and ``skipped`` parts,
    and ``warnings`` (one line per file that gave no rows; not part of the manifest).

    Zero rows in all is an AndreaError that says, per file, why it gave none."""
    entries, skipped, examples, total = [], Counter(), {}, 0
    seen: dict[str, str] = {}
    empty: list[str] = []                        # why each file that gave no rows gave none
    for rel, path in files:
        budget = None if max_rows == 0 else max_rows - total
        if budget is not None and budget <= 0:
            break
        name = _out_name(rel)
        if name in seen:
            raise AndreaError(f"{rel}: would be written as {name}, as {seen[name]} already is; rename one of them")
        seen[name] = rel
        if progress:
            progress(f"converting {rel}")
        dst = out / name
        if rel.endswith(".parquet"):
            rows = copy_parquet(path, dst, rel, budget)
            if not rows:
                empty.append(f"{rel}: a Parquet file of 0 rows")
        else:
            conv = convert_json(path, dst, rel, budget)
            rows = conv.rows
            skipped.update(conv.skipped)
            for k, v in conv.examples.items():
                examples.setdefault(k, v)
            if not rows:
                bad = sum(conv.skipped.values())
                empty.append(f"{rel}: " + (
                    f"{bad} line(s), none usable ("
                    + ", ".join(f"{k} {n}, first at {conv.examples[k]}" for k, n in sorted(conv.skipped.items())) + ")"
                    if bad else "no JSON rows (empty or only whitespace)"))
        total += rows
        entries.append({"file": name, "sha256": sha256_file(dst), "rows": rows, "bytes": dst.stat().st_size,
                        "origin": rel, "origin_sha256": sha256_file(path)})
    if total == 0:
        raise AndreaError(f"no usable rows in {len(entries)} file(s): " + "; ".join(empty)
                          + ". Fix or replace the input; nothing was written")
    return {"files": entries, "rows": total, "skipped": dict(sorted(skipped.items())),
            "skipped_examples": dict(sorted(examples.items())),
            "warnings": [f"{e}: it gave no rows" for e in empty]}


# --------------------------------------------------------------------------- the three sources

def _hub_error(cfg: dict, e: BaseException) -> AndreaError:
    from huggingface_hub import errors as hfe

    h = cfg["hermes3"]
    repo, rev, tok = h["repo_id"], h["revision"], h["token_env"]
    has_token = bool(os.environ.get(tok))
    if isinstance(e, hfe.GatedRepoError) or (isinstance(e, hfe.HfHubHTTPError) and e.response is not None
                                             and e.response.status_code in (401, 403)):
        why = (f"access to {repo} was refused (gated or private); "
               + (f"the token in ${tok} was not accepted" if has_token else f"no token: ${tok} is not set"))
    elif isinstance(e, hfe.RevisionNotFoundError):
        why = f"revision {rev!r} of {repo} not found (hermes3.revision)"
    elif isinstance(e, hfe.RepositoryNotFoundError):
        why = f"dataset {repo} not found (hermes3.repo_id)" + ("" if has_token else f"; ${tok} is not set")
    elif isinstance(e, hfe.OfflineModeIsEnabled):
        why = "huggingface_hub is in offline mode (HF_HUB_OFFLINE is set)"
    elif isinstance(e, hfe.HfHubHTTPError):
        why = f"the hub answered with an error: {str(e).splitlines()[0]}"
    else:
        from huggingface_hub import constants

        why = f"cannot reach the hub at {constants.ENDPOINT} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return AndreaError(f"hermes3.source=hub: {why}. Alternatives: {ALTERNATIVES}")


def pull_hub(cfg: dict, out: Path, scratch: Path, progress=None) -> dict:
    """Resolve the revision, download the data files, convert them; the manifest dict."""
    h = cfg["hermes3"]
    token = os.environ.get(h["token_env"]) or None
    try:
        from huggingface_hub import HfApi, constants, hf_hub_download

        if progress:
            progress(f"resolving {h['repo_id']}@{h['revision']}")
        info = HfApi(token=token).dataset_info(h["repo_id"], revision=h["revision"])
        sha = info.sha
        names = data_files([s.rfilename for s in (info.siblings or [])])
        if not names:
            raise AndreaError(f"hermes3.source=hub: {h['repo_id']}@{sha} has no .jsonl/.json/.parquet files. "
                              f"Alternatives: {ALTERNATIVES}")
        files = []
        for name in names:
            if progress:
                progress(f"downloading {name}")
            local = hf_hub_download(h["repo_id"], name, repo_type="dataset", revision=sha, token=token,
                                    local_dir=scratch, cache_dir=scratch / ".hf-cache")
            files.append((name, Path(local)))
        endpoint = constants.ENDPOINT
    except AndreaError:
        raise
    except Exception as e:  # every client failure becomes one clear line naming hermes3.source
        raise _hub_error(cfg, e) from None
    try:
        manifest = convert_files(files, out, h["max_rows"], progress)
    except AndreaError as e:
        raise AndreaError(f"hermes3.source=hub ({h['repo_id']}@{sha}): {e}") from None
    return {"source": "hub", "repo_id": h["repo_id"], "requested_revision": h["revision"], "revision": sha,
            "endpoint": endpoint, **manifest}


def pull_local(cfg: dict, out: Path, progress=None) -> dict:
    h = cfg["hermes3"]
    root = Path(h["local_dir"])
    if not root.is_dir():
        raise AndreaError(f"hermes3.source=local: hermes3.local_dir {root} is not a folder. "
                          "Alternatives: hermes3.source=hub or hermes3.source=embedded")
    rels = data_files([p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()])
    if not rels:
        raise AndreaError(f"hermes3.source=local: no .jsonl/.json/.parquet files under {root} (hermes3.local_dir)")
    try:
        manifest = convert_files([(r, root / r) for r in rels], out, h["max_rows"], progress)
    except AndreaError as e:
        raise AndreaError(f"hermes3.source=local (hermes3.local_dir={root}): {e}") from None
    return {"source": "local", "repo_id": h["repo_id"], "requested_revision": None,
            "revision": f"local:{root.as_posix()}", **manifest}


def pull_embedded(cfg: dict, embedded: Path, out: Path, progress=None) -> dict:
    from andrea.data.embedded import read_provenance

    prov = read_provenance(embedded)
    chats = [s for s in prov["sources"] if s.get("kind") == "chat"]
    if not chats:
        raise AndreaError(f"{embedded / 'PROVENANCE.json'}: the embedded corpus has no chat sources")
    files = []
    for s in chats:
        src = embedded / s["file"]
        if not src.is_file():
            raise AndreaError(f"{src}: listed in PROVENANCE.json but missing")
        digest = sha256_file(src)
        if digest != s["sha256"]:
            raise AndreaError(f"{src}: sha256 {digest[:12]}… differs from PROVENANCE.json ({s['sha256'][:12]}…); "
                              f"rebuild with `andrea build-embedded --out {embedded}`")
        files.append((s["file"], src))
    try:
        manifest = convert_files(files, out, cfg["hermes3"]["max_rows"], progress)
    except AndreaError as e:
        raise AndreaError(f"hermes3.source=embedded ({embedded}): {e}") from None
    return {"source": "embedded", "repo_id": None, "requested_revision": None,
            "revision": f"embedded:python-{prov['python']['version']}:{prov['python']['stdlib_inputs_sha256'][:16]}",
            **manifest}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="output folder, e.g. data/raw/hermes3/<corpus> (replaced atomically)")
    p.add_argument("--embedded", default="data/embedded", help="embedded corpus folder (default: %(default)s)")


def run(args: argparse.Namespace, cfg: dict) -> int:
    from rich.console import Console

    console = Console(stderr=True)
    source = cfg["hermes3"]["source"]
    out = Path(args.out)
    with console.status(f"pull-hermes3 ({source})") as status, atomic_dir(out) as tmp:
        step = lambda m: status.update(f"pull-hermes3 ({source}): {m}")  # noqa: E731
        if source == "hub":
            with tempfile.TemporaryDirectory(prefix=".hermes3-dl.", dir=out.parent) as scratch:
                manifest = pull_hub(cfg, tmp, Path(scratch), step)
        elif source == "local":
            manifest = pull_local(cfg, tmp, step)
        else:
            manifest = pull_embedded(cfg, Path(args.embedded), tmp, step)
        warnings = manifest.pop("warnings")
        manifest = {"format": MANIFEST_FORMAT, **manifest, "max_rows": cfg["hermes3"]["max_rows"]}
        atomic_write_json(tmp / "MANIFEST.json", manifest)
    for w in warnings:
        console.print(f"pull-hermes3: warning: {w}", markup=False, highlight=False, soft_wrap=True)
    skipped = sum(manifest["skipped"].values())
    console.print(f"pull-hermes3: {manifest['rows']} rows in {len(manifest['files'])} files -> {out}"
                  + (f" ({skipped} skipped: {manifest['skipped']})" if skipped else ""))
    return 0
