"""The external judge client against a loopback server that speaks the OpenAI chat-completions API.

    pytest tests/test_reports_judge.py
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from andrea.reports.judge import Judge, parse_score

KEY = "sk-test-do-not-leak-1234567890"


class FakeAPI:
    """A /v1/chat/completions server: scores by answer length, records requests, can fail on demand."""

    def __init__(self):
        self.requests: list[dict] = []
        self.fail_next = 0            # answer this many requests with HTTP 503 first
        self.status = 200
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                api.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
                if api.fail_next:
                    api.fail_next -= 1
                    self.send_response(503)
                    self.end_headers()
                    return
                if api.status != 200:
                    self.send_response(api.status)
                    self.end_headers()
                    return
                user = body["messages"][-1]["content"]
                sample = user.split("=== MODEL OUTPUT ===\n", 1)[1].split("\n=== END MODEL OUTPUT ===", 1)[0]
                score = min(10, len(sample.split()))
                reply = {"id": "x", "object": "chat.completion", "model": body["model"],
                         "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": f"SCORE: {score} | {len(sample)} chars"}}]}
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def api():
    a = FakeAPI()
    yield a
    a.close()


def test_scores_sends_key_in_header_only_and_caches(api, tmp_path, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY_T", KEY)
    j = Judge(api.url, "judge-model", "JUDGE_KEY_T", timeout_s=5, retries=1, cache_dir=tmp_path / "cache")
    r = j.score("chat", "What is a list?", "a mutable sequence of items")
    assert r == {"score": 5, "reason": "27 chars", "cached": False}
    req = api.requests[0]
    assert req["path"] == "/v1/chat/completions"
    assert req["auth"] == f"Bearer {KEY}"
    assert req["body"]["model"] == "judge-model" and req["body"]["temperature"] == 0
    assert "RUBRIC (chat)" in req["body"]["messages"][-1]["content"]
    again = j.score("chat", "What is a list?", "a mutable sequence of items")
    assert again["cached"] and again["score"] == 5 and len(api.requests) == 1
    # the key is nowhere on disk and nowhere in what the report may print
    for f in (tmp_path / "cache").rglob("*"):
        if f.is_file():
            assert KEY not in f.read_text()
    assert KEY not in json.dumps(j.describe()) and j.describe()["api_key_present"] is True
    # another sample or another domain is a different cache entry
    j.score("prose", "What is a list?", "a mutable sequence of items")
    assert len(api.requests) == 2


def test_retries_are_bounded_then_succeed(api, tmp_path):
    api.fail_next = 2
    j = Judge(api.url, "m", "NO_SUCH_ENV_VAR_X", timeout_s=5, retries=2, cache_dir=tmp_path, backoff_s=0.01)
    r = j.score("code", "def f(", "x): return 1")
    assert r["score"] == 3 and len(api.requests) == 3
    assert api.requests[-1]["auth"] is None            # no key in the environment: no header at all


def test_persistent_failure_marks_unreachable_and_stops_asking(api, tmp_path):
    api.status = 500
    j = Judge(api.url, "m", "X", timeout_s=5, retries=1, cache_dir=tmp_path, backoff_s=0.01)
    assert j.score("chat", "p", "s") is None
    assert j.status.startswith("unreachable: HTTP 500") and len(api.requests) == 2
    assert j.score("chat", "p", "t") is None and len(api.requests) == 2


def test_client_errors_are_not_retried(api, tmp_path):
    api.status = 401
    j = Judge(api.url, "m", "X", timeout_s=5, retries=3, cache_dir=tmp_path, backoff_s=0.01)
    assert j.score("chat", "p", "s") is None
    assert "HTTP 401" in j.status and len(api.requests) == 1


def test_unreachable_port_and_silent_server_time_out(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()                                             # nothing listens there now
    j = Judge(f"http://127.0.0.1:{port}", "m", "X", timeout_s=2, retries=1, cache_dir=tmp_path, backoff_s=0.01)
    assert j.score("chat", "p", "s") is None and j.status.startswith("unreachable")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)                                      # accepts, never answers
    try:
        j = Judge(f"http://127.0.0.1:{silent.getsockname()[1]}", "m", "X", timeout_s=0.3, retries=1,
                  cache_dir=tmp_path, backoff_s=0.01)
        assert j.score("chat", "p", "s") is None
        assert "timeout 0.3s" in j.status and "2 attempt" in j.status
    finally:
        silent.close()


def test_not_configured_is_off():
    j = Judge("", "", "X")
    assert not j.enabled and j.status.startswith("not configured")
    assert j.score("chat", "p", "s") is None


def test_parse_score():
    assert parse_score("SCORE: 7 | fine") == 7
    assert parse_score("I'd give it 3 out of 10") == 3
    assert parse_score("SCORE: 42") is None
    assert parse_score("no number") is None
