"""External judge: score samples 0-10 with a model behind an OpenAI-compatible chat-completions API.

Off by default. Configured by ``eval.judge`` in params.yaml:

    eval:
      judge:
        url: http://127.0.0.1:8000/v1     # base URL (".../chat/completions" is appended) or the full endpoint
        model: some-model
        api_key_env: ANDREA_JUDGE_KEY      # the key is read from this environment variable only
        timeout_s: 30
        retries: 2

    from andrea.reports.judge import Judge
    j = Judge.from_cfg(cfg, cache_dir=".cache/andrea-judge")
    if j.enabled:
        r = j.score("chat", prompt, answer)      # {"score": 7, "reason": "...", "cached": False}
    j.status                                      # "ok" | "not configured: ..." | "unreachable: ..."

The key is only ever placed in the ``Authorization`` header of the request to the
configured URL: it is not logged, not written, and not part of any cache key or error
message. Redirects are not followed (a 3xx is a failure saying so), so the header never
reaches another origin. Every answer is cached by the sha256 of (judge model, rubric
version, domain, prompt, sample), one JSON file per answer holding only the score and
our own labels (model, domain, rubric), never text the server sent, so a re-run asks
nothing twice and a server that echoes the header gets nothing of it on disk; the reason
returned in memory has the key blanked out. Each request has a timeout and at most
``retries`` retries (with a short exponential back-off) on network errors, 429 and 5xx;
the first request that still fails marks the judge unreachable and no more are sent, so
an eval never hangs on a dead endpoint. The eval stage succeeds either way and its
report says which it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

from andrea.fsutil import atomic_write_json

RUBRIC_VERSION = "andrea-judge-rubric/1"

RUBRICS = {
    "chat": "Judge the ASSISTANT ANSWER to the conversation. 10 = correct, relevant, fluent and complete; "
            "7 = relevant and fluent with small errors; 4 = on topic but confused, wrong or repetitive; "
            "1 = fluent-looking but unrelated or nonsensical; 0 = empty, garbage or endless repetition.",
    "prose": "Judge the CONTINUATION of the text opening. 10 = fluent, coherent, on-topic prose a careful writer "
             "could have written; 7 = fluent with small lapses; 4 = grammatical fragments without a thread; "
             "1 = mostly nonsense; 0 = empty, garbage or endless repetition.",
    "code": "Judge the CONTINUATION of the Python code opening. 10 = valid, idiomatic code that fits the opening; "
            "7 = plausible code with small errors; 4 = code-like text that would not run; 1 = barely code; "
            "0 = empty, garbage or endless repetition.",
}

SYSTEM = ("You are a strict evaluator of text written by a small language model. Read the rubric, the prompt "
          "and the model's output. Reply with exactly one line: 'SCORE: <integer 0-10> | <one short reason>'.")

_SCORE_RE = re.compile(r"SCORE\s*[:=]\s*(\d{1,2})", re.IGNORECASE)
_INT_RE = re.compile(r"\b(\d{1,2})\b")


class JudgeUnavailable(Exception):
    """The endpoint could not give an answer (after the bounded retries)."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Every 3xx stays an HTTPError: urllib would re-send the Authorization header to the new location."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def endpoint(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/chat/completions") else url + "/chat/completions"


def parse_score(text: str) -> int | None:
    """The 0-10 score in a judge's reply (``SCORE: n`` preferred, else the first 0-10 integer)."""
    m = _SCORE_RE.search(text) or _INT_RE.search(text)
    if not m:
        return None
    v = int(m.group(1))
    return v if 0 <= v <= 10 else None


def cache_key(model: str, domain: str, prompt: str, sample: str) -> str:
    blob = json.dumps([RUBRIC_VERSION, model, domain, prompt, sample], ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def user_message(domain: str, prompt: str, sample: str) -> str:
    rubric = RUBRICS.get(domain, RUBRICS["prose"])
    return (f"RUBRIC ({domain}): {rubric}\n\n=== PROMPT ===\n{prompt}\n=== END PROMPT ===\n\n"
            f"=== MODEL OUTPUT ===\n{sample}\n=== END MODEL OUTPUT ===\n\nReply: SCORE: <0-10> | <reason>")


class Judge:
    def __init__(self, url: str, model: str, api_key_env: str, timeout_s: float = 30.0, retries: int = 2,
                 cache_dir: str | Path | None = None, backoff_s: float = 0.5):
        self.url, self.model = url.strip(), model.strip()
        self.api_key_env = api_key_env
        self.timeout_s, self.retries, self.backoff_s = float(timeout_s), int(retries), float(backoff_s)
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.n_requests = 0
        self.n_cached = 0
        if not self.url or not self.model:
            self.status = "not configured: eval.judge.url and eval.judge.model are empty (the judge is off by default)"
        else:
            self.status = "ok"

    @classmethod
    def from_cfg(cls, cfg: dict, cache_dir: str | Path | None = None) -> "Judge":
        j = cfg["eval"]["judge"]
        return cls(j["url"], j["model"], j["api_key_env"], j["timeout_s"], j["retries"], cache_dir)

    @property
    def enabled(self) -> bool:
        return self.status == "ok"

    @property
    def has_key(self) -> bool:
        return bool(os.environ.get(self.api_key_env))

    def describe(self) -> dict:
        """What the report may say about the judge (never the key)."""
        return {"status": self.status, "url": self.url or None, "model": self.model or None,
                "api_key_env": self.api_key_env, "api_key_present": self.has_key, "rubric": RUBRIC_VERSION,
                "requests": self.n_requests, "cached_answers": self.n_cached}

    # -- one request
    def _post(self, body: dict) -> dict:
        data = json.dumps(body).encode("utf-8")
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        key = os.environ.get(self.api_key_env)
        if key:
            headers["Authorization"] = "Bearer " + key
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            req = urllib.request.Request(endpoint(self.url), data=data, headers=headers, method="POST")
            self.n_requests += 1
            try:
                with _OPENER.open(req, timeout=self.timeout_s) as resp:
                    return json.loads(resp.read().decode("utf-8"))
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code} from {endpoint(self.url)}"
                if 300 <= e.code < 400:
                    last += (" (a redirect: not followed, so the key stays with the configured origin; "
                             "set eval.judge.url to the final endpoint)")
                    break
                if e.code != 429 and e.code < 500:
                    break                                   # 4xx other than 429: retrying will not help
            except (urllib.error.URLError, TimeoutError, OSError) as e:
                reason = getattr(e, "reason", e)
                last = f"{endpoint(self.url)}: {type(reason).__name__}: {reason}"
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                last = f"{endpoint(self.url)}: reply is not JSON ({e})"
        raise JudgeUnavailable(f"{last} (after {attempt + 1} attempt(s), timeout {self.timeout_s:g}s)")

    def score(self, domain: str, prompt: str, sample: str) -> dict | None:
        """Score one sample; None when the judge is off or has become unreachable."""
        if not self.enabled:
            return None
        key = cache_key(self.model, domain, prompt, sample)
        path = self.cache_dir / key[:2] / f"{key}.json" if self.cache_dir else None
        if path is not None and path.is_file():
            try:
                cached = json.loads(path.read_text(encoding="utf-8"))["score"]
                if type(cached) is int and 0 <= cached <= 10:
                    self.n_cached += 1
                    return {"score": cached, "reason": "", "cached": True}
            except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
                pass                                         # a damaged cache entry is asked again
        body = {"model": self.model, "temperature": 0, "max_tokens": 120,
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": user_message(domain, prompt, sample)}]}
        try:
            reply = self._post(body)
            content = reply["choices"][0]["message"]["content"]
        except JudgeUnavailable as e:
            self.status = f"unreachable: {e}"
            return None
        except (KeyError, IndexError, TypeError):
            self.status = f"unreachable: {endpoint(self.url)} answered without choices[0].message.content"
            return None
        content = content if isinstance(content, str) else ""
        score = parse_score(content)
        reason = content.split("|", 1)[1].strip() if "|" in content else content.strip()
        secret = os.environ.get(self.api_key_env)
        if secret:
            reason = reason.replace(secret, "[key]")          # a server that echoes the header
        if path is not None and score is not None:           # only what a re-run needs: the score
            atomic_write_json(path, {"score": score, "model": self.model, "domain": domain, "rubric": RUBRIC_VERSION})
        return {"score": score, "reason": reason[:300], "cached": False}
