"""The eval stage on a small synthetic run: bits per byte and perplexity against an independent computation,
the figures drawn from what each source's loss really is (pull EMAs, held-out per source) and the SMMA,
self-contained HTML, DVC metrics/plots files, and the judge (loopback server, unconfigured, unreachable).

    pytest tests/test_reports_eval.py
"""

from __future__ import annotations

import csv
import json
import math
import re
import socket
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from andrea.cli import main as cli_main
from andrea.generate import load_model
from andrea.reports import render as R
from andrea.reports.evaluate import ema_at_pulls, loss_rows, perplexity, pull_shares, val_source_rows, window_starts
from andrea.shards import Shard
from reports_fixtures import make_run
from test_reports_judge import FakeAPI


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evalrun")
    r = make_run(tmp, train_steps=60)
    assert cli_main(["audit", *r.cli_params(), "--run", str(r.run), "--tokenizer", str(r.tokenizer),
                     "--out", str(tmp / "rep")]) == 0
    return r, tmp


def run_eval(r, out, *extra, audit=True):
    args = ["eval", *r.cli_params(), "--run", str(r.run), "--tokenizer", str(r.tokenizer), "--tokens", str(r.tokens),
            "--out", str(out), "--judge-cache", str(out / "judge-cache"), *extra]
    if audit:
        args += ["--audit", str(out.parent / "rep" / "audit.json")]
    return cli_main(args)


def independent_bpb(r):
    """NLL by the KV-cache inference path (not the engine's batched forward) over the same windows."""
    lm = load_model(r.run, r.tokenizer, r.cfg)
    tok, T = lm.tokenizer, lm.config.context
    per = {}
    for src in ("code-b", "prose-a"):
        sh = Shard(r.tokens / "val" / f"{src}.bin")
        nll = n_bytes = n = 0.0
        for s in window_starts(sh.n_tokens, T, 2 * 4):
            w = np.asarray(sh.tokens[s:s + T + 1], dtype=np.int64)
            lm.model.reset()
            logits = lm.model.forward(w[:-1], all_logits=True).astype(np.float64)
            lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
            nll += float((lse - logits[np.arange(T), w[1:]]).sum())
            n_bytes += sum(len(tok.token_bytes(int(i))) for i in w[1:])
            n += T
        per[src] = (nll / n, nll / (n_bytes * math.log(2)), nll, n)
    return per


def test_eval_figures_match_an_independent_computation(synth):
    r, tmp = synth
    out = tmp / "out1"
    assert run_eval(r, out) == 0
    m = json.loads((out / "metrics.json").read_text())
    ref = independent_bpb(r)
    for src, (loss, bpb, _, _) in ref.items():
        assert m["per_source"][src]["loss"] == pytest.approx(loss, rel=1e-4)
        assert m["per_source"][src]["bpb"] == pytest.approx(bpb, rel=1e-4)
        assert m["per_source"][src]["ppl"] == pytest.approx(math.exp(loss), rel=1e-4)
    overall = sum(v[2] for v in ref.values()) / sum(v[3] for v in ref.values())
    assert m["val_ppl"] == pytest.approx(math.exp(overall), rel=1e-4)
    assert m["val_ppl"] == pytest.approx(math.exp(m["val_loss"]), rel=1e-5)
    assert m["val_bpb"] < m["unigram_bpb"]                     # 60 steps on a repetitive corpus beat unigram
    assert m["step"] == 60 and m["halted"] == 0 and "judge_score" not in m
    assert {"trigram", "distinct_2", "flag_rate"} <= set(m["coherence"])

    def numbers_only(d):
        return all(numbers_only(v) if isinstance(v, dict) else isinstance(v, (int, float)) for v in d.values())
    assert numbers_only(m)


def test_eval_html_is_self_contained_and_plots_are_csv(synth):
    r, tmp = synth
    out = tmp / "out2"
    assert run_eval(r, out) == 0
    html = (out / "eval.html").read_text()
    assert html.count("<svg") >= 5
    assert "<script" not in html and "<link" not in html and "@import" not in html
    assert not re.findall(r"(?:src|href)\s*=", html)
    assert set(re.findall(r"https?://[^\s\"'<>]+", html)) <= {"http://www.w3.org/2000/svg"}
    for title in ("train loss EMA per source, at its pulls", "held-out loss per source", "share of pulls per source",
                  "learning rate", "held-out bits per byte", "train loss"):
        assert f'aria-label="{title}"' in html
    assert "perplexity" in html and "perplexity" in (out / "eval.md").read_text()
    assert "code-b" in html and "prose-a" in html
    rows = list(csv.DictReader((out / "loss.csv").open()))
    assert [int(x["step"]) for x in rows] == list(range(60)) and all(float(x["loss"]) > 0 for x in rows)
    train = json.loads((r.run / "model.loss.json").read_text())["train"]
    assert [float(x["smma"]) for x in rows] == pytest.approx([t["smma"] for t in train], rel=1e-5)
    prow = list(csv.reader((out / "val_per_source.csv").open()))
    val = json.loads((r.run / "model.loss.json").read_text())["val"]
    cfg_srcs = R.config_sources(r.cfg)                         # the recipe's 8, with no val shard here: empty
    assert prow[0] == ["step", *cfg_srcs, "code-b", "prose-a"] and len(cfg_srcs) == 8
    assert all(row[1:9] == [""] * 8 for row in prow[1:])
    assert [float(v) for row in prow[1:] for v in (row[0], *row[9:])] == pytest.approx(
        [x for v in val for x in (v["step"], v["per_source"]["code-b"], v["per_source"]["prose-a"])], rel=1e-5)

    vrows = list(csv.DictReader((out / "val_loss.csv").open()))
    assert [int(x["step"]) for x in vrows] == [9, 19, 29, 39, 49, 59]
    md = (out / "eval.md").read_text()
    assert "| overall |" in md and "not configured" in md
    # deterministic: same inputs, same bytes
    first = {p: (out / p).read_bytes() for p in ("eval.html", "eval.md", "metrics.json", "loss.csv")}
    assert run_eval(r, out) == 0
    assert {p: (out / p).read_bytes() for p in first} == first
    # no wall clock: a run that went at another speed (an older run folder whose train records
    # still carry time / tokens_per_s) gives the same bytes, and the page says where throughput is
    assert "median tokens/s" not in md and "throughput is a property of the machine" in md and "Throughput" not in html
    assert not any("tokens_per_s" in k for k in json.loads(first["metrics.json"]))
    loss_path = r.run / "model.loss.json"
    saved = loss_path.read_text()
    doc = json.loads(saved)
    assert doc["train"] and all("tokens_per_s" in x and "time" in x for x in doc["train"])   # old format
    for x in doc["train"]:
        x["tokens_per_s"], x["time"] = 7 * x["tokens_per_s"] + 3, x["time"] + 1e6
    try:
        loss_path.write_text(json.dumps(doc))
        assert run_eval(r, out) == 0
        assert {p: (out / p).read_bytes() for p in first} == first
    finally:
        loss_path.write_text(saved)


def test_eval_with_judge_on_loopback_server(synth, monkeypatch):
    r, tmp = synth
    api = FakeAPI()
    monkeypatch.setenv("ANDREA_JUDGE_KEY", "sk-secret-xyz")
    try:
        out = tmp / "out3"
        assert run_eval(r, out, "-S", f"eval.judge.url={api.url}", "-S", "eval.judge.model=tiny-judge") == 0
        samples = json.loads((tmp / "rep" / "audit.json").read_text())["checkpoints"][-1]["samples"]
        n_samples = len(samples)
        assert len(api.requests) == n_samples
        m = json.loads((out / "metrics.json").read_text())
        implied = [min(10, len(s["text"].split())) for s in samples]      # the fake judge's rule
        assert m["judge_score"] == round(float(np.mean(implied)), 4)
        assert m["judge_by_domain"] == {d: round(float(np.mean([v for s, v in zip(samples, implied)
                                                                if s["domain"] == d])), 4)
                                        for d in ("chat", "code", "prose")}
        for f in ("eval.html", "eval.md", "metrics.json"):
            assert "sk-secret-xyz" not in (out / f).read_text()
        assert "Judge: ok" in (out / "eval.md").read_text()
        # second run: every answer comes from the cache
        assert run_eval(r, out, "-S", f"eval.judge.url={api.url}", "-S", "eval.judge.model=tiny-judge") == 0
        assert len(api.requests) == n_samples
    finally:
        api.close()


def test_eval_with_unreachable_judge_still_succeeds(synth):
    r, tmp = synth
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    out = tmp / "out4"
    assert run_eval(r, out, "-S", f"eval.judge.url=http://127.0.0.1:{port}/v1", "-S", "eval.judge.model=m",
                    "-S", "eval.judge.retries=0", "-S", "eval.judge.timeout_s=2") == 0
    md = (out / "eval.md").read_text()
    assert "Judge: unreachable" in md
    assert "judge_score" not in json.loads((out / "metrics.json").read_text())


def test_eval_without_audit_and_with_bad_tokens_dir(synth, capsys):
    r, tmp = synth
    out = tmp / "out5"
    assert run_eval(r, out, audit=False) == 0
    assert "No audit given." in (out / "eval.md").read_text()
    args = ["eval", *r.cli_params(), "--run", str(r.run), "--tokenizer", str(r.tokenizer), "--tokens", str(tmp / "none"),
            "--out", str(tmp / "out6")]
    assert cli_main(args) == 2
    assert "no token shards" in capsys.readouterr().err


def test_window_starts_and_pull_shares():
    assert window_starts(1000, 100, 3).tolist() == [0, 400, 800]
    assert window_starts(1000, 100, 50).tolist() == [i * 100 for i in range(9)]
    assert window_starts(50, 100, 5).tolist() == [0]
    assert window_starts(1, 100, 5).tolist() == []
    hist = {"pulls": [{"step": i, "source": "a" if i < 100 else "b"} for i in range(200)], "train": []}
    sh = pull_shares(hist, n_buckets=4)
    assert [round(v, 2) for _, v in sh["a"]] == [1.0, 1.0, 0.0, 0.0]
    assert all(abs(a[1] + b[1] - 1) < 1e-9 for a, b in zip(sh["a"], sh["b"]))


def _svg(html: str, title: str) -> ET.Element:
    m = re.search(r'<svg[^>]*aria-label="' + re.escape(title) + r'".*?</svg>', html, re.S)
    assert m, title
    return ET.fromstring(m.group(0))


def _lines(svg: ET.Element) -> dict[str, list[tuple[float, float]]]:
    return {e.get("data-series"): [tuple(map(float, p.split(","))) for p in e.get("points").split()]
            for e in svg.iter() if e.tag.endswith("polyline")}


def test_per_source_figures_come_from_pulls_and_val_not_train_records(synth):
    """Each source's train-loss figure is its EMA at its pulls (the pull records' ema) and its
    held-out loss at each eval point; the train records (one logged step now and then, a mean over
    sources under accumulation) draw no per-source line. The old chart joined the train records."""
    r, tmp = synth
    out = tmp / "out7"
    assert run_eval(r, out) == 0
    doc = json.loads((r.run / "model.loss.json").read_text())
    html = (out / "eval.html").read_text()
    ema = _lines(_svg(html, "train loss EMA per source, at its pulls"))
    for src in ("code-b", "prose-a"):
        pulls = [p for p in doc["pulls"] if p["source"] == src]
        trains = [t for t in doc["train"] if t["source"] == src]
        assert len(ema[src]) == len(pulls) != len(trains)
        # higher EMA is drawn higher (smaller y): the points follow the pulls' ema, in step order
        ys = [y for _, y in ema[src]]
        emas = [p["ema"] for p in pulls]
        assert [a < b for a, b in zip(ys, ys[1:])] == [a > b for a, b in zip(emas, emas[1:])]
    assert ema_at_pulls(doc["pulls"]) == {s: [(float(p["step"]), p["ema"]) for p in doc["pulls"] if p["source"] == s]
                                          for s in ("prose-a", "code-b")}
    val = _lines(_svg(html, "held-out loss per source"))
    assert set(val) == {"overall", "code-b", "prose-a"} and all(len(v) == len(doc["val"]) for v in val.values())
    loss = _lines(_svg(html, "train loss"))
    assert set(loss) == {"train loss", "smma"} and len(loss["smma"]) == len(doc["train"])
    # one look per source in every figure, none like another's or the aggregates'
    looks = R.source_styles(R.config_sources(r.cfg), ["code-b", "prose-a"])    # after the config's 8
    for title in ("train loss EMA per source, at its pulls", "held-out loss per source", "share of pulls per source"):
        drawn = {e.get("data-series"): (e.get("stroke"), e.get("stroke-dasharray") or "")
                 for e in _svg(html, title).iter() if e.tag.endswith("polyline")}
        assert all(drawn[s] == looks[s] for s in ("code-b", "prose-a")) and len(set(drawn.values())) == len(drawn)


def test_an_old_history_without_smma_or_pull_ema_draws_those_series_absent(synth):
    """A run from before smma / pull ema: no made-up series, no smma column; the rest as before."""
    r, tmp = synth
    loss_path = r.run / "model.loss.json"
    saved = loss_path.read_text()
    doc = json.loads(saved)
    for t in doc["train"]:
        del t["smma"]
    for p in doc["pulls"]:
        del p["ema"]
    out = tmp / "out8"
    try:
        loss_path.write_text(json.dumps(doc))
        assert run_eval(r, out) == 0
    finally:
        loss_path.write_text(saved)
    html = (out / "eval.html").read_text()
    assert set(_lines(_svg(html, "train loss"))) == {"train loss"} and "smma" not in html
    ema_svg = ET.tostring(_svg(html, "train loss EMA per source, at its pulls"), encoding="unicode")
    assert "no data" in ema_svg
    lines = (out / "loss.csv").read_text().splitlines()
    assert lines[0] == "step,loss,smma" and all(x.endswith(",") for x in lines[1:])     # empty, not made up


def test_perplexity_and_plot_rows():
    assert perplexity(math.log(50.0)) == pytest.approx(50.0) and perplexity(None) is None
    assert perplexity(1e6) is None                                   # overflows: no number, not inf
    head, rows = loss_rows([{"step": 0, "loss": 5.0, "smma": 5.0}, {"step": 1, "loss": 4.0}, {"step": 2, "loss": None}])
    assert head == ["step", "loss", "smma"] and rows == [(0.0, 5.0, 5.0), (1.0, 4.0, "")]
    assert loss_rows([{"step": 0, "loss": 5.0}]) == (["step", "loss", "smma"], [(0.0, 5.0, "")])
    head, rows = val_source_rows([{"step": 10, "per_source": {"b": 2.0, "a": 1.0, "z": 9.0}},
                                  {"step": 20, "per_source": {"a": 0.5}}], ["b", "a", "never"])
    assert head == ["step", "b", "a", "never", "z"] and rows == [(10.0, 2.0, 1.0, "", 9.0), (20.0, "", 0.5, "", "")]
