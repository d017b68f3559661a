"""Live loss dashboard: ``andrea dashboard RUN_DIR --port N`` serves, on 127.0.0.1 only, a page
that follows the run's ``model.loss.json`` while it trains.

    andrea dashboard runs/tiny/main --port 8765       # then open http://127.0.0.1:8765/

The page (``dashboard.html`` beside this file: plain JS + inline SVG, no external asset,
nothing fetched from the network) polls ``/data`` every ``--interval`` seconds and draws
the train loss with its SMMA (the trainer's ``smma``, when the records carry it), each
source's train-loss EMA at its pulls (the pull records' ``ema``), the held-out loss per source
at each eval point (``val`` records), learning rate, tokens/s and the bandit's pull shares, plus
the run's events. Every answer carries ``styles`` (source -> [colour, dash], render.source_styles
over the run's config order from ``model.state.json``, then any other source seen) and ``looks``
(the sequence other series take), so a source looks the same here as in eval.html. Tokens/s (and each step's wall-clock time) come from the run's
``model.perf.jsonl`` (andrea/runs.py: the tracked history holds no wall-clock field), merged
into the train records it serves by step; an older run's own fields are kept. ``/data?train=I&train_last=S&...`` returns only the records after the first
I of each list (``train``, ``val``, ``pulls``, ``events``); when the history no longer
extends what the page holds (a resume rewrote it, or the run folder was replaced), the
answer has ``reset: true`` and the full lists. The training loop replaces the file
atomically, so a read never sees half a file; the server re-parses it only when its
mtime or size changes. While the file does not exist yet the page says it is waiting.
A file that is not the history (not JSON, NaN/Infinity, a list that is not a list of
objects, nesting too deep to parse) is answered as ``{"error": "..."}`` and the page shows
an error state, keeping what it drew. Every request gets an answer (a failure while
answering is a 500 with a JSON error); a client that hangs up early is not reported.
Stop with Ctrl-C.
"""

from __future__ import annotations

import json
import math
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from andrea import runs
from andrea.errors import AndreaError
from andrea.reports.render import DASHES, HUES, LOSS_LOOKS, config_sources, source_styles, style_at
from andrea.runs import HISTORY_KEYS as KEYS

HOST = "127.0.0.1"
NOT_YET = "not written yet"


def page_html(interval_s: float) -> bytes:
    html = (resources.files("andrea") / "reports" / "dashboard.html").read_text(encoding="utf-8")
    return html.replace("Number(params.get(\"interval\") || 2000)",
                        f"Number(params.get(\"interval\") || {int(interval_s * 1000)})").encode("utf-8")


class History:
    """``model.loss.json`` of a run, parsed again only when the file changes."""

    def __init__(self, run: Path):
        rf = runs.RunFolder(run)
        self.path, self.perf, self.state = rf.loss, rf.perf, rf.state
        self._key = None
        self._data: dict | None = None
        self._why = NOT_YET
        self.styles: dict = source_styles([])
        self._lock = threading.Lock()

    def _sources(self) -> list[str]:
        """The run's config order of sources (``model.state.json`` lands with the history); [] if unreadable."""
        try:
            state = json.loads(self.state.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            return []
        return config_sources(state.get("config")) if isinstance(state, dict) else []

    def load(self) -> tuple[dict | None, str]:
        with self._lock:
            try:
                st = self.path.stat()
            except FileNotFoundError:
                self._key, self._data, self._why = None, None, NOT_YET
                return None, self._why
            key = (st.st_mtime_ns, st.st_size, st.st_ino, _stat_key(self.perf))
            if key != self._key:
                try:
                    self._data, self._why = with_perf(runs.read_history(self.path), runs.read_perf(self.perf)), ""
                    self.styles = {**source_styles(self._sources(), seen_sources(self._data)), **LOSS_LOOKS}
                except AndreaError as e:
                    self._data, self._why = None, str(e)
                except OSError as e:
                    self._data, self._why = None, f"{self.path}: loss history is unreadable: {e.strerror or e}"
                self._key = key
            return self._data, self._why


def _stat_key(path: Path) -> tuple | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


def seen_sources(data: dict) -> set[str]:
    """The sources a history names: its pulls' and its val records' per-source keys."""
    seen = {str(r["source"]) for r in data["pulls"] if r.get("source") is not None}
    return seen | {str(k) for r in data["val"] if isinstance(r.get("per_source"), dict) for k in r["per_source"]}


LOOKS = [list(style_at(i)) for i in range(len(HUES) * len(DASHES))]


def with_perf(data: dict, perf: dict[int, dict]) -> dict:
    """The history with each train record's ``tokens_per_s`` and ``time`` from the sidecar."""
    if perf:
        data = {**data, "train": [{**r, **{k: perf[r["step"]][k] for k in runs.WALL_CLOCK if k in perf[r["step"]]}}
                                  if isinstance(r.get("step"), int) and r["step"] in perf else r
                                  for r in data["train"]]}
    return data


def _same_step(a, b: str) -> bool:
    try:
        return math.isclose(float(a), float(b))
    except (TypeError, ValueError):
        return False


def since(data: dict, query: dict) -> dict:
    """The records each client list lacks, or everything with ``reset`` when the lists diverged."""
    offsets = {}
    reset = False
    for k in KEYS:
        try:
            n = max(0, int(query.get(k, ["0"])[0] or 0))
        except ValueError:
            n = 0
        recs = data[k]
        last = query.get(k + "_last", [""])[0]
        if n > len(recs) or (n > 0 and not _same_step(recs[n - 1].get("step"), last)):
            reset = True
        offsets[k] = n
    if reset:
        return {"reset": True, **{k: data[k] for k in KEYS}}
    return {"reset": False, **{k: data[k][offsets[k]:] for k in KEYS}}


class QuietServer(ThreadingHTTPServer):
    """A client that hangs up early is its own business: no traceback; anything else is one line."""

    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        e = sys.exc_info()[1]
        if isinstance(e, (ConnectionError, TimeoutError)):
            return
        print(f"andrea dashboard: request from {client_address[0]} failed: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)


def make_server(run: Path, port: int, interval_s: float = 2.0) -> ThreadingHTTPServer:
    """An HTTP server on 127.0.0.1:port (0 = any free port) for one run folder."""
    hist = History(run)
    page = page_html(interval_s)
    label = str(run)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.end_headers()
            self.wfile.write(body)

        def _data(self, query: str) -> bytes:
            head = {"run": label, "file": hist.path.name}
            data, why = hist.load()
            if data is None:
                out = {**head, ("missing" if why == NOT_YET else "error"): why}
            else:
                out = {**head, **since(data, parse_qs(query)), "styles": hist.styles, "looks": LOOKS}
            try:
                return json.dumps(out, allow_nan=False, default=str).encode("utf-8")
            except (ValueError, TypeError, RecursionError) as e:
                why = "nested too deeply to serve" if isinstance(e, RecursionError) else f"cannot be served: {e}"
                return json.dumps({**head, "error": f"unreadable: {why}"}).encode("utf-8")

        def do_GET(self):
            try:
                url = urlparse(self.path)
                if url.path in ("/", "/index.html"):
                    self._send(200, page, "text/html; charset=utf-8")
                elif url.path == "/data":
                    self._send(200, self._data(url.query), "application/json")
                elif url.path == "/favicon.ico":
                    self._send(204, b"", "image/x-icon")                # no icon, and no console error for it
                else:
                    self._send(404, b"not found\n", "text/plain; charset=utf-8")
            except (ConnectionError, TimeoutError):
                raise                                                     # the client left: nobody to answer
            except Exception as e:                                        # answer, and say it in one line
                print(f"andrea dashboard: {self.path}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                self._send(500, json.dumps({"error": f"server error: {type(e).__name__}"}).encode("utf-8"),
                           "application/json")

    return QuietServer((HOST, int(port)), Handler)


def add_arguments(p) -> None:
    p.add_argument("run", metavar="RUN_DIR", help="run folder whose model.loss.json to follow, e.g. runs/tiny/main")
    p.add_argument("--port", type=int, default=8765, help="port on 127.0.0.1 (default: %(default)s; 0 = any free port)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between the page's polls (default: %(default)s)")


def run(args, cfg) -> int:
    from andrea.errors import AndreaError

    run_dir = Path(args.run)
    if not run_dir.is_dir():
        raise AndreaError(f"{run_dir}: run folder not found")
    if not 0 <= args.port < 65536:
        raise AndreaError(f"--port {args.port}: must be in 0..65535")
    try:
        srv = make_server(run_dir, args.port, max(0.2, float(args.interval)))
    except OSError as e:
        raise AndreaError(f"{HOST}:{args.port}: cannot listen ({e.strerror or e})") from None
    print(f"andrea dashboard: following {run_dir / 'model.loss.json'} at http://{HOST}:{srv.server_address[1]}/ "
          "(Ctrl-C stops)", file=sys.stderr, flush=True)
    try:
        srv.serve_forever(poll_interval=0.25)
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
    return 0
