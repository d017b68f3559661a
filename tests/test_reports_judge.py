"""The external judge client against a loopback server that speaks the OpenAI chat-completions API.

    pytest tests/test_reports_judge.py

The fake server scores a sample by its word count (capped at 10), so every score a test
sees is known exactly. A hostile pair (a judge that redirects to another loopback origin
and records what reaches it; a judge that echoes the Authorization header everywhere in its
answer) checks that the key never leaves the configured origin and never reaches the disk.
"""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from andrea.reports.evaluate import run_judge
from andrea.reports.judge import Judge, parse_score

KEY = "sk-test-do-not-leak-1234567890"


class FakeAPI:
    """A /v1/chat/completions server: scores by answer length, records requests, can fail on demand."""

    def __init__(self):
        self.requests: list[dict] = []
        self.fail_next = 0            # answer this many requests with HTTP 503 first
        self.status = 200
        self.redirect: tuple[int, str] | None = None     # (code, Location) to answer every request with
        self.echo = False             # put the Authorization header into every field of the answer
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):          # where a redirected POST arrives as urllib turns it into a GET
                api.requests.append({"method": "GET", "path": self.path, "auth": self.headers.get("Authorization"),
                                     "body": None})
                self.send_response(404)
                self.end_headers()

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                auth = self.headers.get("Authorization")
                api.requests.append({"method": "POST", "path": self.path, "auth": auth, "body": body})
                if api.redirect:
                    self.send_response(api.redirect[0])
                    self.send_header("Location", api.redirect[1])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
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
                content = f"SCORE: {score} | {len(sample)} chars"
                if api.echo:
                    content += f" (you sent {auth})"
                reply = {"id": auth if api.echo else "x", "object": "chat.completion", "model": body["model"],
                         "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": content,
                                                  **({"refusal": auth, "auth": auth} if api.echo else {})}}],
                         **({"usage": {"key": auth}, "system_fingerprint": auth} if api.echo else {})}
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


def _key_forms(key: str) -> list[str]:
    """The key and what is easily derived from it: what must never be on disk."""
    return [key, key[6:], hashlib.sha256(key.encode()).hexdigest(), base64.b64encode(key.encode()).decode(),
            base64.b64encode(f"Bearer {key}".encode()).decode()]


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_a_redirect_to_another_origin_gets_no_credentials(api, tmp_path, monkeypatch, code):
    other = FakeAPI()                                     # another origin: same host, another port
    try:
        monkeypatch.setenv("JUDGE_KEY_T", KEY)
        api.redirect = (code, other.url.replace("127.0.0.1", "localhost") + "/chat/completions")
        j = Judge(api.url, "m", "JUDGE_KEY_T", timeout_s=5, retries=2, cache_dir=tmp_path / "cache", backoff_s=0.01)
        assert j.score("chat", "p", "two words") is None
        assert api.requests[0]["auth"] == f"Bearer {KEY}"             # the configured origin has it
        assert other.requests == []                                   # the other origin saw nothing at all
        assert len(api.requests) == 1                                 # a redirect is not retried
        assert j.status.startswith(f"unreachable: HTTP {code} from {api.url}/chat/completions (a redirect")
        assert "localhost" not in j.status                            # the Location is not repeated
        assert not (tmp_path / "cache").exists()
    finally:
        other.close()


def test_a_judge_that_echoes_the_key_gets_nothing_of_it_on_disk(api, tmp_path, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY_T", KEY)
    api.echo = True
    cache = tmp_path / "cache"
    j = Judge(api.url, "judge-model", "JUDGE_KEY_T", timeout_s=5, retries=0, cache_dir=cache)
    r = j.score("prose", "Once upon", "a time there were three bears")
    assert r["score"] == 6 and KEY not in r["reason"] and r["reason"].startswith("29 chars")
    files = [f for f in cache.rglob("*") if f.is_file()]
    assert len(files) == 1
    entry = json.loads(files[0].read_text())
    assert entry == {"score": 6, "model": "judge-model", "domain": "prose", "rubric": "andrea-judge-rubric/1"}
    for f in files:
        data = f.read_bytes().decode()
        assert not [k for k in _key_forms(KEY) if k in data], data
        assert KEY[:12] not in f.name
    assert j.score("prose", "Once upon", "a time there were three bears") == {"score": 6, "reason": "",
                                                                            "cached": True}


def test_a_cache_entry_with_a_bad_score_is_asked_again(api, tmp_path):
    j = Judge(api.url, "m", "X", timeout_s=5, retries=0, cache_dir=tmp_path)
    assert j.score("chat", "p", "one two three")["score"] == 3
    (entry,) = [f for f in tmp_path.rglob("*.json")]
    entry.write_text(json.dumps({"score": "9"}))
    assert j.score("chat", "p", "one two three") == {"score": 3, "reason": "13 chars", "cached": False}
    assert len(api.requests) == 2


def test_run_judge_gives_the_exact_mean_the_fake_server_implies(api, tmp_path):
    """The score is min(10, words of the sample): the means per domain and overall are known to the digit."""
    samples = [("chat", "one two"), ("chat", "a b c d e f g"), ("prose", " ".join(["w"] * 14)),
               ("code", "x = 1"), ("code", "")]
    audit = {"checkpoints": [{"final": False, "samples": []},
                             {"final": True, "samples": [{"domain": d, "prompt": f"p{i}", "text": t}
                                                         for i, (d, t) in enumerate(samples)]}]}
    cfg = {"eval": {"judge": {"url": api.url, "model": "tiny-judge", "api_key_env": "NO_SUCH_ENV_VAR_X",
                              "timeout_s": 5, "retries": 0}}}
    out = run_judge(cfg, audit, str(tmp_path / "cache"))
    # chat: 2 and 7; prose: 14 -> 10; code: 3 and 0 (an empty sample scores 0)
    assert out["by_domain"] == {"chat": 4.5, "code": 1.5, "prose": 10.0}
    assert out["n_scored"] == 5 and out["mean_score"] == round((2 + 7 + 10 + 3 + 0) / 5, 4) == 4.4
    assert out["status"] == "ok" and out["requests"] == 5
    again = run_judge(cfg, audit, str(tmp_path / "cache"))
    assert again["mean_score"] == 4.4 and again["cached_answers"] == 5 and again["requests"] == 0
