"""`andrea tokenizer`: train the Harris morpheme tokenizer on the megachat train split.

    andrea tokenizer --profile tiny --train data/megachat/embedded/train.parquet --out data/tokenizer/tiny

Reads the ``text`` column of the Parquet file in row order, streaming, until
``tokenizer.max_train_bytes`` UTF-8 bytes are seen; learns morpheme boundaries by
successor/predecessor variety and keeps the ``tokenizer.n_morphemes`` best segments,
refined by ``tokenizer.refine_rounds`` usage-based swaps (see ``andrea/tokenizer/harris.py``). Writes, atomically, ``<out>/tokenizer.json``
and ``<out>/tokenizer.json.sha256`` (``<hex>  tokenizer.json``, as sha256sum prints it).

Params: tokenizer.n_morphemes, tokenizer.max_train_bytes, tokenizer.max_morpheme_len,
tokenizer.min_count, tokenizer.max_word_types, tokenizer.refine_rounds.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path
from typing import Iterator

from andrea.errors import AndreaError
from andrea.fsutil import atomic_dir
from andrea.tokenizer.harris import Ranking, Tokenizer, select_morphemes, train_ranking, utf8

BATCH_ROWS = 2048


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--train", required=True, help="megachat train split (Parquet with a `text` column)")
    p.add_argument("--out", required=True, help="output folder: tokenizer.json + tokenizer.json.sha256")


def iter_parquet_texts(path: str | Path, columns: tuple[str, ...] = ("text",),
                       batch_rows: int = BATCH_ROWS) -> Iterator[tuple]:
    """Yield one tuple of ``columns`` values per row, streaming; bad input -> AndreaError naming file/row."""
    import pyarrow.parquet as pq

    path = Path(path)
    try:
        pf = pq.ParquetFile(path)
    except FileNotFoundError:
        raise AndreaError(f"{path}: not found") from None
    except Exception as e:  # pyarrow raises several types for a non-Parquet file
        raise AndreaError(f"{path}: not a readable Parquet file: {e}") from None
    names = set(pf.schema_arrow.names)
    missing = [c for c in columns if c not in names]
    if missing:
        raise AndreaError(f"{path}: missing column(s) {', '.join(missing)} (has {', '.join(sorted(names))})")
    row = 0
    for batch in pf.iter_batches(batch_size=batch_rows, columns=list(columns)):
        cols = [batch.column(c).to_pylist() for c in columns]
        for vals in zip(*cols):
            for c, v in zip(columns, vals):
                if not isinstance(v, str):
                    raise AndreaError(f"{path}: row {row} column {c!r} is {type(v).__name__}, expected a string")
            yield vals
            row += 1


def train_from_parquet(path: str | Path, tcfg: dict, max_bytes: int | None = None,
                       progress=None) -> Ranking:
    """Rank candidate morphemes from the ``text`` column of ``path`` (the first ``max_bytes`` bytes)."""
    limit = int(max_bytes if max_bytes is not None else tcfg["max_train_bytes"])

    def texts():
        seen = 0
        for (t,) in iter_parquet_texts(path):
            if progress:
                seen += len(utf8(t))
                progress(min(seen, limit))
            yield t

    return train_ranking(texts(), max_morpheme_len=int(tcfg["max_morpheme_len"]), min_count=int(tcfg["min_count"]),
                         max_word_types=int(tcfg["max_word_types"]), max_bytes=limit)


def run(args: argparse.Namespace, cfg: dict) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

    tcfg = cfg["tokenizer"]
    n = int(tcfg["n_morphemes"])
    t0 = time.perf_counter()
    console = Console(stderr=True)
    with Progress(TextColumn("tokenizer"), BarColumn(), DownloadColumn(), TimeElapsedColumn(),
                  console=console, transient=not sys.stderr.isatty()) as bar:
        task = bar.add_task("count", total=int(tcfg["max_train_bytes"]))
        ranking = train_from_parquet(args.train, tcfg, progress=lambda b: bar.update(task, completed=b))
    if ranking.stats["train_bytes"] == 0:
        raise AndreaError(f"{args.train}: no text to train on")
    sel = select_morphemes(ranking, n, int(tcfg["refine_rounds"]))
    meta = {**ranking.stats, "min_count": int(tcfg["min_count"]), "max_morpheme_len": int(tcfg["max_morpheme_len"]),
            "refine_rounds": int(tcfg["refine_rounds"]), "source": Path(args.train).name,
            "frequent_candidates": ranking.n_frequent, "tokens_per_round": sel.total_tokens, "uses": sel.uses}
    tok = Tokenizer(sel.morphemes, meta=meta)
    blob = tok.dumps().encode("utf-8")
    digest = hashlib.sha256(blob).hexdigest()
    with atomic_dir(args.out) as tmp:
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the result is an ordinary output folder
        (tmp / "tokenizer.json").write_bytes(blob)
        (tmp / "tokenizer.json.sha256").write_text(f"{digest}  tokenizer.json\n", encoding="utf-8")
    relaxed = max(0, n - ranking.n_frequent)
    console.print(f"tokenizer: N={n} vocab={tok.vocab_size} from {ranking.stats['train_bytes']:,} bytes "
                  f"({ranking.stats['train_docs']:,} docs, {ranking.stats['word_types']:,} word types) in "
                  f"{time.perf_counter() - t0:.1f}s -> {Path(args.out) / 'tokenizer.json'} sha256 {digest[:12]}"
                  + (f"; {relaxed} morphemes below min_count={tcfg['min_count']}" if relaxed else ""))
    return 0
