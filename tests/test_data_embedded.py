"""build-embedded: the committed corpus and the builder.

    pytest tests/test_data_embedded.py            # fast: the committed corpus + a build of a toy stdlib
    pytest tests/test_data_embedded.py -m slow    # rebuild from this Python and compare with the commit

The fast tests check the committed ``data/embedded`` (size, kinds, schemas, hashes, chat
shapes) and build a small fake standard library twice to prove the output is the same
bytes. The slow test rebuilds from the running interpreter; it only runs where the
stdlib inputs and pyarrow match the ones recorded in PROVENANCE.json.
"""

from __future__ import annotations

import hashlib
import json
import platform
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from andrea.data import embedded
from andrea.data.template import conversation_problem, has_system_prompt_shape, n_exchanges
from andrea.errors import AndreaError

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "data" / "embedded"


@pytest.fixture(scope="module")
def prov():
    return json.loads((EMBEDDED / "PROVENANCE.json").read_text())


def test_committed_corpus_is_small_and_has_three_kinds(prov):
    files = sorted(p.name for p in EMBEDDED.iterdir())
    assert files == sorted(["PROVENANCE.json"] + [s["file"] for s in prov["sources"]])
    assert sum(p.stat().st_size for p in EMBEDDED.iterdir()) <= 10 * 1024 * 1024
    assert len(prov["sources"]) >= 6
    assert {s["kind"] for s in prov["sources"]} == {"chat", "prose", "code"}
    assert prov["python"]["version"].count(".") == 2 and "PSF" in prov["license"]
    for s in prov["sources"]:
        data = (EMBEDDED / s["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == s["sha256"] and len(data) == s["bytes"]
        meta = pq.ParquetFile(EMBEDDED / s["file"]).metadata
        assert meta.num_rows == s["rows"] > 0
        assert meta.row_group(0).column(0).compression == "ZSTD"


def test_committed_chat_sources_are_hermes_shaped_with_every_shape(prov):
    shapes = set()
    for s in prov["sources"]:
        table = pq.read_table(EMBEDDED / s["file"])
        if s["kind"] != "chat":
            assert table.schema == embedded.TEXT_SCHEMA
            assert len(set(table.column("doc_id").to_pylist())) == table.num_rows
            continue
        assert table.schema == embedded.CHAT_SCHEMA
        for conv in table.column("conversations").to_pylist():
            assert conversation_problem(conv) is None, conv
            shapes.add((has_system_prompt_shape(conv), n_exchanges(conv) > 1))
    assert shapes == {(False, False), (False, True), (True, False), (True, True)}


def test_committed_corpus_is_big_enough_to_learn_from(prov):
    text = sum(s["text_bytes"] for s in prov["sources"])
    assert text > 5_000_000
    assert all(s["text_bytes"] > 100_000 for s in prov["sources"])


def _toy_stdlib(root: Path) -> Path:
    (root / "pydoc_data").mkdir(parents=True)
    topics = {"assert": "The assert statement\n\n" + "Assert statements are a convenient way. " * 200,
              "pass": "The pass statement\n\npass is a null operation."}
    (root / "pydoc_data" / "topics.py").write_text(f"topics = {topics!r}\n")
    (root / "geometry").mkdir()
    (root / "geometry" / "__init__.py").write_text(textwrap.dedent('''\
        """Shapes and their areas.

        A toy package for the tests."""

        def area(shape, *, unit="m"):
            """Return the area of shape in unit squared."""
            return shape.area

        class Circle(object):
            """A circle of a given radius."""

            def __init__(self, r=1.0):
                """Make a circle."""
                self.r = r

            def scale(self, k, /, exact=True):
                """Scale the radius by k."""
                return Circle(self.r * k)
        '''))
    (root / "_private.py").write_text('"""Private helpers, not part of the API."""\n\ndef helper():\n    """Help."""\n')
    (root / "broken.py").write_text("def (:\n")
    (root / "_sysconfigdata__toy.py").write_text("build_time_vars = {'prefix': '/somewhere'}\n")
    (root / "test").mkdir()
    (root / "test" / "test_geometry.py").write_text('"""Tests are left out."""\n')
    (root / "LICENSE.txt").write_text("A LICENSE\n\nPermission is granted.\n")
    (root / "this.py").write_text('s = """Gur Mra bs Clguba, ol Gvz Crgref\n\nOrnhgvshy vf orggre guna htyl."""\n')
    return root


def test_build_of_a_toy_stdlib_is_deterministic(tmp_path):
    std = _toy_stdlib(tmp_path / "std")
    a = embedded.build(tmp_path / "a", std)
    b = embedded.build(tmp_path / "b", std)
    assert a == b
    for s in a["sources"]:
        assert (tmp_path / "a" / s["file"]).read_bytes() == (tmp_path / "b" / s["file"]).read_bytes()
    assert (tmp_path / "a" / "PROVENANCE.json").read_bytes() == (tmp_path / "b" / "PROVENANCE.json").read_bytes()
    assert a["skipped_unparseable"] == ["broken.py"]
    assert a["python"]["version"] == platform.python_version()


def test_toy_build_contents(tmp_path):
    std = _toy_stdlib(tmp_path / "std")
    embedded.build(tmp_path / "out", std)
    read = lambda n: pq.read_table(tmp_path / "out" / f"{n}.parquet").to_pylist()  # noqa: E731
    api = [c for row in read("chat-api") for c in [row["conversations"]]]
    answers = {c[-1]["value"].split("`")[1] for c in api}
    assert answers == {"area(shape, *, unit='m')", "class Circle(object)", "Circle.__init__(r=1.0)",
                       "Circle.scale(k, /, exact=True)"}  # self is dropped; private modules are not asked about
    modules = read("chat-modules")
    assert len(modules) == 1 and n_exchanges(modules[0]["conversations"]) == 3
    topics = read("chat-topics")
    assert max(n_exchanges(r["conversations"]) for r in topics) > 1  # the long topic continues over turns
    code_ids = [r["doc_id"] for r in read("py-code")]
    assert any(i.startswith("code:geometry/__init__.py#") for i in code_ids)
    assert not any("test/" in i or "sysconfigdata" in i or "broken" in i for i in code_ids)
    notes = {r["doc_id"]: r["text"] for r in read("py-notes")}
    assert "Beautiful is better than ugly." in notes["note:this.py#zen"]
    assert "Permission is granted." in notes["note:LICENSE.txt#0"]
    moddocs = [r["text"] for r in read("py-moddocs")]
    assert any(t.startswith("geometry\n========\n\nShapes and their areas.") for t in moddocs)


def test_code_budget_is_respected_breadth_first(tmp_path):
    std = _toy_stdlib(tmp_path / "std")
    for i in range(5):
        (std / f"mod{i}.py").write_text("".join(f"def f{j}():\n    return {j}\n\n" for j in range(400)))
    prov = embedded.build(tmp_path / "out", std, max_code_bytes=12_000)
    code = next(s for s in prov["sources"] if s["name"] == "py-code")
    assert code["text_bytes"] <= 12_000
    ids = pq.read_table(tmp_path / "out" / "py-code.parquet").column("doc_id").to_pylist()
    assert len({i.rsplit("#", 1)[0] for i in ids}) >= 3  # several files before the second chunk of any


def test_split_text_keeps_every_piece_under_the_limit():
    text = "\n\n".join(["para " * 30] * 20 + ["x" * 1000] + ["line\n" * 300])
    pieces = embedded.split_text(text, 400)
    assert all(0 < len(p) <= 400 for p in pieces)
    assert "".join(pieces).replace("\n", "").replace(" ", "") == text.replace("\n", "").replace(" ", "")


def test_not_a_stdlib_is_refused(tmp_path):
    with pytest.raises(AndreaError, match="not a CPython standard library"):
        embedded.build(tmp_path / "out", tmp_path)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_rebuild_from_this_python_matches_the_commit(tmp_path, prov):
    std = embedded.default_stdlib()
    if (platform.python_version() != prov["python"]["version"] or pa.__version__ != prov["writer"]["pyarrow"]
            or embedded.inputs_fingerprint(std) != prov["python"]["stdlib_inputs_sha256"]):
        pytest.skip("this Python/pyarrow is not the one the committed corpus was built with")
    again = embedded.build(tmp_path / "again")
    assert again == prov
    assert (tmp_path / "again" / "PROVENANCE.json").read_bytes() == (EMBEDDED / "PROVENANCE.json").read_bytes()
