"""The eval stage: held-out loss, perplexity and bits per byte per source, coherence, the audit's flags and an
optional external judge; ``eval.html`` (self-contained figures), ``eval.md``, DVC metrics and plots.

    andrea eval --profile tiny --run runs/tiny/main --tokenizer data/tokenizer/tiny/tokenizer.json \\
                --tokens data/tokens/tiny --audit reports/tiny/audit.json --out reports/tiny

Held-out figures: every ``data/tokens/<variant>/val/<source>.bin`` is cut into
non-overlapping windows of ``context + 1`` tokens (evenly spread over the shard, at most
``eval.max_batches`` batches of ``train.batch_size`` windows per source; a shard shorter
than one window is padded and the padding is not counted). The final checkpoint's
forward (the engine's own, on ``train.backend``) gives every target token's NLL in nats;
per source and overall:

    loss = sum NLL / tokens      perplexity = exp(loss)      bits/byte = sum NLL / (bytes * ln 2)

where bytes are the UTF-8 bytes of the target tokens (``tokenizer.token_bytes``; the
end-of-text id has none, its NLL still counts), so bits/byte compares across
tokenizers. A unigram baseline (train-split token frequencies, add-one smoothed) is given
beside it. Coherence and flags come from the audit (``audit.json``); the judge
(``andrea.reports.judge``) scores the audit's final samples when ``eval.judge`` is set.

Writes in OUT:
  eval.html     self-contained (inline CSS + SVG, no network): train loss and its SMMA, each
                source's train-loss EMA at its pulls, held-out loss per source at each eval
                point, bandit pull shares, learning rate, bits per byte per source, the tables.
                One look per source in every figure (render.source_styles, config order)
  eval.md       the same tables in Markdown
  metrics.json  DVC metrics (nested numbers only): val_loss, val_ppl, val_bpb, per_source.*
  loss.csv      DVC plot: train loss history, columns step,loss,smma (from model.loss.json;
                smma is the trainer's Wilder average, an empty cell where a record has none)
  val_loss.csv  DVC plot: the in-training held-out estimate (train.eval_batches batches per
                source at every train.eval_every steps), columns step,val_loss; metrics.json's
                val_loss is the full eval above (up to eval.max_batches batches per source)
  val_per_source.csv  DVC plot: that estimate per source, columns step,<source>...: every
                source of the config in its order, then any other (no val record: empty cell)
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import numpy as np

from andrea.errors import AndreaError
from andrea.fsutil import atomic_write_json, atomic_write_text
from andrea.settings import Settings

FORMAT = "andrea.eval/1"
LN2 = math.log(2.0)


# ------------------------------------------------------------------ held-out figures
def val_shards(tokens_dir: Path, split: str = "val") -> dict:
    from andrea.shards import Shard

    d = tokens_dir / split
    paths = sorted(d.glob("*.bin")) if d.is_dir() else []
    if not paths:
        raise AndreaError(f"{d}: no token shards (*.bin); run `andrea diet-alignment` first")
    return {p.stem: Shard(p) for p in paths}


def window_starts(n_tokens: int, T: int, max_windows: int) -> np.ndarray:
    """Starts of up to ``max_windows`` non-overlapping (T + 1)-token windows spread evenly over the shard."""
    n_full = (n_tokens - 1) // T
    if n_full <= 0:
        return np.zeros(1 if n_tokens >= 2 else 0, dtype=np.int64)
    k = min(max_windows, n_full)
    return (np.unique(np.linspace(0, n_full - 1, k).round().astype(np.int64)) * T).astype(np.int64)


def heldout(engine, shards: dict, byte_len: np.ndarray, eot_id: int, max_batches: int, progress=None) -> dict:
    """Per-source and overall NLL, tokens, bytes, loss and bits per byte of the engine's weights."""
    B, T = engine.B, engine.T
    per: dict[str, dict] = {}
    jobs = {src: window_starts(sh.n_tokens, T, max_batches * B) for src, sh in shards.items()}
    task = progress.add_task("held-out", total=sum(-(-len(s) // B) for s in jobs.values())) if progress else None
    for src, sh in shards.items():
        starts = jobs[src]
        nll = 0.0
        n_tok = 0
        n_bytes = 0
        toks = sh.tokens
        for b0 in range(0, len(starts), B):
            x = np.full((B, T), eot_id, dtype=np.int32)
            y = np.full((B, T), eot_id, dtype=np.int32)
            mask = np.zeros((B, T), dtype=bool)
            for r, s in enumerate(starts[b0:b0 + B]):
                w = np.asarray(toks[s:s + T + 1], dtype=np.int32)
                n = w.size - 1
                x[r, :n], y[r, :n] = w[:-1], w[1:]
                mask[r, :n] = True
            engine.forward(x, y)
            losses = engine.be.to_host(engine.a["losses"]).reshape(B, T).astype(np.float64)
            if not np.isfinite(losses[mask]).all():
                raise AndreaError(f"{sh.path}: non-finite loss on held-out tokens (broken checkpoint?)")
            nll += float(losses[mask].sum())
            n_tok += int(mask.sum())
            n_bytes += int(byte_len[y[mask]].sum())
            if progress:
                progress.advance(task)
        per[src] = _figures(nll, n_tok, n_bytes) | {"windows": int(len(starts)), "shard_tokens": int(sh.n_tokens)}
    tot = [sum(p[k] for p in per.values()) for k in ("nll", "tokens", "bytes")]
    return {"per_source": per, "overall": _figures(*tot)}


def perplexity(loss: float | None) -> float | None:
    """exp(mean nats per token); None without a loss or where it overflows a float."""
    if loss is None:
        return None
    try:
        return math.exp(loss)
    except OverflowError:
        return None


def _figures(nll: float, tokens: int, n_bytes: int) -> dict:
    return {"nll": nll, "tokens": tokens, "bytes": n_bytes,
            "loss": nll / tokens if tokens else None,
            "ppl": perplexity(nll / tokens) if tokens else None,
            "bpb": nll / (n_bytes * LN2) if n_bytes else None,
            "bytes_per_token": n_bytes / tokens if tokens else None}


def unigram_baseline(train_shards: dict, val: dict, vocab_size: int, byte_len: np.ndarray, T: int,
                     max_windows: int) -> dict:
    """Loss and bits/byte of an add-one-smoothed unigram model of the train split, on the same val tokens."""
    counts = np.ones(vocab_size, dtype=np.float64)
    for sh in train_shards.values():
        counts += np.bincount(np.asarray(sh.tokens), minlength=vocab_size)[:vocab_size]
    logp = np.log(counts / counts.sum())
    nll = tokens = n_bytes = 0.0
    for sh in val.values():
        for s in window_starts(sh.n_tokens, T, max_windows):
            y = np.asarray(sh.tokens[s + 1:s + T + 1], dtype=np.int64)
            nll -= float(logp[y].sum())
            tokens += y.size
            n_bytes += float(byte_len[y].sum())
    return _figures(nll, int(tokens), int(n_bytes))


# ------------------------------------------------------------------ history figures
def load_history(run: Path) -> dict:
    from andrea import runs

    return runs.read_history(runs.RunFolder(run).loss)


def _num(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def ema_at_pulls(pulls: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """Each source's train-loss EMA (bandit.ema over that source's own batches) at every pull of it:
    the ``ema`` a pull record carries. A history whose pulls carry none gives no series. (The train
    records are no source's loss: a logged step is one of every train.log_every, and with gradient
    accumulation its loss is the mean over several sources' batches.)"""
    out: dict[str, list[tuple[float, float]]] = {}
    for r in pulls:
        src, step, ema = r.get("source"), _num(r.get("step")), _num(r.get("ema"))
        if src is not None and step is not None and ema is not None:
            out.setdefault(str(src), []).append((step, ema))
    return out


def pull_shares(hist: dict, n_buckets: int = 40) -> dict[str, list[tuple[float, float]]]:
    """Share of each source among the bandit's pulls (or, without pull records, the logged train
    steps) in ``n_buckets`` equal spans of steps; x is the span's end step."""
    recs = [(r.get("step"), r.get("source")) for r in (hist["pulls"] or hist["train"])]
    recs = [(float(s), str(src)) for s, src in recs if _num(s) is not None and src is not None]
    if not recs:
        return {}
    n_buckets = max(1, min(n_buckets, len(recs) // 10))     # about ten pulls per span at least
    lo, hi = min(s for s, _ in recs), max(s for s, _ in recs)
    span = max((hi - lo) / n_buckets, 1.0)
    sources = sorted({src for _, src in recs})
    buckets: dict[int, dict[str, int]] = {}
    for s, src in recs:
        b = min(int((s - lo) / span), n_buckets - 1)
        buckets.setdefault(b, {}).setdefault(src, 0)
        buckets[b][src] += 1
    out: dict[str, list[tuple[float, float]]] = {src: [] for src in sources}
    for b in sorted(buckets):
        tot = sum(buckets[b].values())
        for src in sources:
            out[src].append((lo + (b + 1) * span, buckets[b].get(src, 0) / tot))
    return out


def series(records: list[dict], key: str) -> list[tuple[float, float]]:
    return [(s, v) for s, v in ((_num(r.get("step")), _num(r.get(key))) for r in records) if s is not None and v is not None]


def val_by_source(val: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """The in-training held-out loss of each source at every eval point (``val`` records' per_source)."""
    out: dict[str, list[tuple[float, float]]] = {}
    for r in val:
        step = _num(r.get("step"))
        for src, v in (r.get("per_source") or {}).items():
            if step is not None and _num(v) is not None:
                out.setdefault(src, []).append((step, float(v)))
    return out


def in_order(d: dict, order: list[str]) -> dict:
    """``d`` with the names of ``order`` first, in that order, then the rest sorted."""
    return {k: d[k] for k in [*[o for o in order if o in d], *sorted(set(d) - set(order))]}


def loss_rows(train: list[dict]) -> tuple[list[str], list[tuple]]:
    """loss.csv: step,loss,smma; smma is the trainer's (Wilder's average in the train record), an
    empty cell where a record has none (an older run): never a value made up here. The column is
    always there, since DVC drops a whole plot whose declared field a file lacks."""
    rows = [(s, v, _num(r.get("smma"))) for r, s, v in ((r, _num(r.get("step")), _num(r.get("loss"))) for r in train)
            if s is not None and v is not None]
    return ["step", "loss", "smma"], [(s, v, "" if m is None else m) for s, v, m in rows]


def val_source_rows(val: list[dict], sources: list[str]) -> tuple[list[str], list[tuple]]:
    """val_per_source.csv: one column per source, every config source in its order (empty where it has
    no val record: DVC needs each declared field), then any other sorted; one row per eval point."""
    by = val_by_source(val)
    names = [*sources, *sorted(set(by) - set(sources))]
    steps = sorted({s for pts in by.values() for s, _ in pts})
    at = {n: dict(by.get(n, ())) for n in names}
    return ["step", *names], [(s, *(at[n].get(s, "") for n in names)) for s in steps]


# ------------------------------------------------------------------------- reports
def _csv(header: list[str], rows: list[tuple]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    for r in rows:
        w.writerow([f"{v:.6g}" if isinstance(v, float) else v for v in r])
    return buf.getvalue()


def _r(v, nd: int = 6):
    return None if v is None else round(float(v), nd)


# The eval outputs are DVC-tracked, so they hold only what the params determine (the same params
# give the same bytes); wall-clock figures live beside the run (andrea/runs.py, model.perf.jsonl).
THROUGHPUT = ("not in this report: throughput is a property of the machine, not of the params; "
              "see the live dashboard (andrea dashboard <run folder>) and the training log")


def build_metrics(ev: dict) -> dict:
    """metrics.json for ``dvc metrics show``: nested numbers only (no strings, no nulls)."""
    ho = ev["heldout"]
    m: dict = {"val_loss": _r(ho["overall"]["loss"]), "val_ppl": _r(ho["overall"]["ppl"], 4),
               "val_bpb": _r(ho["overall"]["bpb"]),
               "val_bytes_per_token": _r(ho["overall"]["bytes_per_token"]),
               "unigram_bpb": _r(ev["unigram"]["bpb"]), "step": ev["step"],
               "per_source": {s: {"loss": _r(p["loss"]), "ppl": _r(p["ppl"], 4), "bpb": _r(p["bpb"])}
                              for s, p in ho["per_source"].items()}}
    tr = ev["train"]
    if tr.get("final_loss") is not None:                # no throughput: DVC tracks this file (THROUGHPUT)
        m["train_final_loss"] = _r(tr["final_loss"], 4)
    m["train_bad_steps"] = int(tr["bad_steps"])
    m["halted"] = 1 if ev.get("halt") else 0
    if ev.get("coherence"):
        c = ev["coherence"]
        m["coherence"] = {k: c[k] for k in ("bigram", "trigram", "word", "char", "distinct_2", "flag_rate", "n_flagged")}
    if ev["judge"].get("mean_score") is not None:
        m["judge_score"] = ev["judge"]["mean_score"]
        m["judge_by_domain"] = ev["judge"]["by_domain"]
    return _drop_none(m)


def _drop_none(d):
    if isinstance(d, dict):
        return {k: _drop_none(v) for k, v in d.items() if v is not None and _drop_none(v) != {}}
    return d


def render_reports(ev: dict, hist: dict, sources: list[str] = ()) -> tuple[str, str]:
    """eval.html and eval.md; ``sources`` (the config's order) fixes each source's look in every figure."""
    from andrea.reports import render as R

    ho, uni = ev["heldout"], ev["unigram"]
    srcs = list(ho["per_source"])
    src_rows = [[s, p["loss"], p["ppl"], p["bpb"], p["bytes_per_token"], p["tokens"], p["windows"]]
                for s, p in ho["per_source"].items()]
    src_rows.append(["overall", ho["overall"]["loss"], ho["overall"]["ppl"], ho["overall"]["bpb"],
                     ho["overall"]["bytes_per_token"], ho["overall"]["tokens"],
                     sum(p["windows"] for p in ho["per_source"].values())])
    src_rows.append(["unigram baseline", uni["loss"], uni["ppl"], uni["bpb"], uni["bytes_per_token"], uni["tokens"], "-"])
    src_head = ["source", "loss (nats/token)", "perplexity", "bits/byte", "bytes/token", "tokens", "windows"]
    tr = ev["train"]
    summary_rows = [["checkpoint", f"{ev['checkpoint']} (step {ev['step']})"],
                    ["held-out loss, full eval (metrics.json val_loss)", R.fmt(ho["overall"]["loss"])],
                    ["held-out perplexity, full eval (metrics.json val_ppl)", R.fmt(ho["overall"]["ppl"])],
                    ["held-out bits/byte, full eval", R.fmt(ho["overall"]["bpb"])],
                    ["unigram baseline bits/byte", R.fmt(uni["bpb"])],
                    ["final train loss (mean of the last 5% of logged steps)", R.fmt(tr.get("final_loss"))],
                    ["throughput (tokens/s)", THROUGHPUT],
                    ["skipped (NaN/inf) steps", R.fmt(tr.get("bad_steps"))],
                    ["halt", ev["halt"]["reason"] if ev.get("halt") else "none"]]
    coh = ev.get("coherence")
    judge = ev["judge"]
    judge_line = (f"Judge: {judge['status']}" + (f" — model {judge['model']} at {judge['url']}, "
                                                 f"{judge['n_scored']} samples scored, mean {R.fmt(judge['mean_score'])}"
                                                 if judge.get("n_scored") else ""))
    coh_head = ["domain", "bigram", "trigram", "word", "char", "distinct-2", "flagged"]
    coh_rows = ([[d, s["bigram"], s["trigram"], s["word"], s["char"], s["distinct_2"], f"{s['n_flagged']}/{s['n_samples']}"]
                 for d, s in ev["coherence_by_domain"].items()] if coh else [])
    flags_rows = [[f["id"], f["domain"], f["sample"], "; ".join(f["flags"])] for f in ev["flags"]]
    judge_rows = [[d, v] for d, v in (judge.get("by_domain") or {}).items()]

    # --- figures: one look per source in every figure (config order, then any other name seen)
    seen = {str(r.get("source")) for r in hist["pulls"] if r.get("source") is not None} | set(srcs)
    seen |= {s for r in hist["val"] for s in (r.get("per_source") or {})}
    looks = R.source_styles(sources, seen)
    order = [*sources, *sorted(seen - set(sources))]
    train = hist["train"]
    smma_note = (" and its SMMA (the trainer's Wilder average, smma in the train records)"
                 if any(_num(r.get("smma")) is not None for r in train) else "")
    figs = [
        (f"Train loss: every logged step{smma_note} (training batches, not held out)",
         R.line_chart({"train loss": series(train, "loss"), "smma": series(train, "smma")}, title="train loss",
                      xlabel="step", ylabel="train loss (nats/token)", styles=R.LOSS_LOOKS)),
        ("Train loss EMA per source at each pull (the bandit's per-source EMA, bandit.ema, over that source's own "
         "training batches; train data, not held out)",
         R.line_chart(in_order(ema_at_pulls(hist["pulls"]), order), title="train loss EMA per source, at its pulls",
                      xlabel="step", ylabel="train loss EMA (nats/token)", styles=looks)),
        ("Held-out loss per source during training: the in-training estimate (train.eval_batches batches per "
         "source at every train.eval_every steps; val_loss.csv), not the full eval above",
         R.line_chart({"overall": series(hist["val"], "loss"), **in_order(val_by_source(hist["val"]), order)},
                      title="held-out loss per source", xlabel="step", ylabel="held-out loss (nats/token)",
                      styles=looks)),
        ("Bandit pull shares over time",
         R.line_chart(in_order(pull_shares(hist), order), title="share of pulls per source", xlabel="step",
                      ylabel="share", y_min=0.0, y_max=1.0, styles=looks)),
        ("Learning rate", R.line_chart({"lr": series(train, "lr")}, title="learning rate", xlabel="step",
                                       ylabel="lr")),
        ("Bits per byte per source (final checkpoint, held-out)",
         R.bar_chart({**{s: ho["per_source"][s]["bpb"] for s in in_order(ho["per_source"], order)},
                      "overall": ho["overall"]["bpb"],
                      "unigram": uni["bpb"]}, title="held-out bits per byte", ylabel="bits/byte", styles=looks)),
    ]
    sections = [("Summary", R.html_table(["item", "value"], summary_rows)),
                ("Held-out loss and bits per byte", R.html_table(src_head, src_rows)
                 + '<p class="note">perplexity = exp(loss), the loss in nats per token; bits/byte = sum of token '
                   'NLL (nats) / (UTF-8 bytes of those tokens x ln 2), comparable across tokenizers.</p>')]
    sections += [(t, f"<figure>{svg}</figure>") for t, svg in figs]
    sections.append(("Coherence (audit, final checkpoint)",
                     (R.html_table(coh_head, coh_rows) if coh else '<p class="note">no audit given</p>')
                     + (R.html_table(["prompt", "domain", "sample", "flags"], flags_rows) if flags_rows
                        else '<p>No audit sample was flagged.</p>' if coh else "")))
    sections.append(("External judge", f"<p>{R.esc(judge_line)}</p>"
                     + (R.html_table(["domain", "mean score (0-10)"], judge_rows) if judge_rows else "")))
    events = [[e.get("step"), e.get("kind"), e.get("detail")] for e in hist["events"]]
    if events:
        sections.append(("Run events", R.html_table(["step", "kind", "detail"], events[-50:])))
    title = f"ANDREA eval: {ev['run']}"
    html = R.html_page(title, sections, subtitle=f"profile {ev['profile']}, tokenizer {ev['tokenizer_sha256'][:12]}")

    md = [f"# {title}", "", R.md_table(["item", "value"], summary_rows), "", "## Held-out loss and bits per byte", "",
          R.md_table(src_head, src_rows), "",
          "perplexity = exp(loss in nats per token).", "",
          "Figures (train loss and SMMA, per-source train EMA and held-out loss, bandit pull shares, learning rate, "
          "bits/byte per source) are in eval.html.",
          "", "## Coherence (audit, final checkpoint)", ""]
    if coh:
        md += [R.md_table(coh_head, coh_rows), ""]
        md += ([R.md_table(["prompt", "domain", "sample", "flags"], flags_rows)] if flags_rows
               else ["No audit sample was flagged."]) + [""]
    else:
        md += ["No audit given.", ""]
    md += ["## External judge", "", judge_line, ""]
    if judge_rows:
        md += [R.md_table(["domain", "mean score (0-10)"], judge_rows), ""]
    return html, "\n".join(md).rstrip() + "\n"


def run_judge(cfg: dict, audit: dict | None, cache_dir: str | None, progress=None) -> dict:
    from andrea.reports.judge import Judge

    j = Judge.from_cfg(cfg, cache_dir)
    out: dict = {}
    if j.enabled and audit is None:
        j.status = "not run: no audit samples to score"
    if j.enabled and audit is not None:
        final = next(c for c in audit["checkpoints"] if c["final"])
        scores: dict[str, list[int]] = {}
        task = progress.add_task("judge", total=len(final["samples"])) if progress else None
        for s in final["samples"]:
            r = j.score(s["domain"], s.get("input", s["prompt"]), s["text"])     # the whole rendered conversation
            if r is None and not j.enabled:
                break
            if r is not None and r["score"] is not None:
                scores.setdefault(s["domain"], []).append(r["score"])
            if progress:
                progress.advance(task)
        allv = [v for vs in scores.values() for v in vs]
        if allv:
            out = {"n_scored": len(allv), "mean_score": round(float(np.mean(allv)), 4),
                   "by_domain": {d: round(float(np.mean(v)), 4) for d, v in sorted(scores.items())}}
    return {**j.describe(), **out}


def add_arguments(p) -> None:
    p.add_argument("--run", required=True, help="run folder with the final model.bin and model.loss.json")
    p.add_argument("--tokenizer", required=True, help="the run's tokenizer.json")
    p.add_argument("--tokens", required=True, help="token shard folder (uses its val/ and train/ splits)")
    p.add_argument("--audit", default=None, help="audit.json from `andrea audit` (coherence, flags, judge samples)")
    p.add_argument("--out", required=True,
                   help="report folder: eval.html, eval.md, metrics.json, loss.csv, val_loss.csv, val_per_source.csv")
    p.add_argument("--judge-cache", default=".cache/andrea-judge", help="judge answer cache (default: %(default)s)")


def run(args, cfg) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from andrea.backends import select_backend
    from andrea.engine.checkpoint import read_weights
    from andrea.fsutil import read_json
    from andrea.engine.engine import Engine
    from andrea.generate import load_model
    from andrea.reports.render import fmt

    console = Console(stderr=True)
    run_dir, out, tokens = Path(args.run), Path(args.out), Path(args.tokens)
    audit = None
    if args.audit:
        audit = read_json(args.audit, "audit")
        if audit.get("format") != "andrea.audit/1":
            raise AndreaError(f"{args.audit}: not an audit (format {audit.get('format')!r})")
    settings = Settings.from_dict(cfg)
    be, why = select_backend(settings.train.backend)
    lm = load_model(run_dir, args.tokenizer, cfg)
    if audit is not None and audit.get("tokenizer_sha256") != lm.tokenizer.sha256:
        raise AndreaError(f"{args.audit}: made with tokenizer {str(audit.get('tokenizer_sha256'))[:12]}..., "
                          f"not {args.tokenizer} ({lm.tokenizer.sha256[:12]}...)")
    tok = lm.tokenizer
    byte_len = np.array([len(tok.token_bytes(i)) for i in range(tok.vocab_size)], dtype=np.int64)
    val = val_shards(tokens, "val")
    for src, sh in val.items():
        if sh.vocab_size != tok.vocab_size:
            raise AndreaError(f"{sh.path}: vocab_size {sh.vocab_size} in the shard, {tok.vocab_size} in {args.tokenizer}")
    eng = Engine(lm.config, batch_size=settings.train.batch_size, backend=be)
    _, w = read_weights(lm.checkpoint, eng.n_params)
    be.copy_from_host(eng.w, w)
    max_b = settings.eval.max_batches
    with Progress(console=console) as progress:
        ho = heldout(eng, val, byte_len, tok.eot_id, max_b, progress)
        train_sh = val_shards(tokens, "train") if (tokens / "train").is_dir() else {}
        uni = unigram_baseline(train_sh, val, tok.vocab_size, byte_len, eng.T, max_b * eng.B) if train_sh else \
            _figures(0.0, 0, 0)
        judge = run_judge(cfg, audit, args.judge_cache, progress)
    hist = load_history(run_dir)
    train = hist["train"]
    tail = [r for r in train[-max(1, len(train) // 20):] if _num(r.get("loss")) is not None]
    bad = sum(1 for e in hist["events"] if e.get("kind") in ("bad_step", "nan", "skip"))
    state = lm.state or {}
    ev = {
        "format": FORMAT, "run": args.run, "profile": settings.profile, "checkpoint": lm.checkpoint.name,
        "step": lm.step, "tokenizer_sha256": tok.sha256, "backend": be.name,
        "heldout": ho, "unigram": uni,
        "train": {"records": len(train), "final_loss": float(np.mean([float(r["loss"]) for r in tail])) if tail else None,
                  "bad_steps": bad},
        "halt": state.get("halt"),
        "coherence": audit["final"]["summary"] if audit else None,
        "coherence_by_domain": audit["final"]["by_domain"] if audit else {},
        "flags": audit["flags"] if audit else [],
        "judge": judge,
    }
    from andrea.reports.render import config_sources

    sources = config_sources(cfg)
    html, md = render_reports(ev, hist, sources)
    atomic_write_text(out / "eval.html", html)
    atomic_write_text(out / "eval.md", md)
    atomic_write_json(out / "metrics.json", build_metrics(ev))
    atomic_write_text(out / "loss.csv", _csv(*loss_rows(train)))
    atomic_write_text(out / "val_loss.csv", _csv(["step", "val_loss"], series(hist["val"], "loss")))
    atomic_write_text(out / "val_per_source.csv", _csv(*val_source_rows(hist["val"], sources)))
    o = ho["overall"]
    console.print(f"eval: step {lm.step}: held-out loss {o['loss']:.4f} nats/token (perplexity {fmt(o['ppl'])}), "
                  f"{o['bpb']:.4f} bits/byte "
                  f"(unigram {fmt(uni['bpb'])}); judge: {judge['status']} -> {out}/eval.html, metrics.json")
    return 0

