"""Both front ends on one checkout: Snakemake's tiny DAG, then the same params through DVC, then
Snakemake again, in a fresh clone; prints what each step ran and whether anything retrained.

    python bench/frontends_mix.py                 # ~3 + 3 + 1 min on 2 cores
    python bench/frontends_mix.py --temp          # the DVC step as `dvc exp run --temp`
    python bench/frontends_mix.py --keep /tmp/mix

Checked: Snakemake's checkpoints come out of the DVC step unchanged (same sha256), Snakemake
afterwards retrains nothing, no `.stale-*` folder appears, no run folder loses its model.bin,
and `git status` after all three shows only what DVC records in git (params.yaml, dvc.lock).
Exit 1 when one of those fails. A plain `dvc exp run` in a clone with no dvc.lock fails the
first check: before its first run DVC removes the outputs it has no record of ("No file hash
info found ... It won't be created") and rebuilds them; `--temp` (and `--queue`) run the
experiment in a copy and leave the workspace's outputs alone.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = [("snakemake", ["snakemake", "--cores", "1"]),
         ("dvc", ["dvc", "exp", "run", "-S", "profile=tiny", "-S", "hermes3.source=embedded"]),
         ("snakemake again", ["snakemake", "--cores", "1"])]
PROGRESS = re.compile(r"^(warmup|main) step \d+/\d+ ", re.M)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", type=Path)
    ap.add_argument("--temp", action="store_true", help="run the DVC step with `dvc exp run --temp`")
    args = ap.parse_args()
    if args.temp:
        STEPS[1] = ("dvc --temp", STEPS[1][1][:3] + ["--temp"] + STEPS[1][1][3:])
    base = args.keep or Path(tempfile.mkdtemp(prefix="andrea-mix-"))
    where = base / "clone"
    shutil.rmtree(where, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", str(ROOT), str(where)], check=True)
    env = {**os.environ, "PYTHONPATH": str(where), "PYTHONUNBUFFERED": "1"}
    bad = []
    bins = ("runs/tiny/warmup/model.bin", "runs/tiny/main/model.bin")
    sha = lambda: {b: hashlib.sha256((where / b).read_bytes()).hexdigest() if (where / b).is_file() else None
                   for b in bins}
    for name, cmd in STEPS:
        t0 = time.time()
        r = subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True)
        out = r.stdout + r.stderr
        if r.returncode != 0:
            sys.exit(f"{name}: {' '.join(cmd)} failed ({r.returncode}):\n{out[-3000:]}")
        ran = re.findall(r"^(?:local)?rule (\w+):$", out, re.M) or re.findall(r"^Running stage '(\w+)'", out, re.M)
        trained = len(PROGRESS.findall(out))
        nothing = len(re.findall(r"nothing to do", out))
        warnings = [ln.strip() for ln in out.splitlines() if ln.lstrip().startswith("WARNING")]
        print(f"{name}: {time.time() - t0:.0f} s; ran {', '.join(r for r in ran if not r.startswith('all')) or 'nothing'}; "
              f"{trained} training progress lines; {nothing} 'nothing to do'; {len(warnings)} warnings")
        for w in warnings[:3]:
            print(f"    {w}")
        if name == "snakemake":
            made = sha()
        elif name.startswith("dvc"):
            if sha() != made:
                bad.append(f"{name} replaced Snakemake's checkpoints")
        elif trained:
            bad.append(f"{name} retrained")
    stale = sorted(p.name for p in (where / "runs/tiny").iterdir() if ".stale-" in p.name)
    missing = [p for p in ("runs/tiny/warmup/model.bin", "runs/tiny/main/model.bin") if not (where / p).is_file()]
    status = subprocess.run(["git", "status", "--porcelain"], cwd=where, capture_output=True, text=True).stdout.split("\n")[:-1]
    print(f"stale run folders: {stale or 'none'}; missing checkpoints: {missing or 'none'}; "
          f"git status: {', '.join(status) or 'clean'}")
    bad += [f"stale folder {s}" for s in stale] + [f"{m} missing" for m in missing]
    allowed = ("params.yaml", "dvc.lock") if not args.temp else ()
    bad += [f"git status: {s}" for s in status if s[3:] not in allowed]
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    print("OK" if not bad else "FAILED: " + "; ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
