"""pull-hermes3: the hub path against a loopback hub, the local and embedded paths, and its errors.

    pytest tests/test_data_hermes3.py

The hub tests start a threaded ``http.server`` on 127.0.0.1 that serves a tiny dataset
the way the Hugging Face Hub does (``/api/datasets/<repo>/revision/<rev>`` for the repo
info and ``/datasets/<repo>/resolve/<sha>/<file>`` for HEAD + GET of a file, with the
hub's ``X-Repo-Commit`` / ``X-Error-Code`` headers), and run the unchanged ``andrea``
command in a subprocess with ``HF_ENDPOINT`` pointing at it.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import urllib.parse
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from andrea.config import load_config
from andrea.data import hermes3
from andrea.errors import AndreaError

ROOT = Path(__file__).resolve().parents[1]
REPO = "NousResearch/Hermes-3-Dataset"
SHA = "0123456789abcdef0123456789abcdef01234567"
GOOD_ROWS = [
    {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi?"},
                       {"from": "gpt", "value": "Hello."}]},
    {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]},
    {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},
                       {"from": "human", "value": "c"}, {"from": "gpt", "value": "d"}], "category": "x"},
]


def _jsonl(rows) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


class FakeHub(http.server.ThreadingHTTPServer):
    """A dataset repo on loopback. ``mode``: ok | gated (every call 401 GatedRepo)."""

    def __init__(self, files: dict[str, bytes]):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files, self.mode, self.requests = files, "ok", []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, *a):
        pass

    def _error(self, status: int, code: str):
        body = json.dumps({"error": code}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _route(self):
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        self.server.requests.append(f"{self.command} {path}")
        if self.server.mode == "gated":
            return self._error(401, "GatedRepo")
        info_prefix = f"/api/datasets/{REPO}/revision/"
        file_prefix = f"/datasets/{REPO}/resolve/"
        if path.startswith(info_prefix):
            rev = path[len(info_prefix):]
            if rev not in ("main", SHA):
                return self._error(404, "RevisionNotFound")
            body = json.dumps({"_id": "x", "id": REPO, "sha": SHA, "private": False, "gated": False,
                               "siblings": [{"rfilename": n} for n in sorted(self.server.files)]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
            return
        if path.startswith(file_prefix):
            rev, _, name = path[len(file_prefix):].partition("/")
            if rev not in ("main", SHA):
                return self._error(404, "RevisionNotFound")
            if name not in self.server.files:
                return self._error(404, "EntryNotFound")
            data = self.server.files[name]
            self.send_response(200)
            self.send_header("X-Repo-Commit", SHA)
            self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            return
        return self._error(404, "RepoNotFound")

    do_GET = do_HEAD = _route


@pytest.fixture()
def hub():
    files = {"README.md": b"# card\n", "data/part-0.jsonl": _jsonl(GOOD_ROWS[:2]),
             "data/part-1.jsonl": _jsonl(GOOD_ROWS[2:]) + b"not json\n" + b'{"conversations": "text"}\n'}
    server = FakeHub(files)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield server
    server.shutdown()
    server.server_close()


def _pull(tmp_path: Path, endpoint: str, *sets: str, token: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5", NO_PROXY="127.0.0.1", no_proxy="127.0.0.1")
    if token:
        env["HF_TOKEN"] = token
    cmd = [sys.executable, "-m", "andrea", "pull-hermes3", "--params", str(ROOT / "params.yaml"),
           "-S", "hermes3.source=hub", *[a for s in sets for a in ("-S", s)], "--out", str(tmp_path / "out")]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_hub_pull_through_loopback_hub(tmp_path, hub):
    r = _pull(tmp_path, hub.url, "hermes3.revision=main")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"
    manifest = json.loads((out / "MANIFEST.json").read_text())
    assert manifest["revision"] == SHA and manifest["requested_revision"] == "main"
    assert [f["origin"] for f in manifest["files"]] == ["data/part-0.jsonl", "data/part-1.jsonl"]
    assert manifest["rows"] == 3
    assert manifest["skipped"] == {"invalid_json": 1, "wrong_type": 1}
    assert manifest["skipped_examples"]["invalid_json"] == "data/part-1.jsonl:2"
    for f in manifest["files"]:
        assert hashlib.sha256((out / f["file"]).read_bytes()).hexdigest() == f["sha256"]
        assert f["origin_sha256"] == hashlib.sha256(hub.files[f["origin"]]).hexdigest()
    rows = [r for f in manifest["files"] for r in pq.read_table(out / f["file"]).to_pylist()]
    assert rows == [{"conversations": g["conversations"]} for g in GOOD_ROWS]
    assert sorted(p.name for p in out.iterdir()) == ["MANIFEST.json", "data__part-0.parquet", "data__part-1.parquet"]
    assert any(req.startswith("HEAD /datasets/") for req in hub.requests), hub.requests  # the real client path
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no scratch left


def _assert_clean_failure(r, tmp_path, *words):
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "hermes3.source=hub" in lines[0] and "hermes3.source=local" in lines[0] and "embedded" in lines[0]
    for w in words:
        assert w in lines[0], lines[0]
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_hub_bad_revision_fails_cleanly(tmp_path, hub):
    _assert_clean_failure(_pull(tmp_path, hub.url, "hermes3.revision=v9-missing"), tmp_path, "v9-missing", "not found")


def test_hub_gated_without_token_fails_cleanly(tmp_path, hub):
    hub.mode = "gated"
    _assert_clean_failure(_pull(tmp_path, hub.url), tmp_path, "gated", "$HF_TOKEN is not set")


def test_hub_gated_with_a_rejected_token_says_so(tmp_path, hub):
    hub.mode = "gated"
    _assert_clean_failure(_pull(tmp_path, hub.url, token="hf_wrong"), tmp_path, "token in $HF_TOKEN was not accepted")


def test_hub_unreachable_fails_cleanly(tmp_path):
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _assert_clean_failure(_pull(tmp_path, f"http://127.0.0.1:{port}"), tmp_path, "cannot reach the hub")


def test_failed_pull_keeps_previous_output(tmp_path, hub):
    out = tmp_path / "out"
    out.mkdir()
    (out / "MANIFEST.json").write_text("previous")
    hub.mode = "gated"
    r = _pull(tmp_path, hub.url)
    assert r.returncode == 2
    assert (out / "MANIFEST.json").read_text() == "previous"


def _cfg(**hermes):
    cfg = load_config(ROOT / "params.yaml", None, [f"hermes3.{k}={v}" for k, v in hermes.items()])
    return cfg


def test_local_jsonl_and_parquet_with_max_rows(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.jsonl").write_bytes(_jsonl(GOOD_ROWS) + b"\xff\xfe bad utf8\n\n" + b'{"no": 1}\n')
    pq.write_table(pa.Table.from_pylist([{"conversations": GOOD_ROWS[1]["conversations"]}] * 5,
                                        schema=hermes3.RAW_SCHEMA), src / "sub" / "b.parquet")
    (src / "notes.txt").write_text("ignored")
    out = tmp_path / "out"
    m = hermes3.convert_files([(r, src / r) for r in hermes3.data_files(["a.jsonl", "sub/b.parquet", "notes.txt"])],
                              out if out.mkdir() is None else out, max_rows=0)
    assert m["rows"] == 8 and m["skipped"] == {"invalid_utf8": 1, "no_conversations": 1}
    assert [f["file"] for f in m["files"]] == ["a.parquet", "sub__b.parquet"]
    capped = tmp_path / "capped"
    capped.mkdir()
    m2 = hermes3.convert_files([("a.jsonl", src / "a.jsonl"), ("sub/b.parquet", src / "sub" / "b.parquet")],
                               capped, max_rows=4)
    assert m2["rows"] == 4 and [f["rows"] for f in m2["files"]] == [3, 1]
    assert pq.read_table(capped / "sub__b.parquet").num_rows == 1


def test_local_via_cli(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "x.jsonl").write_bytes(_jsonl(GOOD_ROWS))
    cfg = _cfg(source="local", local_dir=str(src))
    import argparse

    args = argparse.Namespace(out=str(tmp_path / "out"), embedded=str(ROOT / "data" / "embedded"))
    assert hermes3.run(args, cfg) == 0
    manifest = json.loads((tmp_path / "out" / "MANIFEST.json").read_text())
    assert manifest["source"] == "local" and manifest["rows"] == 3


def test_local_missing_folder_names_the_key(tmp_path):
    cfg = _cfg(source="local", local_dir=str(tmp_path / "nowhere"))
    with pytest.raises(AndreaError, match="hermes3.local_dir"):
        hermes3.pull_local(cfg, tmp_path)


def test_parquet_without_conversations_column_is_refused(tmp_path):
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "t.parquet")
    with pytest.raises(AndreaError, match=r"t\.parquet: no `conversations` column"):
        hermes3.copy_parquet(tmp_path / "t.parquet", tmp_path / "o.parquet", "t.parquet", None)


def test_embedded_copies_the_chat_sources_byte_for_byte(tmp_path):
    emb = ROOT / "data" / "embedded"
    cfg = _cfg(source="embedded")
    out = tmp_path / "out"
    out.mkdir()
    m = hermes3.pull_embedded(cfg, emb, out)
    prov = json.loads((emb / "PROVENANCE.json").read_text())
    chats = [s for s in prov["sources"] if s["kind"] == "chat"]
    assert [f["file"] for f in m["files"]] == [s["file"] for s in chats]
    assert [f["sha256"] for f in m["files"]] == [s["sha256"] for s in chats]
    assert m["rows"] == sum(s["rows"] for s in chats) > 1000


def test_embedded_detects_a_changed_file(tmp_path):
    import shutil

    emb = tmp_path / "emb"
    shutil.copytree(ROOT / "data" / "embedded", emb)
    prov = json.loads((emb / "PROVENANCE.json").read_text())
    chat = next(s for s in prov["sources"] if s["kind"] == "chat")
    with open(emb / chat["file"], "ab") as f:
        f.write(b"x")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(AndreaError, match="differs from PROVENANCE.json"):
        hermes3.pull_embedded(_cfg(source="embedded"), emb, out)
