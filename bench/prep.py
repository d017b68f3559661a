"""Benchmark prep-megachat on a generated ~1 GB Hermes-shaped input: MB/s, rows/s, peak RSS.

    python bench/prep.py                 # 1 GB of conversation text (a few minutes on 2 cores)
    python bench/prep.py --gb 0.1        # a quick look

Writes raw Hermes-3 Parquet files (``conversations: list<struct<from, value>>``; a third
with a system prompt, 1-4 exchanges, every row distinct) into a temp folder, streaming
batch by batch so the generator never holds the input in memory. Then it runs, each in
its own process so peak RSS is theirs alone:

* anchor: read the same files with pyarrow in batches and turn them into Python objects
  (``to_pylist``), the least any Python-level pass over the rows must do;
* prep: ``andrea prep-megachat`` on those files (plus the embedded prose/code sources of
  the default params), exactly as the pipeline runs it.

It prints, for both, seconds, MB/s of conversation text, rows/s and peak RSS, and the
ratio prep/anchor. Input size is the UTF-8 bytes of all turn values (about the size of
the same data as JSON lines). Everything is removed at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from andrea.data.hermes3 import RAW_SCHEMA  # noqa: E402

WORDS = ("the a of to in is that for it as with was on be by this are from or an which at not can have function "
         "value list return type error file data python model train token string object call class method set "
         "default number loop index key dict memory batch stream write read parse render split merge").split()
SYSTEMS = ("You are a helpful assistant.", "You are a careful Python tutor. Answer briefly.",
           "You are Hermes, an AI that follows instructions precisely.")
ANCHOR = """
import sys, pyarrow.parquet as pq
rows = 0
for path in sys.argv[2:]:
    for b in pq.ParquetFile(path).iter_batches(batch_size=int(sys.argv[1]), columns=["conversations"]):
        rows += len(b.column(0).to_pylist())
print(rows)
"""


def sentences(rng: np.random.Generator, n: int) -> list[str]:
    out = []
    for _ in range(n):
        k = int(rng.integers(6, 30))
        words = [WORDS[i] for i in rng.integers(0, len(WORDS), k)]
        out.append(" ".join(words).capitalize() + ".")
    return out


def generate(folder: Path, target_bytes: int, seed: int, file_bytes: int = 128 << 20, batch: int = 2048) -> tuple[int, int]:
    """Raw files with ~target_bytes of turn text; returns (rows, text bytes)."""
    rng = np.random.default_rng(seed)
    pool = sentences(rng, 50_000)
    rows = total = file_total = 0
    part = 0
    writer = None
    while total < target_bytes:
        if writer is None:
            writer = pq.ParquetWriter(folder / f"part-{part:04d}.parquet", RAW_SCHEMA, compression="zstd",
                                      compression_level=1)
        convs = []
        for _ in range(batch):
            turns = []
            if rng.random() < 1 / 3:
                turns.append({"from": "system", "value": SYSTEMS[int(rng.integers(0, len(SYSTEMS)))]})
            for ex in range(int(rng.integers(1, 5))):
                for role, n in (("human", int(rng.integers(1, 4))), ("gpt", int(rng.integers(3, 30)))):
                    idx = rng.integers(0, len(pool), n)
                    text = " ".join(pool[i] for i in idx)
                    if ex == 0 and role == "human":
                        text = f"[{rows}] {text}"  # every row distinct: dedupe keeps them all
                    turns.append({"from": role, "value": text})
            size = sum(len(t["value"]) for t in turns)
            total += size
            file_total += size
            rows += 1
            convs.append({"conversations": turns})
        writer.write_table(pa.Table.from_pylist(convs, schema=RAW_SCHEMA))
        print(f"\rgenerating: {total / 1e6:8.1f} / {target_bytes / 1e6:.0f} MB", end="", file=sys.stderr, flush=True)
        if file_total >= file_bytes:
            writer.close()
            writer, file_total, part = None, 0, part + 1
    if writer is not None:
        writer.close()
    print(file=sys.stderr)
    return rows, total


def timed(cmd: list[str]) -> tuple[float, int, subprocess.CompletedProcess | int, str]:
    """Run ``cmd``; wall seconds, peak RSS in bytes of that process, exit status, stdout+stderr."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        dt = time.perf_counter() - t0
        log.seek(0)
        return dt, usage.ru_maxrss * 1024, proc.returncode, log.read()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0, help="GB of conversation text to generate (default 1.0)")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--dir", default=None, help="work folder (default: a temp folder)")
    ap.add_argument("--keep", action="store_true", help="keep the generated input and output")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="andrea-bench-prep.", dir=args.dir))
    try:
        raw = work / "raw"
        raw.mkdir()
        t0 = time.perf_counter()
        rows, text = generate(raw, int(args.gb * 1e9), args.seed)
        gen_s = time.perf_counter() - t0
        on_disk = sum(p.stat().st_size for p in raw.iterdir())
        files = sorted(str(p) for p in raw.iterdir())
        print(f"input: {rows} rows, {text / 1e6:.1f} MB text, {on_disk / 1e6:.1f} MB Parquet in {len(files)} files "
              f"(generated in {gen_s:.1f} s)")
        import yaml

        batch_rows = yaml.safe_load((ROOT / "params.yaml").read_text())["megachat"]["batch_rows"]
        a_s, a_rss, a_rc, a_out = timed([sys.executable, "-c", ANCHOR, str(batch_rows), *files])
        if a_rc != 0:
            print(a_out, file=sys.stderr)
            return 1
        p_s, p_rss, p_rc, p_out = timed([sys.executable, "-m", "andrea", "prep-megachat", "--params",
                                         str(ROOT / "params.yaml"), "--raw", str(raw), "--embedded",
                                         str(ROOT / "data" / "embedded"), "--out", str(work / "megachat")])
        if p_rc != 0:
            print(p_out, file=sys.stderr)
            return 1
        import json

        report = json.loads((work / "megachat" / "prep_report.json").read_text())
        kept = report["per_input"]["hermes3"]["kept"]
        print(f"{'':8} {'seconds':>8} {'MB/s':>8} {'rows/s':>10} {'peak RSS MB':>12}")
        for name, s, rss in (("anchor", a_s, a_rss), ("prep", p_s, p_rss)):
            print(f"{name:8} {s:8.1f} {text / 1e6 / s:8.1f} {rows / s:10.0f} {rss / 1e6:12.1f}")
        print(f"prep/anchor: time x{p_s / a_s:.2f}, peak RSS x{p_rss / a_rss:.2f}; "
              f"hermes3 rows kept {kept}/{rows}, dropped {report['dropped']}")
        return 0
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
