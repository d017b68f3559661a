"""`andrea diet-alignment`: measure the tokenizer against the data diet; write the token shards.

    andrea diet-alignment --profile tiny --tokenizer data/tokenizer/tiny/tokenizer.json \\
        --megachat data/megachat/embedded --tokens data/tokens/tiny --report reports/tiny

Reads ``<megachat>/train.parquet`` and ``<megachat>/val.parquet`` (columns ``source``,
``kind``, ``doc_id``, ``text``), encodes every document in row order and writes, per split
and source, ``<tokens>/<split>/<source>.bin`` (``andrea.shards``: each document followed by
the end-of-text id, plus document offsets). The whole ``<tokens>`` folder is replaced
atomically, so a failed run leaves the previous shards in place.

Per source it measures bytes, tokens, bytes/token, byte-fallback rate (share of bytes
sent as single-byte tokens; non-ASCII bytes separately), the share of the N morphemes
used, and the top morphemes. The saturation curve trains tokenizers of every size in
``diet.sweep`` (as the tokenizer stage would) on a sample of the train split (the documents with the smallest doc_id
hashes, up to ``diet.max_sample_bytes``: a uniform sample whatever the row order) and
measures bytes/token on a held-out sample of val; the saturation point is the first N
whose next doubling gains less than ``diet.saturation_gain``. A source whose bytes/token
falls below ``diet.warn_ratio`` x the corpus's, or whose share of bytes sent as
non-ASCII single-byte ids (UTF-8 pieces of characters no morpheme covers) exceeds
``diet.warn_fallback``, is flagged as served badly. (ASCII punctuation and spaces also
travel as single-byte ids; they count in ``byte_fallback_rate`` but not in the warning.)

Writes ``<report>/diet.json`` and ``<report>/diet.md``. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import math
import re
import sys
from pathlib import Path

import numpy as np

from andrea.errors import AndreaError
from andrea.fsutil import atomic_dir, atomic_write_json, atomic_write_text
from andrea.shards import ShardWriter
from andrea.tokenizer import Tokenizer, load
from andrea.tokenizer.harris import select_morphemes, train_ranking, utf8
from andrea.tokenizer.stage import iter_parquet_texts

FORMAT = "andrea.diet/1"
SPLITS = ("train", "val")
COLUMNS = ("source", "kind", "doc_id", "text")
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
FLUSH_TOKENS = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", required=True, help="tokenizer.json from `andrea tokenizer`")
    p.add_argument("--megachat", required=True, help="folder with train.parquet and val.parquet")
    p.add_argument("--tokens", required=True, help="output folder for token shards: <split>/<source>.bin")
    p.add_argument("--report", required=True, help="output folder for diet.json and diet.md")


# ----------------------------------------------------------------------------- measuring


class SourceStats:
    """Running counts for one (split, source): docs, bytes, tokens, fallback, id histogram (V,)."""

    def __init__(self, kind: str, vocab_size: int):
        self.kind = kind
        self.docs = self.bytes = self.tokens = self.fallback = self.fallback_nonascii = 0
        self.hist = np.zeros(vocab_size, dtype=np.int64)
        self._pending: list[np.ndarray] = []
        self._pending_n = 0

    def add(self, n_bytes: int, ids: np.ndarray) -> None:
        self.docs += 1
        self.bytes += n_bytes
        self.tokens += int(ids.size)
        self._pending.append(ids)
        self._pending_n += ids.size
        if self._pending_n >= FLUSH_TOKENS:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            self.hist += np.bincount(np.concatenate(self._pending), minlength=self.hist.size)
            self._pending, self._pending_n = [], 0
        self.fallback = int(self.hist[:256].sum())
        self.fallback_nonascii = int(self.hist[128:256].sum())

    def merge(self, other: "SourceStats") -> None:
        self.flush()
        other.flush()
        self.docs += other.docs
        self.bytes += other.bytes
        self.tokens += other.tokens
        self.hist += other.hist
        self.flush()


def summarize(st: SourceStats, tok: Tokenizer, top_k: int) -> dict:
    st.flush()
    morph = st.hist[256:tok.eot_id]
    order = np.lexsort((np.arange(morph.size), -morph))[:top_k]
    top = [{"id": int(i) + 256, "morpheme": tok.token_bytes(int(i) + 256).decode("utf-8", "replace"),
            "count": int(morph[i]), "share": round(float(morph[i]) / max(st.tokens, 1), 6)}
           for i in order if morph[i] > 0]
    return {"kind": st.kind, "docs": st.docs, "bytes": st.bytes, "tokens": st.tokens,
            "bytes_per_token": round(st.bytes / st.tokens, 6) if st.tokens else None,
            "byte_fallback_rate": round(st.fallback / st.bytes, 6) if st.bytes else None,
            "nonascii_fallback_rate": round(st.fallback_nonascii / st.bytes, 6) if st.bytes else None,
            "vocab_used": int((morph > 0).sum()),
            "vocab_share_used": round(float((morph > 0).mean()), 6) if morph.size else 0.0,
            "top_morphemes": top}


class HashSample:
    """A uniform sample of documents within a byte budget: the smallest sha256(doc_id) win."""

    def __init__(self, budget: int):
        self.budget = int(budget)
        self.n_bytes = 0
        self._heap: list[tuple[int, str, str, int]] = []  # (-key, source, text, bytes)

    def offer(self, doc_id: str, source: str, text: str, n_bytes: int) -> None:
        key = int.from_bytes(hashlib.sha256(doc_id.encode("utf-8", "surrogatepass")).digest()[:8], "big")
        if self.n_bytes >= self.budget and self._heap and key >= -self._heap[0][0]:
            return
        heapq.heappush(self._heap, (-key, source, text, n_bytes))
        self.n_bytes += n_bytes
        while self.n_bytes - self._heap[0][3] >= self.budget and len(self._heap) > 1:
            self.n_bytes -= heapq.heappop(self._heap)[3]

    def docs(self) -> list[tuple[str, str, int]]:
        """(source, text, bytes) in hash order: deterministic whatever the row order was."""
        return [(s, t, b) for _, s, t, b in sorted(self._heap, reverse=True)]


def saturation(points: list[dict], gain: float) -> tuple[int | None, list[dict]]:
    """Gain per doubling between consecutive sweep points; the first N whose next step gains < ``gain``."""
    steps, sat = [], None
    for a, b in zip(points, points[1:]):
        doublings = math.log2(b["n"] / a["n"])
        g = (b["bytes_per_token"] / a["bytes_per_token"]) ** (1.0 / doublings) - 1.0
        steps.append({"from": a["n"], "to": b["n"], "gain_per_doubling": round(g, 6)})
        if sat is None and g < gain:
            sat = a["n"]
    return sat, steps


def knee(steps: list[dict]) -> int | None:
    """Where diminishing returns set in: the smallest N past which every doubling gains less
    than the one before (None when the last doubling still gained more than the previous one)."""
    k = len(steps) - 1
    while k > 0 and steps[k - 1]["gain_per_doubling"] > steps[k]["gain_per_doubling"]:
        k -= 1
    return steps[k]["to"] if 0 <= k < len(steps) - 1 else None


def sweep_curve(train_docs, eval_docs, sizes, tcfg: dict, progress=None) -> dict:
    """Compression against N: one Harris ranking of the train sample; for every n its n most
    useful candidates, selected as the tokenizer stage does (``tokenizer.refine_rounds``)."""
    ranking = train_ranking((t for _, t, _ in train_docs), max_morpheme_len=int(tcfg["max_morpheme_len"]),
                            min_count=int(tcfg["min_count"]), max_word_types=int(tcfg["max_word_types"]))
    eval_bytes: dict[str, int] = {}
    for s, _, b in eval_docs:
        eval_bytes[s] = eval_bytes.get(s, 0) + b
    points, skipped = [], []
    for n in sorted(set(int(x) for x in sizes)):
        if n > len(ranking.morphemes):
            skipped.append(n)
            continue
        tok = Tokenizer(select_morphemes(ranking, n, int(tcfg["refine_rounds"])).morphemes)
        per: dict[str, int] = {}
        for s, t, _ in eval_docs:
            per[s] = per.get(s, 0) + len(tok.encode(t))
        total = sum(per.values())
        points.append({"n": n, "vocab_size": tok.vocab_size,
                       "bytes_per_token": round(sum(eval_bytes.values()) / max(total, 1), 6),
                       "per_source": {s: round(eval_bytes[s] / max(per[s], 1), 6) for s in sorted(per)}})
        if progress:
            progress()
    return {"points": points, "skipped_sizes": skipped, "candidates": len(ranking.morphemes),
            "sample_train_bytes": ranking.stats["train_bytes"], "sample_eval_bytes": sum(eval_bytes.values())}


# ----------------------------------------------------------------------------- the stage


def _shard_pass(tok: Tokenizer, megachat: Path, tokens_tmp: Path, top_k: int, samples: dict, bar) -> dict:
    """Encode every document, write shards, return {split: {source: SourceStats}}."""
    import pyarrow.parquet as pq

    stats: dict[str, dict[str, SourceStats]] = {}
    for split in SPLITS:
        path = megachat / f"{split}.parquet"
        if not path.is_file():
            raise AndreaError(f"{path}: megachat {split} split not found (run `andrea prep-megachat` first)")
        try:
            total = pq.ParquetFile(path).metadata.num_rows
        except Exception as e:
            raise AndreaError(f"{path}: not a readable Parquet file: {e}") from None
        task = bar.add_task(f"encode {split}", total=total)
        writers: dict[str, ShardWriter] = {}
        per: dict[str, SourceStats] = {}
        try:
            for row, (source, kind, doc_id, text) in enumerate(iter_parquet_texts(path, COLUMNS)):
                if source not in writers:
                    if not SAFE_NAME.match(source):
                        raise AndreaError(f"{path}: row {row} source {source!r} is not usable as a file name")
                    writers[source] = ShardWriter(tokens_tmp / split / f"{source}.bin", tok.vocab_size, tok.eot_id)
                    per[source] = SourceStats(kind, tok.vocab_size)
                ids = tok.encode(text)
                n_bytes = len(utf8(text))
                writers[source].add(ids)
                per[source].add(n_bytes, ids)
                samples[split].offer(doc_id, source, text, n_bytes)
                if row % 256 == 0:
                    bar.update(task, completed=row)
            for w in writers.values():
                w.close()
        except BaseException:
            for w in writers.values():
                w.abort()
            raise
        bar.update(task, completed=total)
        stats[split] = {s: per[s] for s in sorted(per)}
    return stats


def run(args: argparse.Namespace, cfg: dict) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    dcfg, tcfg = cfg["diet"], cfg["tokenizer"]
    tok = load(args.tokenizer)
    megachat = Path(args.megachat)
    console = Console(stderr=True)
    top_k = int(dcfg["top_morphemes"])
    samples = {"train": HashSample(int(dcfg["max_sample_bytes"])),
               "val": HashSample(max(1, int(dcfg["max_sample_bytes"]) // 4))}
    with Progress(TextColumn("diet {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=not sys.stderr.isatty()) as bar:
        with atomic_dir(args.tokens) as tmp:
            tmp.chmod(0o755)  # mkdtemp makes it 0700; the result is an ordinary output folder
            stats = _shard_pass(tok, megachat, tmp, top_k, samples, bar)
        eval_docs = samples["val"].docs() or samples["train"].docs()
        task = bar.add_task("saturation sweep", total=len(dcfg["sweep"]))
        sweep = sweep_curve(samples["train"].docs(), eval_docs, dcfg["sweep"], tcfg,
                            progress=lambda: bar.advance(task))
    sweep["eval_split"] = "val" if samples["val"].docs() else "train"
    sat, steps = saturation(sweep["points"], float(dcfg["saturation_gain"]))
    sweep.update({"saturation_n": sat, "saturation_gain": float(dcfg["saturation_gain"]), "steps": steps,
                  "knee_n": knee(steps)})

    # per source over both splits, and the corpus
    merged: dict[str, SourceStats] = {}
    corpus = SourceStats("all", tok.vocab_size)
    for split in SPLITS:
        for s, st in stats[split].items():
            if s not in merged:
                merged[s] = SourceStats(st.kind, tok.vocab_size)
            merged[s].merge(st)
            corpus.merge(st)
    overall = summarize(corpus, tok, top_k)
    sources = {s: summarize(st, tok, top_k) for s, st in sorted(merged.items())}
    warnings = []
    for s, d in sources.items():
        why = []
        if d["bytes_per_token"] is not None and overall["bytes_per_token"] and \
                d["bytes_per_token"] < float(dcfg["warn_ratio"]) * overall["bytes_per_token"]:
            why.append(f"bytes/token {d['bytes_per_token']:.2f} < {dcfg['warn_ratio']} x corpus "
                       f"{overall['bytes_per_token']:.2f}")
        if d["nonascii_fallback_rate"] is not None and d["nonascii_fallback_rate"] > float(dcfg["warn_fallback"]):
            why.append(f"non-ASCII byte fallback {d['nonascii_fallback_rate']:.1%} > {float(dcfg['warn_fallback']):.0%}")
        d["served_badly"] = bool(why)
        if why:
            warnings.append({"source": s, "reason": "; ".join(why)})
            console.print(f"[yellow]diet-alignment: warning: source {s!r} is served badly by the tokenizer: "
                          f"{'; '.join(why)}[/yellow]")
    splits = {split: {s: {k: v for k, v in summarize(st, tok, 0).items() if k != "top_morphemes"}
                      for s, st in stats[split].items()} for split in SPLITS}
    report = {"format": FORMAT, "profile": cfg.get("profile"),
              "tokenizer": {"path": str(args.tokenizer), "sha256": tok.sha256, "n_morphemes": tok.n_morphemes,
                            "vocab_size": tok.vocab_size, "eot_id": tok.eot_id},
              "megachat": str(megachat), "tokens": str(args.tokens),
              "definitions": {"bytes_per_token": "UTF-8 bytes / tokens (end-of-text not counted)",
                              "byte_fallback_rate": "share of bytes encoded as single-byte ids 0-255",
                              "nonascii_fallback_rate": "share of bytes encoded as single-byte ids 128-255",
                              "vocab_share_used": "share of the N morpheme ids that occur at least once"},
              "overall": overall, "sources": sources, "splits": splits, "sweep": sweep, "warnings": warnings}
    out = Path(args.report)
    atomic_write_json(out / "diet.json", report)
    atomic_write_text(out / "diet.md", render_md(report))
    console.print(f"diet-alignment: {len(sources)} sources, {overall['tokens']:,} tokens, "
                  f"{overall['bytes_per_token']} bytes/token, saturation at N={sat if sat is not None else 'not reached'}"
                  f" -> {out / 'diet.md'}")
    return 0


def _esc(s: str) -> str:
    return (s.encode("unicode_escape").decode("ascii").replace("|", "\\|").replace("`", "'")
            .replace(" ", "\u2423"))


def render_md(r: dict) -> str:
    t, o, sw = r["tokenizer"], r["overall"], r["sweep"]
    lines = [f"# Diet alignment ({r['profile']})", "",
             f"Tokenizer `{t['path']}` (N={t['n_morphemes']}, vocab {t['vocab_size']}, sha256 `{t['sha256'][:16]}`) "
             f"on `{r['megachat']}`. Corpus: {o['bytes']:,} bytes, {o['tokens']:,} tokens, "
             f"**{o['bytes_per_token']} bytes/token**, byte fallback {o['byte_fallback_rate']:.2%}, "
             f"{o['vocab_share_used']:.1%} of the morphemes used.", "",
             "## Per source (train + val)", "",
             "| source | kind | docs | bytes | tokens | bytes/token | byte fallback | non-ASCII fallback | vocab used | |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s, d in r["sources"].items():
        lines.append(f"| {s} | {d['kind']} | {d['docs']:,} | {d['bytes']:,} | {d['tokens']:,} | {d['bytes_per_token']} | "
                     f"{d['byte_fallback_rate']:.2%} | {d['nonascii_fallback_rate']:.2%} | {d['vocab_share_used']:.1%} | "
                     f"{'**served badly**' if d['served_badly'] else ''} |")
    lines += ["", "## Saturation curve", "",
              f"Tokenizers trained on {sw['sample_train_bytes']:,} sampled train bytes, measured on "
              f"{sw['sample_eval_bytes']:,} sampled {sw['eval_split']} bytes.", "",
              "| N | vocab | bytes/token | gain to next (per doubling) |", "|---:|---:|---:|---:|"]
    gains = {st["from"]: st["gain_per_doubling"] for st in sw["steps"]}
    for p in sw["points"]:
        g = gains.get(p["n"])
        lines.append(f"| {p['n']} | {p['vocab_size']} | {p['bytes_per_token']} | {'' if g is None else f'{g:+.2%}'} |")
    if sw["skipped_sizes"]:
        lines.append(f"\nSkipped (the sample yields only {sw['candidates']} candidates): {sw['skipped_sizes']}")
    sat = sw["saturation_n"]
    if sw.get("knee_n") is not None:
        lines += ["", f"Diminishing returns from N = {sw['knee_n']}: past it every doubling gains less than the one before."]
    lines += ["", f"**Saturation point: N = {sat}** (the next doubling gains < {sw['saturation_gain']:.1%})." if sat
              is not None else f"**No saturation** within the sweep (every doubling gains >= {sw['saturation_gain']:.1%}).", ""]
    if r["warnings"]:
        lines += ["## Warnings", ""] + [f"- `{w['source']}`: {w['reason']}" for w in r["warnings"]] + [""]
    lines += ["## Top morphemes per source", ""]
    for s, d in r["sources"].items():
        tops = ", ".join(f"`{_esc(m['morpheme'])}` {m['share']:.1%}" for m in d["top_morphemes"])
        lines.append(f"- **{s}**: {tops or '(none)'}")
    return "\n".join(lines) + "\n"
