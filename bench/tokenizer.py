"""Tokenizer speed: the Harris morpheme tokenizer against HF `tokenizers` BPE (the anchor).

    python bench/tokenizer.py                          # >= 100 MB corpus, N = 4096 (vocab 4353)
    python bench/tokenizer.py --mb 20 --encode-mb 5    # a quick look

1. Corpus: a megachat-shaped Parquet (columns source, kind, doc_id, text) of at least
   ``--mb`` MB, cached in ``bench/out/``. It is recombined, with a seeded RNG, from the
   embedded corpus (``data/embedded``, its chats rendered by ``andrea.data.template``):
   each new document joins blocks drawn from several documents of one source --
   paragraphs for prose, blank-line separated blocks for code, turns for chats (an
   optional system turn, then 1-4 user/assistant pairs) -- so no file is repeated verbatim.
   Without ``data/embedded`` the same is done with the docstrings and sources of the
   running CPython's standard library.
2. Training, each in its own process (peak RSS = that process's VmHWM): ours
   (``andrea.tokenizer.stage.train_from_parquet``, streaming word counts, then 4 refine
   rounds as in params.yaml) and HF BPE with
   a byte-level pre-tokenizer trained to the same vocabulary size (256 + N + 1) from an
   iterator over the same Parquet batches.
3. Encoding, each in its own process, single core (``RAYON_NUM_THREADS=1``,
   ``TOKENIZERS_PARALLELISM=false``): the last ``--encode-mb`` MB of documents, which
   both tokenizers saw in training; ours ``tok.encode(doc)`` per document from a cold
   word cache, the anchor ``encode_batch(docs)``. Bytes/token is printed too. A last
   row encodes ~2 MB of seeded pseudo-words, every one unseen: the worst case for a
   word cache (each word goes through the dynamic program once).

Prints a table and the ratios ours/anchor (encode: higher is better; train time and
memory: lower is better) and writes ``bench/out/tokenizer.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"


# ----------------------------------------------------------------------------- corpus


def _embedded_blocks(folder: Path) -> dict[str, tuple[str, list]]:
    import pyarrow.parquet as pq

    from andrea.data.template import render_turn

    out = {}
    for f in sorted(folder.glob("*.parquet")):
        t = pq.read_table(f)
        if "conversations" in t.schema.names:
            convs = t.column("conversations").to_pylist()
            systems = [c[0]["value"] for c in convs if c and c[0]["from"] == "system"]
            pairs = []
            for c in convs:
                turns = [x for x in c if x["from"] != "system"]
                pairs += [(turns[i]["value"], turns[i + 1]["value"]) for i in range(0, len(turns) - 1, 2)]
            out[f.stem] = ("chat", [systems, pairs, render_turn])
        else:
            texts = t.column("text").to_pylist()
            kind = "code" if "code" in f.stem else "prose"
            blocks = [b for x in texts for b in x.split("\n\n") if b.strip()]
            out[f.stem] = (kind, blocks)
    return out


def _cpython_blocks() -> dict[str, tuple[str, list]]:
    import ast
    import sysconfig

    from andrea.data.template import render_turn

    lib = Path(sysconfig.get_paths()["stdlib"])
    prose, code, pairs = [], [], []
    for f in sorted(lib.glob("*.py")):
        src = f.read_text(encoding="utf-8", errors="replace")
        code += [b for b in src.split("\n\n") if b.strip()]
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and ast.get_docstring(n):
                doc = ast.get_docstring(n)
                prose += [b for b in doc.split("\n\n") if b.strip()]
                pairs.append((f"What does {f.stem}.{n.name} do?", doc))
    return {"py-prose": ("prose", prose), "py-code": ("code", code),
            "chat-api": ("chat", [["You are a helpful assistant."], pairs, render_turn])}


def make_corpus(mb: int, seed: int, path: Path) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    emb = ROOT / "data" / "embedded"
    blocks = _embedded_blocks(emb) if any(emb.glob("*.parquet")) else _cpython_blocks()
    origin = "data/embedded" if any(emb.glob("*.parquet")) else "cpython stdlib"
    rng = random.Random(seed)
    names = sorted(blocks)
    target = mb * 1_000_000
    rows = {"source": [], "kind": [], "doc_id": [], "text": []}
    total = 0
    while total < target:
        name = rng.choice(names)
        kind, data = blocks[name]
        if kind == "chat":
            systems, pairs, render_turn = data
            parts = [render_turn("system", rng.choice(systems))] if systems and rng.random() < 0.4 else []
            for _ in range(rng.randint(1, 4)):
                q, a = rng.choice(pairs)
                parts += [render_turn("human", q), render_turn("gpt", a)]
            text = "".join(parts)
        else:
            k = rng.randint(2, 12)
            text = "\n\n".join(rng.choice(data) for _ in range(k)) + "\n"
        rows["source"].append(name)
        rows["kind"].append(kind)
        rows["doc_id"].append(hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16])
        rows["text"].append(text)
        total += len(text.encode("utf-8", "surrogatepass"))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    pq.write_table(pa.table(rows), tmp, row_group_size=4096)
    os.replace(tmp, path)
    return {"origin": origin, "bytes": total, "docs": len(rows["text"]), "sources": names}


# ----------------------------------------------------------------------------- workers


def _rss_mb() -> float:
    """Peak resident set of this process (VmHWM: unlike ru_maxrss it does not inherit the parent's peak)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _texts(path: Path):
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=2048, columns=["text"]):
        yield from batch.column(0).to_pylist()


def _encode_docs(path: Path, mb: float) -> list[str]:
    import pyarrow.parquet as pq

    texts = pq.read_table(path, columns=["text"]).column(0).to_pylist()
    out, n = [], 0
    for t in reversed(texts):
        if n >= mb * 1_000_000:
            break
        out.append(t)
        n += len(t.encode("utf-8", "surrogatepass"))
    return out[::-1]


def worker(kind: str, corpus: Path, n: int, tok_path: Path, encode_mb: float) -> dict:
    base = _rss_mb()
    if kind == "ours-train":
        from andrea.tokenizer.harris import Tokenizer
        from andrea.tokenizer.stage import train_from_parquet

        t0 = time.perf_counter()
        ranking = train_from_parquet(corpus, {"max_morpheme_len": 16, "min_count": 5, "max_word_types": 2_000_000},
                                     max_bytes=1 << 62)
        tok = Tokenizer.from_ranking(ranking, n, refine_rounds=4)
        dt = time.perf_counter() - t0
        tok_path.write_text(tok.dumps(), encoding="utf-8")
        return {"seconds": dt, "peak_rss_mb": _rss_mb(), "base_rss_mb": base, "vocab_size": tok.vocab_size,
                "train_bytes": ranking.stats["train_bytes"], "word_types": ranking.stats["word_types"]}
    if kind == "hf-train":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        t0 = time.perf_counter()
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=n + 257, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=["<|endoftext|>"], show_progress=False)
        tok.train_from_iterator(_texts(corpus), trainer)
        dt = time.perf_counter() - t0
        tok.save(str(tok_path))
        return {"seconds": dt, "peak_rss_mb": _rss_mb(), "base_rss_mb": base, "vocab_size": tok.get_vocab_size()}
    if kind.endswith("-unseen"):
        # worst case for a word cache: every word is new (seeded pseudo-words, ~2 MB)
        rng = random.Random(0)
        letters = "abcdefghijklmnopqrstuvwxyz"
        docs = [" ".join("".join(rng.choice(letters) for _ in range(rng.randint(3, 12))) for _ in range(1000))
                for _ in range(250)]
    else:
        docs = _encode_docs(corpus, encode_mb)
    n_bytes = sum(len(d.encode("utf-8", "surrogatepass")) for d in docs)
    if kind.startswith("ours-"):
        from andrea.tokenizer import load

        tok = load(tok_path)
        t0 = time.perf_counter()
        n_tok = sum(len(tok.encode(d)) for d in docs)
        dt = time.perf_counter() - t0
        ok = all(tok.decode(tok.encode(d)) == d for d in docs[:200])
    else:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tok_path))
        t0 = time.perf_counter()
        n_tok = sum(len(e.ids) for e in tok.encode_batch(docs))
        dt = time.perf_counter() - t0
        ok = all(tok.decode(tok.encode(d).ids) == d for d in docs[:200])
    return {"seconds": dt, "bytes": n_bytes, "tokens": n_tok, "mb_per_s": n_bytes / dt / 1e6,
            "bytes_per_token": n_bytes / n_tok, "round_trip_200_docs": ok, "peak_rss_mb": _rss_mb()}


def _spawn(kind: str, corpus: Path, n: int, tok_path: Path, encode_mb: float) -> dict:
    env = dict(os.environ, RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONHASHSEED="0")
    cmd = [sys.executable, __file__, "--worker", kind, "--corpus", str(corpus), "--n", str(n),
           "--tok", str(tok_path), "--encode-mb", str(encode_mb)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"bench worker {kind} failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=100, help="corpus size in MB (default: %(default)s)")
    ap.add_argument("--encode-mb", type=float, default=20.0, help="MB of documents to encode (default: %(default)s)")
    ap.add_argument("--n", type=int, default=4096, help="morphemes N; vocab = 256 + N + 1 (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    ap.add_argument("--tok", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, Path(a.corpus), a.n, Path(a.tok), a.encode_mb)))
        return 0

    corpus = OUT / f"tokenizer_corpus_{a.mb}mb_s{a.seed}.parquet"
    meta_path = corpus.with_suffix(".json")
    if not corpus.is_file() or not meta_path.is_file():
        print(f"building {a.mb} MB corpus -> {corpus}", file=sys.stderr)
        meta_path.parent.mkdir(parents=True, exist_ok=True)
        meta_path.write_text(json.dumps(make_corpus(a.mb, a.seed, corpus)))
    meta = json.loads(meta_path.read_text())
    print(f"corpus: {meta['bytes'] / 1e6:.1f} MB, {meta['docs']:,} docs from {meta['origin']} "
          f"({', '.join(meta['sources'])})", file=sys.stderr)
    ours_tok, hf_tok = OUT / "bench_harris.json", OUT / "bench_hf_bpe.json"
    r = {}
    for kind, tp in [("ours-train", ours_tok), ("hf-train", hf_tok), ("ours-encode", ours_tok), ("hf-encode", hf_tok),
                     ("ours-unseen", ours_tok), ("hf-unseen", hf_tok)]:
        print(f"running {kind} ...", file=sys.stderr)
        r[kind] = _spawn(kind, corpus, a.n, tp, a.encode_mb)
    rows = [("train time (s)", r["ours-train"]["seconds"], r["hf-train"]["seconds"], "lower"),
            ("train peak RSS (MB)", r["ours-train"]["peak_rss_mb"], r["hf-train"]["peak_rss_mb"], "lower"),
            ("encode MB/s (1 core)", r["ours-encode"]["mb_per_s"], r["hf-encode"]["mb_per_s"], "higher"),
            ("encode bytes/token", r["ours-encode"]["bytes_per_token"], r["hf-encode"]["bytes_per_token"], "higher"),
            ("encode MB/s, all words unseen", r["ours-unseen"]["mb_per_s"], r["hf-unseen"]["mb_per_s"], "higher")]
    print(f"\nvocab {a.n + 257} (N={a.n}); corpus {meta['bytes'] / 1e6:.1f} MB ({meta['origin']}); "
          f"encode on {r['ours-encode']['bytes'] / 1e6:.1f} MB; python {sys.version.split()[0]}")
    print("| metric | ours (Harris) | HF BPE (anchor) | ours/anchor | better |\n|---|---:|---:|---:|---|")
    for name, ours, hf, better in rows:
        print(f"| {name} | {ours:.2f} | {hf:.2f} | {ours / hf:.2f}x | {better} |")
    print(f"(process baseline RSS before work: ours {r['ours-train']['base_rss_mb']:.0f} MB, "
          f"HF {r['hf-train']['base_rss_mb']:.0f} MB; round trip on 200 docs: ours "
          f"{r['ours-encode']['round_trip_200_docs']}, HF {r['hf-encode']['round_trip_200_docs']})")
    targets = {"encode >= 1.0x anchor": r["ours-encode"]["mb_per_s"] >= r["hf-encode"]["mb_per_s"],
               "train <= 2x anchor": r["ours-train"]["seconds"] <= 2 * r["hf-train"]["seconds"]}
    print("targets: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in targets.items()))
    (OUT / "tokenizer.json").write_text(json.dumps({"corpus": meta, "n": a.n, "results": r, "targets": targets},
                                                   indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
