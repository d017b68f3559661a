"""The live dashboard: the /data protocol, the server, and the page in a real headless chromium.

    pytest tests/test_dashboard.py

The browser test drives Debian's chromium through selenium + chromedriver (the ``test``
extra; ``.ci/run`` installs chromium and chromium-driver) and is skipped, saying why, where
either is missing, unless ``ANDREA_REQUIRE_BROWSER=1`` (set by ``.ci/run``) makes that a failure.

Bad history files (NaN/Infinity, wrong types, deep nesting, half-written) must give an error
answer and an error state on the page; clients that hang up must not make the server print.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from andrea.fsutil import atomic_write_json
from andrea.reports.dashboard import History, make_server, page_html, since
from andrea.runs import parse_history

ROOT = Path(__file__).resolve().parents[1]

SOURCES = ("chat-single", "py-code", "py-topics")


def history(n_train: int, n_val: int = 0, with_events: bool = True, smma: bool = True) -> dict:
    """A history as training writes it: train records with ``smma``, pulls with the source's ``ema``."""
    train = [{"step": s, "phase": "warmup" if s < 10 else "main", "loss": 6.0 - 0.05 * s + 0.1 * (s % 3),
              "lr": 1e-3 * min(1, (s + 1) / 10), "grad_norm": 1.0, "tokens_per_s": 5000 + 10 * s,
              "source": SOURCES[(s // 4) % 3], "time": float(s)} for s in range(n_train)]
    for i, r in enumerate(train):
        if smma:
            r["smma"] = r["loss"] if i == 0 else train[i - 1]["smma"] + (r["loss"] - train[i - 1]["smma"]) / 5
    val = [{"step": 10 * (i + 1), "loss": 5.0 - 0.2 * i, "per_source": {s: 5.0 - 0.2 * i + 0.1 * k
                                                                        for k, s in enumerate(SOURCES)}}
           for i in range(n_val)]
    pulls = [{"step": s, "source": SOURCES[(s // 4) % 3], "reward": 1.0, "scores": {}, "ema": 6.5 - 0.04 * s}
             for s in range(0, n_train, 4)]
    events = [{"step": 0, "kind": "start", "detail": "fresh"}] if with_events else []
    return {"format": "andrea.loss/1", "train": train, "val": val, "pulls": pulls, "events": events}


def test_since_returns_only_new_records_and_resets_on_divergence():
    d = history(30, 2)
    q = {"train": ["20"], "train_last": ["19"], "val": ["1"], "val_last": ["10"], "pulls": ["0"], "events": ["1"],
         "events_last": ["0"]}
    out = since(d, q)
    assert not out["reset"] and [r["step"] for r in out["train"]] == list(range(20, 30))
    assert len(out["val"]) == 1 and len(out["pulls"]) == len(d["pulls"]) and out["events"] == []
    assert since(d, {**q, "train_last": ["18"]})["reset"]          # history rewritten under the client
    assert since(d, {**q, "train": ["31"]})["reset"]               # history shorter than the client's
    full = since(d, {**q, "train": ["31"]})
    assert len(full["train"]) == 30


def test_history_reparses_only_on_change(tmp_path):
    h = History(tmp_path)
    assert h.load() == (None, "not written yet")
    atomic_write_json(tmp_path / "model.loss.json", history(5))
    d1, _ = h.load()
    assert len(d1["train"]) == 5 and h.load()[0] is d1
    atomic_write_json(tmp_path / "model.loss.json", history(8))
    assert len(h.load()[0]["train"]) == 8
    (tmp_path / "model.loss.json").write_text("{broken")
    assert h.load()[0] is None and "unreadable" in h.load()[1]


def test_tokens_per_s_come_from_the_perf_sidecar(tmp_path):
    """The tracked history has no wall clock (andrea/runs.py); the served train records get
    tokens/s and time from model.perf.jsonl by step (a torn last line is skipped, a redone step's
    later line wins), and the page follows the sidecar as it grows."""
    from andrea import runs

    doc = history(6)
    for r in doc["train"]:
        del r["tokens_per_s"], r["time"]
    atomic_write_json(tmp_path / "model.loss.json", doc)
    h = History(tmp_path)
    assert all("tokens_per_s" not in r for r in h.load()[0]["train"])      # no sidecar yet: no figure
    rf = runs.RunFolder(tmp_path)
    rf.append_perf([{"step": s, "phase": "warmup", "time": 100.0 + s, "tokens_per_s": 1000.0 + s} for s in range(4)])
    rf.append_perf([{"step": 3, "phase": "warmup", "time": 200.0, "tokens_per_s": 42.0}])
    with open(rf.perf, "a") as f:
        f.write('{"step": 4, "tokens_')                                   # a write torn by a kill
    got = {r["step"]: r for r in h.load()[0]["train"]}
    assert [got[s]["tokens_per_s"] for s in range(3)] == [1000.0, 1001.0, 1002.0]
    assert got[3]["tokens_per_s"] == 42.0 and got[3]["time"] == 200.0
    assert "tokens_per_s" not in got[4] and "tokens_per_s" not in got[5]
    assert got[0]["loss"] == doc["train"][0]["loss"]
    rf.append_perf([{"step": 5, "phase": "main", "time": 300.0, "tokens_per_s": 7.0}])   # after the torn line
    assert h.load()[0]["train"][5]["tokens_per_s"] == 7.0


@pytest.fixture
def server(tmp_path):
    srv = make_server(tmp_path, 0, interval_s=0.25)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield srv, tmp_path, f"http://127.0.0.1:{srv.server_address[1]}/"
    srv.shutdown()
    srv.server_close()


DEEP = '{"train": ' + "[" * 200_000 + "]" * 200_000 + "}"
BAD_FILES = {                    # name: (text of model.loss.json, words the error must hold)
    "nan": ('{"train": [{"step": 0, "loss": NaN}]}', "NaN"),
    "infinity": ('{"train": [{"step": 0, "loss": 1.0}], "val": [{"step": 1, "loss": -Infinity}]}', "-Infinity"),
    "train_int": ('{"train": 5}', '"train" is a JSON int'),
    "train_null": ('{"train": null}', '"train" is null'),
    "record_str": ('{"train": [{"step": 0}, "x"]}', '"train"[1] is a JSON str'),
    "top_list": ("[1, 2]", "a JSON list"),
    "deep": (DEEP, "nested too deeply"),
    "half": ('{"train": [{"step": 0, "loss": 5.1}, {"st', "unreadable"),
    "not_utf8": (b'{"train": [{"source": "\xff"}]}', "not UTF-8"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_history_is_an_error_answer(server, name):
    srv, run, url = server
    text, words = BAD_FILES[name]
    (run / "model.loss.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    with urllib.request.urlopen(url + "data?train=0", timeout=10) as r:
        assert r.status == 200
        d = json.loads(r.read())
    assert "error" in d and "missing" not in d and "train" not in d, d
    assert words in d["error"], d["error"]
    # and the server still answers the next request, the page and a good file
    assert urllib.request.urlopen(url, timeout=5).status == 200
    atomic_write_json(run / "model.loss.json", history(3))
    d = json.loads(urllib.request.urlopen(url + "data?train=0", timeout=5).read())
    assert len(d["train"]) == 3 and "error" not in d


def test_parse_history_accepts_what_training_writes():
    h = history(7, 2)
    assert parse_history(json.dumps(h)) == {k: h[k] for k in ("train", "val", "pulls", "events")}
    assert parse_history('{"format": "andrea.loss/1"}') == {"train": [], "val": [], "pulls": [], "events": []}
    assert parse_history('{"train": [{"step": 0, "loss": null}]}')["train"] == [{"step": 0, "loss": None}]


def _hang_up(port: int, path: str) -> None:
    """Send a request and reset the connection at once (SO_LINGER 0), before the answer is read."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    s.close()


class DashboardProcess:
    """``andrea dashboard`` as a real process on a free port; ``stop()`` sends Ctrl-C, returns (rc, stderr after start)."""

    def __init__(self, run: Path):
        # SIGINT back to its default in the child: a shell without job control starts background
        # jobs with SIGINT ignored, and Python then never turns Ctrl-C into KeyboardInterrupt
        self.p = subprocess.Popen([sys.executable, "-m", "andrea", "dashboard", str(run), "--port", "0"],
                                  stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        first = self.p.stderr.readline()
        self.port = int(re.search(r"http://127\.0\.0\.1:(\d+)/", first).group(1))

    def get(self, path: str) -> dict:
        return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10).read())

    def stop(self) -> tuple[int, str]:
        self.p.send_signal(signal.SIGINT)
        rest = self.p.communicate(timeout=20)[1]
        return self.p.returncode, rest


def test_the_server_process_stays_quiet_about_clients_that_hang_up(tmp_path):
    atomic_write_json(tmp_path / "model.loss.json", history(40_000, 50))      # several MB per /data answer
    srv = DashboardProcess(tmp_path)
    try:
        for i in range(20):
            _hang_up(srv.port, "/data?train=0" if i % 2 else "/")
        d = srv.get("/data?train=39990&train_last=39989")
        assert len(d["train"]) == 10                     # and it still answers
    finally:
        rc, rest = srv.stop()
    assert rc == 0
    assert rest.strip() == "", rest            # not a line after the start line: no ConnectionResetError traceback


def test_the_server_process_answers_bad_files_and_hang_ups_in_between(tmp_path):
    srv = DashboardProcess(tmp_path)
    try:
        for name in ("nan", "train_null", "deep", "half"):
            (tmp_path / "model.loss.json").write_text(BAD_FILES[name][0])
            assert BAD_FILES[name][1] in srv.get("/data")["error"]
            _hang_up(srv.port, "/data?train=0")
        atomic_write_json(tmp_path / "model.loss.json", history(5))
        assert len(srv.get("/data?train=0")["train"]) == 5
    finally:
        rc, rest = srv.stop()
    assert rc == 0 and rest.strip() == "", rest


CONFIG_ORDER = ("py-topics", "chat-single", "py-code")      # a config's megachat.sources, not sorted


def write_state(run: Path, order=CONFIG_ORDER) -> None:
    atomic_write_json(run / "model.state.json", {"format": "andrea.state/1", "config": {
        "megachat": {"sources": [{"name": n, "kind": "prose"} for n in order]}}})


def test_data_carries_the_one_source_look_mapping(server):
    """/data's styles are render.source_styles over the run's config order (model.state.json), then
    any other source the history names; the page draws with them, so eval.html and the dashboard agree."""
    from andrea.reports import render as R

    srv, run, url = server
    doc = history(12, 1)
    doc["pulls"].append({"step": 12, "source": "zz-extra", "ema": 5.0})
    atomic_write_json(run / "model.loss.json", doc)
    write_state(run)
    d = json.loads(urllib.request.urlopen(url + "data?train=0", timeout=5).read())
    want = R.source_styles(CONFIG_ORDER, ["zz-extra"])
    assert {k: tuple(v) for k, v in d["styles"].items()} == {**want, **R.LOSS_LOOKS}
    assert d["styles"]["py-topics"] == list(R.style_at(0)) and d["styles"]["zz-extra"] == list(R.style_at(3))
    assert len({tuple(v) for v in d["looks"]}) == len(d["looks"]) == len(R.HUES) * len(R.DASHES)
    (run / "model.state.json").write_text("{broken")                 # unreadable state: sorted names, no error
    atomic_write_json(run / "model.loss.json", history(13, 1))
    d = json.loads(urllib.request.urlopen(url + "data?train=0", timeout=5).read())
    assert "error" not in d and d["styles"]["chat-single"] == list(R.style_at(0))


def test_server_binds_loopback_and_serves_page_and_data(server):
    srv, run, url = server
    assert srv.server_address[0] == "127.0.0.1"
    page = urllib.request.urlopen(url, timeout=5).read().decode()
    assert "chart-loss" in page and "|| 250)" in page
    d = json.loads(urllib.request.urlopen(url + "data", timeout=5).read())
    assert d["missing"] == "not written yet"
    atomic_write_json(run / "model.loss.json", history(12))
    d = json.loads(urllib.request.urlopen(url + "data?train=0", timeout=5).read())
    assert len(d["train"]) == 12 and d["reset"] is False
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(url + "../etc/passwd", timeout=5)


def test_page_is_self_contained():
    html = page_html(2.0).decode()
    assert not re.findall(r"<(?:script|link|img|iframe)[^>]*(?:src|href)\s*=", html)
    assert set(re.findall(r"https?://[^\s\"'<>]+", html)) <= {"http://www.w3.org/2000/svg"}
    assert "@import" not in html


# ----------------------------------------------------------------- real browser
def _browser():
    """(webdriver module, chromium path, chromedriver path) or a skip reason."""
    try:
        from selenium import webdriver
    except ImportError:
        return None, "selenium is not installed (pip install -e '.[test]')"
    chrome = os.environ.get("ANDREA_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser") \
        or shutil.which("google-chrome")
    driver = os.environ.get("ANDREA_CHROMEDRIVER") or shutil.which("chromedriver")
    if not chrome:
        return None, "no chromium found (Debian: apt-get install chromium chromium-driver)"
    if not driver:
        return None, "no chromedriver found (Debian: apt-get install chromium-driver)"
    return (webdriver, chrome, driver), None


def _browser_or_skip():
    found, why = _browser()
    if found is None:
        if os.environ.get("ANDREA_REQUIRE_BROWSER") == "1":
            pytest.fail(f"ANDREA_REQUIRE_BROWSER=1 but {why}")
        pytest.skip(why)
    return found


def _wait(cond, timeout=20.0, what="condition"):
    end = time.time() + timeout
    while time.time() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_dashboard_in_headless_chromium_loads_draws_and_updates(server, tmp_path_factory):
    webdriver, chrome, driver_path = _browser_or_skip()
    from selenium.webdriver.chrome.service import Service

    srv, run, url = server
    opts = webdriver.ChromeOptions()
    opts.binary_location = chrome
    for a in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
              "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
              f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(options=opts, service=Service(executable_path=driver_path))
    try:
        drv.set_page_load_timeout(30)
        drv.get(url + "?interval=250")
        status = lambda: drv.find_element("id", "status")
        # no file yet: the page loads and says it waits
        _wait(lambda: "waiting for model.loss.json" in status().text, what="the waiting message")
        write_state(run)
        atomic_write_json(run / "model.loss.json", history(20, 1))
        _wait(lambda: status().get_attribute("data-records") == "20", what="20 records drawn")
        assert status().get_attribute("data-step") == "19"
        loss = drv.find_element("id", "chart-loss")
        lines = loss.find_elements("css selector", "polyline")
        assert sorted(l.get_attribute("data-series") for l in lines) == ["smma", "train loss"]
        assert int(loss.get_attribute("data-points")) == 40
        # per source: the pulls' ema (5 pulls), not the 20 train records; drawn in the config's order and looks
        from andrea.reports import render as R
        looks = R.source_styles(CONFIG_ORDER)
        ema = drv.find_element("id", "chart-ema")
        lines = ema.find_elements("css selector", "polyline")
        assert [l.get_attribute("data-series") for l in lines] == list(CONFIG_ORDER)
        assert int(ema.get_attribute("data-points")) == 5
        for l in lines:
            assert (l.get_attribute("stroke"), l.get_attribute("stroke-dasharray") or "") == looks[l.get_attribute("data-series")]
        val = drv.find_element("id", "chart-val").find_elements("css selector", "polyline")
        assert [l.get_attribute("data-series") for l in val] == [*CONFIG_ORDER, "overall"]
        assert len({(l.get_attribute("stroke"), l.get_attribute("stroke-dasharray") or "") for l in val}) == 4
        for cid in ("chart-lr", "chart-tps", "chart-shares"):
            assert drv.find_element("id", cid).find_elements("css selector", "polyline"), cid
        first_pts = {l.get_attribute("data-series"): len(l.get_attribute("points").split()) for l in lines}
        # the file grows: the page picks up only the new records and redraws
        atomic_write_json(run / "model.loss.json", history(45, 3))
        _wait(lambda: status().get_attribute("data-records") == "45", what="45 records drawn")
        assert "step 44" in status().text and "val" in status().text
        lines = drv.find_element("id", "chart-ema").find_elements("css selector", "polyline")
        grown = {l.get_attribute("data-series"): len(l.get_attribute("points").split()) for l in lines}
        assert sum(grown.values()) == 12 and all(grown[k] > first_pts[k] for k in first_pts)
        assert int(drv.find_element("id", "chart-loss").get_attribute("data-points")) == 90
        # a resume that rewrites history: the page resets instead of appending
        atomic_write_json(run / "model.loss.json", {**history(30, 1), "train": history(30)["train"][:10]
                                                    + [{**r, "step": r["step"] + 1000} for r in history(30)["train"][10:]]})
        _wait(lambda: status().get_attribute("data-records") == "30", what="reset to 30 records")
        assert "start" in drv.find_element("id", "events").text
        assert status().get_attribute("data-state") == "ok"
        # a bad file: an error state that says what is wrong, keeping what was drawn
        for i, name in enumerate(("nan", "train_null", "deep")):
            held = status().get_attribute("data-records")
            (run / "model.loss.json").write_text(BAD_FILES[name][0])
            _wait(lambda: status().get_attribute("data-state") == "error"
                  and BAD_FILES[name][1] in status().text, what=f"the error state for {name}")
            assert "error" in status().get_attribute("class") and status().get_attribute("data-records") == held
            atomic_write_json(run / "model.loss.json", history(31 + i, 1))
            _wait(lambda: status().get_attribute("data-state") == "ok"
                  and status().get_attribute("data-records") == str(31 + i), what=f"recovery after {name}")
        # an older run's history (no smma, pulls without ema): those series are absent, not made up
        atomic_write_json(run / "model.loss.json", {**history(25, 1, smma=False),
                                                    "pulls": [{k: v for k, v in p.items() if k != "ema"}
                                                              for p in history(25)["pulls"]]})
        _wait(lambda: status().get_attribute("data-records") == "25", what="the old history drawn")
        lines = drv.find_element("id", "chart-loss").find_elements("css selector", "polyline")
        assert [l.get_attribute("data-series") for l in lines] == ["train loss"]
        assert drv.find_element("id", "chart-ema").get_attribute("data-points") == "0"
        severe = [e for e in drv.get_log("browser") if e.get("level") == "SEVERE"]
        assert not severe, severe
    finally:
        drv.quit()
