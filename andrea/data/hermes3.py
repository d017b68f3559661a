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
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import tempfile
from collections import Counter
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
        turns.append({"from": role, "value": value})
    return {"conversations": turns}, None


def _open_text(path: Path):
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def convert_json(src: Path, dst: Path, label: str, budget: int | None) -> _Converter:
    """JSON lines (or one JSON array) in ``src`` -> Parquet ``dst`` in the raw schema."""
    conv = _Converter(dst, budget)
    try:
        with _open_text(src) as f:
            head = f.read(4096).lstrip()
            f.seek(0)
            if head.startswith(b"["):
                try:
                    items = json.loads(f.read().decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError) as e:
                    raise AndreaError(f"{label}: not a valid JSON array: {e}") from None
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
                        item = json.loads(item.decode("utf-8"))
                    except UnicodeDecodeError:
                        conv.skip("invalid_utf8", where)
                        continue
                    except json.JSONDecodeError:
                        conv.skip("invalid_json", where)
                        continue
                row, reason = _coerce(item)
                if row is None:
                    conv.skip(reason, where)
                else:
                    conv.add(row)
    except (OSError, EOFError) as e:
        raise AndreaError(f"{label}: cannot read: {e}") from None
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
    """Every (relative name, path) into ``out``: the manifest's ``files``, ``rows`` and ``skipped`` parts."""
    entries, skipped, examples, total = [], Counter(), {}, 0
    seen: dict[str, str] = {}
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
        else:
            conv = convert_json(path, dst, rel, budget)
            rows = conv.rows
            skipped.update(conv.skipped)
            for k, v in conv.examples.items():
                examples.setdefault(k, v)
        total += rows
        entries.append({"file": name, "sha256": sha256_file(dst), "rows": rows, "bytes": dst.stat().st_size,
                        "origin": rel, "origin_sha256": sha256_file(path)})
    return {"files": entries, "rows": total, "skipped": dict(sorted(skipped.items())),
            "skipped_examples": dict(sorted(examples.items()))}


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
    manifest = convert_files(files, out, h["max_rows"], progress)
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
    manifest = convert_files([(r, root / r) for r in rels], out, h["max_rows"], progress)
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
    manifest = convert_files(files, out, cfg["hermes3"]["max_rows"], progress)
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
        manifest = {"format": MANIFEST_FORMAT, **manifest, "max_rows": cfg["hermes3"]["max_rows"]}
        atomic_write_json(tmp / "MANIFEST.json", manifest)
    skipped = sum(manifest["skipped"].values())
    console.print(f"pull-hermes3: {manifest['rows']} rows in {len(manifest['files'])} files -> {out}"
                  + (f" ({skipped} skipped: {manifest['skipped']})" if skipped else ""))
    return 0
