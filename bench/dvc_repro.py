"""Reproducibility check: the tiny DVC experiment, twice, each from a fresh clone, compared by
the md5 that dvc.lock records for every output (data, tokenizer, token shards, weights, reports).

    python bench/dvc_repro.py                 # two runs of the committed HEAD, ~2 x 3 min on 2 cores
    python bench/dvc_repro.py --keep /tmp/r   # keep the clones

Each run: `git clone` of this checkout's HEAD, then `dvc exp run -S profile=tiny
-S hermes3.source=embedded` (DVC's Hydra composition writes params.yaml). Printed per output:
the two md5s; for a folder whose md5 differs, each file inside that differs, and whether it
differs only in wall-clock fields (``time``, ``tokens_per_s``, ``train_tokens_per_s``: when a
step ran and how fast, never what it computed; a diagnosis only, since the tracked outputs no
longer hold any: they went to the run folders' ``model.perf.jsonl``, which ``.dvcignore``
keeps out of the md5). Also printed: the warnings DVC printed and what `git status` shows after
each run. Exit 1 when any output's md5 differs: the same params must give the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CMD = ["dvc", "exp", "run", "-S", "profile=tiny", "-S", "hermes3.source=embedded"]
WALL_CLOCK = {"time", "tokens_per_s", "train_tokens_per_s"}


def one_run(where: Path) -> dict:
    subprocess.run(["git", "clone", "-q", str(ROOT), str(where)], check=True)
    env = {**os.environ, "PYTHONPATH": str(where), "PYTHONUNBUFFERED": "1"}
    t0 = time.time()
    r = subprocess.run(CMD, cwd=where, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    if r.returncode != 0:
        sys.exit(f"{where}: {' '.join(CMD)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return read_run(where, wall, r.stdout + r.stderr)


def read_run(where: Path, wall: float, log: str) -> dict:
    lock = yaml.safe_load((where / "dvc.lock").read_text())
    outs = {o["path"]: o["md5"] for st in lock["stages"].values() for o in st.get("outs", [])}
    status = subprocess.run(["git", "status", "--porcelain"], cwd=where, capture_output=True, text=True).stdout
    warnings = [ln for ln in log.splitlines() if re.match(r"\s*(WARNING|ERROR)", ln)]
    return {"dir": where, "wall_s": wall, "outs": outs, "git_status": status.split("\n")[:-1], "warnings": warnings}


def dir_listing(repo: Path, md5: str) -> dict[str, str]:
    obj = repo / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]
    return {e["relpath"]: e["md5"] for e in json.loads(obj.read_text())}


def drop_wall_clock(node):
    if isinstance(node, dict):
        return {k: drop_wall_clock(v) for k, v in node.items() if k not in WALL_CLOCK}
    if isinstance(node, list):
        return [drop_wall_clock(v) for v in node]
    return node


def only_wall_clock(a: Path, b: Path) -> bool:
    """True when two differing files are equal once their wall-clock fields are dropped."""
    try:
        return drop_wall_clock(json.loads(a.read_text())) == drop_wall_clock(json.loads(b.read_text()))
    except (ValueError, UnicodeDecodeError):
        pass
    # reports that print the tokens/s figure (eval.md / eval.html): mask its table cell and, in the
    # HTML, the "Throughput" section (a chart of tokens/s over steps)
    def mask(p: Path) -> str:
        text = re.sub(r"<section>\s*<h2>Throughput</h2>.*?</section>", "<section>#</section>", p.read_text(), flags=re.S)
        return re.sub(r"(tokens/s\s*(?:\|\s*|</td>\s*<td>))[0-9][0-9.,]*", r"\1#", text)
    return mask(a) == mask(b)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", type=Path, help="keep the two clones under this folder")
    ap.add_argument("--compare", action="store_true", help="only compare the runs already kept in --keep")
    args = ap.parse_args()
    base = args.keep or Path(tempfile.mkdtemp(prefix="andrea-repro-"))
    base.mkdir(parents=True, exist_ok=True)
    runs = []
    for i in (1, 2):
        dest = base / f"run{i}"
        if args.compare:
            runs.append(read_run(dest, float("nan"), ""))
            continue
        shutil.rmtree(dest, ignore_errors=True)
        print(f"run {i}: {' '.join(CMD)} in a fresh clone {dest}", flush=True)
        runs.append(one_run(dest))
        print(f"run {i}: {runs[-1]['wall_s']:.0f} s", flush=True)
    a, b = runs
    same = timing_only = real = 0
    print(f"\n{'output':<40} {'run 1 md5':<38} {'run 2 md5':<38} verdict")
    for path in sorted(set(a["outs"]) | set(b["outs"])):
        m1, m2 = a["outs"].get(path, "-"), b["outs"].get(path, "-")
        if m1 == m2:
            same += 1
            print(f"{path:<40} {m1:<38} {m2:<38} identical")
            continue
        print(f"{path:<40} {m1:<38} {m2:<38} DIFFERENT")
        if m1.endswith(".dir") and m2.endswith(".dir"):
            l1, l2 = dir_listing(a["dir"], m1), dir_listing(b["dir"], m2)
            files = [(f"{path}/{k}", l1.get(k), l2.get(k)) for k in sorted(set(l1) | set(l2)) if l1.get(k) != l2.get(k)]
            for k in sorted(set(l1) & set(l2)):
                if l1[k] == l2[k]:
                    print(f"  {k:<38} identical")
        else:
            files = [(path, m1, m2)]
        ok = True
        for rel, _, _ in files:
            wc = (a["dir"] / rel).is_file() and (b["dir"] / rel).is_file() and only_wall_clock(a["dir"] / rel, b["dir"] / rel)
            ok &= wc
            print(f"  {Path(rel).name:<38} differs {'only in wall-clock fields' if wc else 'IN CONTENT'}")
        timing_only += ok
        real += not ok
    print(f"\n{same} outputs identical, {timing_only} differ only in wall-clock fields, {real} differ in content "
          f"(of {len(set(a['outs']) | set(b['outs']))}); run times {a['wall_s']:.0f} s and {b['wall_s']:.0f} s")
    for i, r in enumerate(runs, 1):
        print(f"run {i}: {len(r['warnings'])} DVC warnings; git status: {', '.join(r['git_status']) or 'clean'}")
        for w in r["warnings"][:20]:
            print(f"    {w.strip()}")
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 1 if real or timing_only else 0


if __name__ == "__main__":
    sys.exit(main())
