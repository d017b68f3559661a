"""Build the embedded corpus from text that ships with this CPython: `andrea build-embedded`.

    andrea build-embedded --out data/embedded

(Over 500 lines on purpose: one small reader per kind of CPython text, its rendering into the
eight sources and the provenance, read top to bottom as one recipe of the committed corpus.)

Everything comes from the running interpreter's standard library, read as files and
parsed with ``ast`` (nothing is imported, so no module runs): the documentation topics
of ``pydoc_data.topics``, module / class / function docstrings, the source code, the
license and the other text files that ship beside it. Out come one zstd Parquet file
per source plus ``PROVENANCE.json`` (Python version, license, how it was made, and per
source rows, bytes and sha256). Kinds and schemas:

    chat   conversations: list<struct<from: string, value: string>>   (Hermes-3 schema)
    prose  doc_id: string, text: string
    code   doc_id: string, text: string

Chat sources are question/answer dialogues made from the docs (with and without a
system prompt, single- and multi-turn); pull-hermes3 takes them as the ``embedded``
corpus and prep-megachat carves them by shape. The build is deterministic: files are
walked in sorted order, every choice is a hash of a name, the Parquet writer options are
fixed and nothing records a time, so the same Python (and pyarrow) gives the same bytes.
"""

from __future__ import annotations

import argparse
import ast
import codecs
import hashlib
import html.parser
import io
import json
import platform
import sysconfig
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from andrea.errors import AndreaError
from andrea.fsutil import atomic_dir, atomic_write_json, sha256_file

FORMAT = "andrea.embedded/1"
CHAT_SCHEMA = pa.schema([("conversations", pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())])))])
TEXT_SCHEMA = pa.schema([("doc_id", pa.string()), ("text", pa.string())])
PARQUET_OPTIONS = dict(compression="zstd", compression_level=19, use_dictionary=False, write_statistics=False,
                       row_group_size=2048, data_page_size=1 << 20, version="2.6")
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "turtledemo"}
MAX_DOC_CHARS = 4000          # prose/code documents are cut at paragraph / statement boundaries below this
MAX_ANSWER_CHARS = 2400       # one assistant answer in a chat source
DEFAULT_MAX_CODE_BYTES = 6_000_000
LICENSE_NOTE = ("Python Software Foundation License Version 2 (PSF-2.0); the full text, LICENSE.txt of this "
                "Python, is a document of the py-notes source.")

SYSTEM_PROMPTS = (
    "You are a helpful assistant who knows the Python standard library well.",
    "You are a concise Python tutor. Answer with the documented behaviour.",
    "You answer questions about Python 3 using its reference documentation.",
    "You are an expert Python programmer. Explain clearly and accurately.",
)
API_QUESTIONS = (
    "What does `{q}` do?",
    "Explain {q} in Python.",
    "How do I use {q}?",
    "What is {q} for, and how is it called?",
    "Describe {q} from the standard library.",
    "Can you document {q} for me?",
)
MODULE_QUESTIONS = ("What is the `{m}` module for?", "What does the {m} module do?", "Tell me about the Python module {m}.")
MEMBER_QUESTIONS = ("Which functions and classes does it provide?", "What is in it?", "What can I use from it?")
DETAIL_QUESTIONS = ("Tell me more about `{q}`.", "How does {q} work?", "And {q}?")
TOPIC_QUESTIONS = ("Explain the Python topic \"{t}\".", "What does the language reference say about {t}?",
                   "Tell me about {t} in Python.")
CONTINUE_QUESTIONS = ("Go on.", "Please continue.", "And then?", "What else?")

DESCRIPTIONS = {
    "chat-topics": "dialogues on the language reference topics (pydoc_data.topics): system prompt on half, "
                   "long topics continue over several turns",
    "chat-api": "single-turn questions on public functions, classes and methods, answered with signature and "
                "docstring; a system prompt on a third",
    "chat-modules": "multi-turn module tours: purpose, the members, then one member in detail; system prompt on half",
    "py-topics": "the language reference topics of pydoc_data.topics, one document per topic",
    "py-moddocs": "module docstrings, one document per module",
    "py-apidocs": "pydoc-style API text per module: classes, methods and functions with signatures and docstrings",
    "py-notes": "the license, the IDLE notes and help, the other text files of the stdlib, the Zen of Python",
    "py-code": "standard library source code, cut at top-level statement boundaries",
}
KINDS = {"chat-topics": "chat", "chat-api": "chat", "chat-modules": "chat", "py-topics": "prose",
         "py-moddocs": "prose", "py-apidocs": "prose", "py-notes": "prose", "py-code": "code"}


def _h(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")


def _pick(options: tuple[str, ...], key: str) -> str:
    return options[_h(key) % len(options)]


def split_text(text: str, max_chars: int = MAX_DOC_CHARS) -> list[str]:
    """Cut ``text`` into pieces of at most ``max_chars``, at blank lines, else at line ends, else hard."""
    text = text.strip("\n")
    if len(text) <= max_chars:
        return [text] if text.strip() else []
    pieces: list[str] = []
    for para in text.split("\n\n"):
        if len(para) <= max_chars:
            pieces.append(para)
            continue
        line_buf = ""
        for line in para.split("\n"):
            while len(line) > max_chars:
                pieces.append(line[:max_chars])
                line = line[max_chars:]
            if line_buf and len(line_buf) + 1 + len(line) > max_chars:
                pieces.append(line_buf)
                line_buf = line
            else:
                line_buf = f"{line_buf}\n{line}" if line_buf else line
        if line_buf:
            pieces.append(line_buf)
    out, buf = [], ""
    for p in pieces:
        if buf and len(buf) + 2 + len(p) > max_chars:
            out.append(buf)
            buf = p
        else:
            buf = f"{buf}\n\n{p}" if buf else p
    if buf:
        out.append(buf)
    return [o for o in out if o.strip()]


# --------------------------------------------------------------------------- reading the stdlib

@dataclass
class ApiItem:
    qualname: str
    signature: str          # "name(args)" or "class name(bases)"
    doc: str


@dataclass
class Module:
    name: str
    relpath: str
    source: str
    tree: ast.Module | None
    doc: str = ""
    items: list[ApiItem] = field(default_factory=list)

    @property
    def public(self) -> bool:
        return not any(part.startswith("_") and part != "__init__" for part in self.relpath[:-3].split("/"))


def default_stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """Files under ``root`` with one of ``suffixes``, sorted by relative path; test dirs and
    build-specific files (``_sysconfigdata*``, ``config-*``) are left out."""
    out = []
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if any(part in SKIP_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        if p.is_file() and p.name.endswith(suffixes) and not p.name.startswith("_sysconfigdata"):
            out.append(p)
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def _read_source(path: Path) -> str | None:
    raw = path.read_bytes()
    try:
        enc, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
        return raw.decode(enc).replace("\r\n", "\n")
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return None


def _sig(node: ast.FunctionDef | ast.AsyncFunctionDef, drop_self: bool) -> str:
    """``name(args)`` from the AST; for a method the first positional argument (self/cls) is left out."""
    a = node.args
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)
    if drop_self and not static and (a.posonlyargs or a.args):
        posonly = a.posonlyargs[1:] if a.posonlyargs else []
        plain = a.args if a.posonlyargs else a.args[1:]
        remaining = len(posonly) + len(plain)
        defaults = a.defaults[-remaining:] if remaining and a.defaults else []
        a = ast.arguments(posonlyargs=posonly, args=plain, vararg=a.vararg, kwonlyargs=a.kwonlyargs,
                          kw_defaults=a.kw_defaults, kwarg=a.kwarg, defaults=defaults)
    return f"{node.name}({ast.unparse(a)})"


def read_modules(root: Path) -> tuple[list[Module], list[str]]:
    """Every parseable stdlib module with its docstrings; also the relative paths that did not parse."""
    modules, skipped = [], []
    for path in stdlib_files(root, (".py",)):
        rel = path.relative_to(root).as_posix()
        src = _read_source(path)
        tree = None
        if src is not None:
            try:
                tree = ast.parse(src, filename=rel)
            except (SyntaxError, ValueError):
                tree = None
        if tree is None:
            skipped.append(rel)
            continue
        name = rel[:-3].replace("/", ".")
        name = name[: -len(".__init__")] if name.endswith(".__init__") else name
        mod = Module(name, rel, src, tree, ast.get_docstring(tree) or "")
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc:
                    mod.items.append(ApiItem(f"{name}.{node.name}", _sig(node, False), doc))
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = ", ".join(ast.unparse(b) for b in node.bases)
                doc = ast.get_docstring(node)
                if doc:
                    mod.items.append(ApiItem(f"{name}.{node.name}", f"class {node.name}({bases})", doc))
                for sub in node.body:
                    if (isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef))
                            and (not sub.name.startswith("_") or sub.name == "__init__")):
                        sdoc = ast.get_docstring(sub)
                        if sdoc:
                            mod.items.append(ApiItem(f"{name}.{node.name}.{sub.name}",
                                                     f"{node.name}.{_sig(sub, True)}", sdoc))
        modules.append(mod)
    return modules, skipped


def read_topics(root: Path) -> dict[str, str]:
    """``pydoc_data.topics.topics`` read from the file as a literal (the module is not imported)."""
    path = root / "pydoc_data" / "topics.py"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError) as e:
        raise AndreaError(f"{path}: cannot read the pydoc topics: {e}") from None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "topics" for t in node.targets):
            topics = ast.literal_eval(node.value)
            return {k: topics[k] for k in sorted(topics)}
    raise AndreaError(f"{path}: no `topics` dict found")


class _HtmlText(html.parser.HTMLParser):
    """Plain text of an HTML page: block elements become blank lines, scripts and styles are skipped."""

    BLOCKS = {"p", "div", "h1", "h2", "h3", "h4", "h5", "li", "dt", "dd", "pre", "tr", "br", "section", "table"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style", "head"):
            self.skip += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style", "head"):
            self.skip = max(0, self.skip - 1)
        elif tag in self.BLOCKS:
            self.parts.append("\n\n")

    def handle_data(self, data):
        if not self.skip:
            self.parts.append(data)

    def text(self) -> str:
        raw = "".join(self.parts)
        paras = [" ".join(p.split()) for p in raw.split("\n\n")]
        return "\n\n".join(p for p in paras if p)


def _zen(root: Path) -> str | None:
    try:
        tree = ast.parse((root / "this.py").read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "s" for t in node.targets):
            return codecs.decode(ast.literal_eval(node.value), "rot13")
    return None


# --------------------------------------------------------------------------- the sources

def _answer(item: ApiItem) -> str:
    doc = item.doc if len(item.doc) <= MAX_ANSWER_CHARS else split_text(item.doc, MAX_ANSWER_CHARS)[0]
    return f"`{item.signature}`\n\n{doc}"


def _turn(role: str, value: str) -> dict[str, str]:
    return {"from": role, "value": value}


def chat_api(modules: list[Module]) -> list[list[dict]]:
    rows = []
    for mod in modules:
        if not mod.public:
            continue
        for item in mod.items:
            q = item.qualname
            conv = [_turn("human", _pick(API_QUESTIONS, "q:" + q).format(q=q)), _turn("gpt", _answer(item))]
            if _h("sys:" + q) % 3 == 0:
                conv.insert(0, _turn("system", _pick(SYSTEM_PROMPTS, "sp:" + q)))
            rows.append(conv)
    return rows


def chat_modules(modules: list[Module]) -> list[list[dict]]:
    rows = []
    for mod in modules:
        if not (mod.public and mod.doc and len(mod.items) >= 2):
            continue
        m = mod.name
        intro = split_text(mod.doc, MAX_ANSWER_CHARS)[0]
        listing = "\n".join(f"- `{it.signature}`: {it.doc.strip().splitlines()[0]}" for it in mod.items[:24])
        more = f"\n\n...and {len(mod.items) - 24} more." if len(mod.items) > 24 else ""
        detail = mod.items[_h("detail:" + m) % len(mod.items)]
        conv = [
            _turn("human", _pick(MODULE_QUESTIONS, "mq:" + m).format(m=m)), _turn("gpt", intro),
            _turn("human", _pick(MEMBER_QUESTIONS, "lq:" + m)), _turn("gpt", f"The documented members of {m}:\n\n{listing}{more}"),
            _turn("human", _pick(DETAIL_QUESTIONS, "dq:" + m).format(q=detail.qualname)), _turn("gpt", _answer(detail)),
        ]
        if _h("sys:" + m) % 2 == 0:
            conv.insert(0, _turn("system", _pick(SYSTEM_PROMPTS, "sp:" + m)))
        rows.append(conv)
    return rows


def chat_topics(topics: dict[str, str]) -> list[list[dict]]:
    rows = []
    for key, text in topics.items():
        chunks = split_text(text, MAX_ANSWER_CHARS)[:4]
        if not chunks:
            continue
        label = key.replace("-", " ")
        conv = [_turn("human", _pick(TOPIC_QUESTIONS, "tq:" + key).format(t=label)), _turn("gpt", chunks[0])]
        for i, chunk in enumerate(chunks[1:], 1):
            conv += [_turn("human", _pick(CONTINUE_QUESTIONS, f"cq:{key}:{i}")), _turn("gpt", chunk)]
        if _h("sys:" + key) % 2 == 0:
            conv.insert(0, _turn("system", _pick(SYSTEM_PROMPTS, "sp:" + key)))
        rows.append(conv)
    return rows


def prose_topics(topics: dict[str, str]) -> list[tuple[str, str]]:
    return [(f"topic:{k}", t.strip("\n")) for k, t in topics.items() if t.strip()]


def prose_moddocs(modules: list[Module]) -> list[tuple[str, str]]:
    rows = []
    for mod in modules:
        if mod.doc and len(mod.doc) >= 40:
            head = f"{mod.name}\n{'=' * len(mod.name)}\n\n"
            for i, piece in enumerate(split_text(mod.doc)):
                rows.append((f"moddoc:{mod.name}#{i}", head + piece if i == 0 else piece))
    return rows


def prose_apidocs(modules: list[Module]) -> list[tuple[str, str]]:
    rows = []
    for mod in modules:
        if not (mod.public and mod.items):
            continue
        parts = [f"Help on module {mod.name}:"]
        for it in mod.items:
            body = "\n".join(("    " + line) if line else "" for line in it.doc.splitlines())
            parts.append(f"{it.signature}\n{body}")
        for i, piece in enumerate(split_text("\n\n".join(parts))):
            rows.append((f"apidoc:{mod.name}#{i}", piece))
    return rows


def prose_notes(root: Path) -> list[tuple[str, str]]:
    rows = []
    for path in stdlib_files(root, (".txt", ".rst")):
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
        rows += [(f"note:{rel}#{i}", piece) for i, piece in enumerate(split_text(text))]
    help_html = root / "idlelib" / "help.html"
    if help_html.is_file():
        parser = _HtmlText()
        parser.feed(help_html.read_text(encoding="utf-8", errors="replace"))
        rows += [(f"note:idlelib/help.html#{i}", piece) for i, piece in enumerate(split_text(parser.text()))]
    zen = _zen(root)
    if zen:
        rows.append(("note:this.py#zen", "The Zen of Python, by Tim Peters\n\n" + zen.split("\n\n", 1)[-1].strip()))
    return rows


def code_chunks(mod: Module, max_chars: int = MAX_DOC_CHARS) -> list[str]:
    """The module's source cut between top-level statements into pieces of at most ~max_chars."""
    lines = mod.source.splitlines(keepends=True)
    starts = sorted({min([n.lineno] + [d.lineno for d in getattr(n, "decorator_list", [])]) - 1
                     for n in mod.tree.body} | {0})
    segments = ["".join(lines[a:b]) for a, b in zip(starts, starts[1:] + [len(lines)])]
    out, buf = [], ""
    for seg in segments:
        if buf and len(buf) + len(seg) > max_chars:
            out.append(buf)
            buf = ""
        if len(seg) > max_chars:
            out += split_text(seg, max_chars)
            continue
        buf += seg
    if buf.strip():
        out.append(buf)
    return [o.strip("\n") + "\n" for o in out if o.strip()]


def code_rows(modules: list[Module], max_bytes: int) -> list[tuple[str, str]]:
    """Source chunks of every module, round-robin over modules (first chunk of each, then the
    second, ...) until ``max_bytes``: the budget buys breadth before depth."""
    per_mod = [(m, code_chunks(m)) for m in modules]
    rows, total, depth = [], 0, 0
    while True:
        added = False
        for mod, chunks in per_mod:
            if depth < len(chunks):
                piece = chunks[depth]
                size = len(piece.encode("utf-8"))
                if total + size > max_bytes:
                    continue
                rows.append((f"code:{mod.relpath}#{depth}", piece))
                total += size
                added = True
        if not added:
            break
        depth += 1
    rows.sort(key=lambda r: (r[0].rsplit("#", 1)[0], int(r[0].rsplit("#", 1)[1])))
    return rows


# --------------------------------------------------------------------------- writing

def _write(path: Path, table: pa.Table) -> None:
    pq.write_table(table, path, **PARQUET_OPTIONS)


def chat_table(rows: list[list[dict]]) -> pa.Table:
    return pa.Table.from_pylist([{"conversations": c} for c in rows], schema=CHAT_SCHEMA)


def text_table(rows: list[tuple[str, str]]) -> pa.Table:
    return pa.table({"doc_id": [r[0] for r in rows], "text": [r[1] for r in rows]}, schema=TEXT_SCHEMA)


def inputs_fingerprint(root: Path) -> str:
    """sha256 over (relative path, sha256) of every stdlib file the build reads."""
    h = hashlib.sha256()
    for p in stdlib_files(root, (".py", ".txt", ".rst", ".html")):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + bytes.fromhex(sha256_file(p)) + b"\n")
    return h.hexdigest()


def build(out: Path, stdlib: Path | None = None, max_code_bytes: int = DEFAULT_MAX_CODE_BYTES,
          progress=None) -> dict:
    """Build every source into ``out`` (replaced atomically); returns the provenance dict."""
    root = Path(stdlib) if stdlib is not None else default_stdlib()
    if not (root / "pydoc_data" / "topics.py").is_file():
        raise AndreaError(f"{root}: not a CPython standard library (no pydoc_data/topics.py)")
    step = progress or (lambda msg: None)
    step("reading the pydoc topics")
    topics = read_topics(root)
    step("parsing the standard library")
    modules, skipped = read_modules(root)
    step("making the sources")
    sources: dict[str, pa.Table] = {
        "chat-topics": chat_table(chat_topics(topics)),
        "chat-api": chat_table(chat_api(modules)),
        "chat-modules": chat_table(chat_modules(modules)),
        "py-topics": text_table(prose_topics(topics)),
        "py-moddocs": text_table(prose_moddocs(modules)),
        "py-apidocs": text_table(prose_apidocs(modules)),
        "py-notes": text_table(prose_notes(root)),
        "py-code": text_table(code_rows(modules, max_code_bytes)),
    }
    prov = {
        "format": FORMAT,
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                   "stdlib_inputs_sha256": inputs_fingerprint(root)},
        "license": LICENSE_NOTE,
        "made_by": "andrea build-embedded --out data/embedded"
                   + (f" --max-code-bytes {max_code_bytes}" if max_code_bytes != DEFAULT_MAX_CODE_BYTES else ""),
        "how": "stdlib files read in sorted order and parsed with ast (no imports); chats from docstrings and "
               "pydoc topics with question phrasings and system prompts chosen by hashes of names",
        "writer": {"pyarrow": pa.__version__, **{k: v for k, v in PARQUET_OPTIONS.items()}},
        "skipped_unparseable": skipped,
        "sources": [],
    }
    with atomic_dir(out) as tmp:
        for name, table in sources.items():
            step(f"writing {name}")
            if table.num_rows == 0:
                raise AndreaError(f"{root}: source {name} came out empty")
            path = tmp / f"{name}.parquet"
            _write(path, table)
            if KINDS[name] == "chat":
                text_bytes = sum(len(t["value"].encode("utf-8")) for c in table.column("conversations").to_pylist()
                                 for t in c)
            else:
                text_bytes = sum(len(t.encode("utf-8")) for t in table.column("text").to_pylist())
            prov["sources"].append({"name": name, "kind": KINDS[name], "file": path.name, "rows": table.num_rows,
                                    "text_bytes": text_bytes, "bytes": path.stat().st_size,
                                    "sha256": sha256_file(path), "description": DESCRIPTIONS[name]})
        prov["total_bytes"] = sum(s["bytes"] for s in prov["sources"])
        atomic_write_json(tmp / "PROVENANCE.json", prov)
    return prov


def read_provenance(embedded: str | Path) -> dict:
    """PROVENANCE.json of an embedded corpus folder, checked for its format."""
    path = Path(embedded) / "PROVENANCE.json"
    try:
        prov = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AndreaError(f"{path}: not found (build it with `andrea build-embedded --out {embedded}`)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise AndreaError(f"{path}: unreadable: {e}") from None
    if not isinstance(prov, dict) or prov.get("format") != FORMAT or not isinstance(prov.get("sources"), list):
        raise AndreaError(f"{path}: not an {FORMAT} provenance file")
    return prov


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="output folder, e.g. data/embedded (replaced atomically)")
    p.add_argument("--stdlib", default=None, help="standard library folder to read (default: this Python's)")
    p.add_argument("--max-code-bytes", type=int, default=DEFAULT_MAX_CODE_BYTES,
                   help="budget of source code text in py-code (default: %(default)s)")


def run(args: argparse.Namespace, cfg: dict | None) -> int:
    from rich.console import Console

    console = Console(stderr=True)
    if args.max_code_bytes < 1:
        raise AndreaError("--max-code-bytes: must be at least 1")
    with console.status("build-embedded") as status:
        prov = build(Path(args.out), args.stdlib, args.max_code_bytes, progress=lambda m: status.update(m))
    for s in prov["sources"]:
        console.print(f"{s['name']:<14} {s['kind']:<6} rows={s['rows']:>6} text={s['text_bytes']:>9} "
                      f"parquet={s['bytes']:>8}")
    console.print(f"total {prov['total_bytes']} bytes in {args.out} (Python {prov['python']['version']})")
    return 0
