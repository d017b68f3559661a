"""Kill -9 a checkpoint-every-step training run at random moments, resume it, count what broke.

    python bench/kill_resume.py                    # 100 SIGKILLs (a few minutes on 2 cores)
    python bench/kill_resume.py --kills 20 --steps 30 --seed 1

A micro model (numpy backend, one CPU thread) trains ``--steps`` warmup steps with
``train.checkpoint_every=1``, so most of its wall time after start-up is spent writing
checkpoints. First a straight run gives the reference bytes. Then chains: each starts a
fresh run folder, launches ``andrea train``, sends SIGKILL at a random moment (a quarter
of them during start-up and repair, the rest a random fraction of a step after one of
the next few step lines, i.e. somewhere inside that step's checkpoint commit), inspects
the folder, and launches again, until the chain has had its share of kills; its last
launch runs to the end. Counts:

  kills                   SIGKILLs that hit a live process
  kills_mid_write         of those, kills that left a new temp file or pending/commit folder
                          behind (the kill landed inside a write)
  torn                    top-level run files that are not whole (a cut model.bin, bad JSON)
  split_seen              kills after which model.bin and model.state.json disagreed at the top
                          before the next start (the next start must repair these)
  unresumable             launches that failed (exit other than 0 / killed) on a killed folder
  stray_after_next_start  temp files/folders a kill left that were still there after the next
                          launch got past its start, plus any hidden entry left at a chain's end
  chains / chains_identical  finished chains, and those whose model.bin and train history are
                          byte-identical to the straight run's

The test suite runs a bounded version (tests/test_reliability_ckpt.py, ~20 kills).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from andrea.engine import checkpoint as ck  # noqa: E402
from andrea.errors import AndreaError  # noqa: E402
from train_helpers import andrea_cmd, child_env, make_data, micro_overrides  # noqa: E402

TOP = ("model.bin", "model.state.json", "model.loss.json", "model.samples.json")


def _history(out: Path) -> list:
    d = json.loads((out / "model.loss.json").read_text())
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"], r["source"]) for r in d["train"]]


def _hidden(out: Path) -> dict[str, tuple]:
    """Hidden entries (temp files, commit folders) with an identity that a re-creation changes."""
    found = {}
    if out.is_dir():
        for p in out.iterdir():
            if p.name.startswith("."):
                with_stat = p.lstat()
                found[p.name] = (with_stat.st_ino, with_stat.st_mtime_ns)
    return found


def inspect(out: Path) -> tuple[int, bool]:
    """(torn files at the top, split pair at the top) of a folder just after a kill."""
    torn = 0
    if (out / "model.bin").exists():
        try:
            ck.read_checkpoint(out / "model.bin", None)
        except AndreaError:
            torn += 1
    for name in TOP[1:]:
        p = out / name
        if p.exists():
            try:
                json.loads(p.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError):
                torn += 1
    b, s = out / "model.bin", out / "model.state.json"
    split = b.exists() != s.exists()
    if b.exists() and s.exists() and not torn:
        split = json.loads(s.read_text())["step"] != ck.read_header(b)[0]
    return torn, split


def _launch_and_kill(cmd: list[str], env: dict, rng: random.Random | None, timing: dict):
    """Run ``cmd``; with ``rng``, SIGKILL it at a random moment: a quarter of the time during
    start-up and repair (uniform over the estimated start-up), else a random 0..1.2 steps'
    time after the line of one of its next few steps, i.e. inside that step's checkpoint."""
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    lines: list[str] = []
    step_lines: list[tuple[float, int]] = []
    seen = threading.Event()

    def reader():
        for line in p.stderr:
            lines.append(line)
            m = re.match(r"warmup step (\d+)/", line)
            if m:
                step_lines.append((time.time(), int(m.group(1))))
                seen.set()

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    if rng is not None:
        if rng.random() < 0.25:
            time.sleep(rng.uniform(0, timing["startup"]))
        else:
            target = rng.randint(1, 4)
            while p.poll() is None and len(step_lines) < target:
                seen.wait(0.01)
                seen.clear()
            time.sleep(rng.uniform(0, 1.2 * timing["step"]))
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
    rc = p.wait(timeout=600)
    th.join(timeout=60)
    if step_lines:
        timing["startup"] = 0.8 * timing["startup"] + 0.2 * (step_lines[0][0] - t0)
    if len(step_lines) > 1:
        per = (step_lines[-1][0] - step_lines[0][0]) / (len(step_lines) - 1)
        timing["step"] = 0.8 * timing["step"] + 0.2 * per
    return p, "".join(lines), rc


def campaign(root: Path, kills: int = 100, steps: int = 40, seed: int = 0, data=None,
             per_chain: int = 10, log=None) -> dict:
    root = Path(root)
    rng = random.Random(seed)
    tok, tokens = data if data is not None else make_data(root / "data")
    ov = micro_overrides(steps, steps, **{"train.checkpoint_every": 1})
    env = child_env()

    def cmd(out):
        return andrea_cmd("warmup", tok, tokens, out, ov)

    ref_dir = root / "straight"
    r = subprocess.run(cmd(ref_dir), env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"the straight run failed:\n{r.stderr}")
    ref_bin, ref_hist = (ref_dir / "model.bin").read_bytes(), _history(ref_dir)
    timing = {"startup": 0.7, "step": 0.05}      # running estimates (s): launch -> first step line; one step

    c = dict(kills=0, kills_mid_write=0, torn=0, split_seen=0, unresumable=0, stray_after_next_start=0, chains=0, chains_identical=0,
             launches=0)
    failures: list[str] = []
    chain = 0
    while c["kills"] < kills:
        chain += 1
        out = root / f"chain{chain}"
        left: dict[str, tuple] = {}
        chain_kills = 0
        while True:
            last = chain_kills >= per_chain or c["kills"] >= kills
            before = _hidden(out)
            p, err, rc = _launch_and_kill(cmd(out), env, None if last else rng, timing)
            c["launches"] += 1
            started = "train warmup:" in err
            if started:     # it got past its start: what the previous kill left must be gone
                now = _hidden(out)
                stray = [n for n, ident in left.items() if now.get(n) == ident]
                c["stray_after_next_start"] += len(stray)
                if stray:
                    failures.append(f"chain {chain}: left after the next start: {stray}")
            if rc == -signal.SIGKILL:
                c["kills"] += 1
                chain_kills += 1
                torn, split = inspect(out)
                c["kills_mid_write"] += int(any(before.get(n) != ident for n, ident in _hidden(out).items()))
                c["torn"] += torn
                c["split_seen"] += int(split)
                left = {**({} if started else left), **_hidden(out)}
                continue
            if rc != 0:
                c["unresumable"] += 1
                failures.append(f"chain {chain}: launch exit {rc}: {err.strip().splitlines()[-1] if err.strip() else ''}")
                break
            if ck.read_header(out / "model.bin")[0] < steps:
                continue                  # it was not killed in time but stopped early? launch again
            c["chains"] += 1
            hidden = _hidden(out)
            c["stray_after_next_start"] += len(hidden)
            if hidden:
                failures.append(f"chain {chain}: hidden entries at its end: {sorted(hidden)}")
            same = (out / "model.bin").read_bytes() == ref_bin and _history(out) == ref_hist
            c["chains_identical"] += int(same)
            if not same:
                failures.append(f"chain {chain}: finished, but differs from the straight run")
            break
        if log:
            log(f"chain {chain}: {chain_kills} kills; totals {c}")
    c["failures"] = failures
    return c


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--steps", type=int, default=40, help="warmup steps per run (a checkpoint after each)")
    ap.add_argument("--per-chain", type=int, default=10, help="kills per chain before it may finish")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the temp folder")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="andrea-kill-"))
    t0 = time.time()
    try:
        c = campaign(root, a.kills, a.steps, a.seed, per_chain=a.per_chain, log=lambda s: print(s, file=sys.stderr))
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    failures = c.pop("failures")
    for f in failures:
        print("FAIL", f)
    print(f"kill_resume: {c['kills']} SIGKILLs over {c['chains']} chains ({c['launches']} launches, "
          f"{time.time() - t0:.0f}s)")
    for k in ("kills_mid_write", "torn", "split_seen", "unresumable", "stray_after_next_start"):
        print(f"  {k:<24} {c[k]}")
    print(f"  {'chains_identical':<24} {c['chains_identical']}/{c['chains']}")
    ok = not failures and c["chains"] == c["chains_identical"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
