"""ucb1 against uniform at equal steps: held-out bits per byte per source and overall.

    python bench/curriculum_compare.py --profile tiny --tokenizer data/tokenizer/tiny/tokenizer.json \
        --tokens data/tokens/tiny --out bench/out/curriculum --seeds 1337,1,2 --jobs 2
    python bench/curriculum_compare.py ... --eval-only      # re-score existing runs

For each policy and seed the script runs the real pipeline commands (``andrea train
--phase warmup`` then ``--phase main --init``) with ``-S bandit.policy=<policy> -S
seed=<seed>`` and otherwise the same params (extra ``-S key=value`` go to every run), into
``<out>/<policy>-s<seed>/{warmup,main}``, ``--jobs`` of them at a time. Then it scores
each final checkpoint with the eval stage's own held-out code
(``andrea.reports.evaluate.heldout``: up to ``eval.max_batches`` batches of windows spread
evenly over each ``<tokens>/val/<source>.bin``):

    bits per byte = sum of loss nats over the scored targets / (their UTF-8 bytes x ln 2)

so the figure is comparable across tokenizers; overall = all sources' nats / all their
bytes. The anchor is the uniform policy measured in the same invocation: the table gives
each source's bpb under both policies (mean over seeds), their ratio, and each policy's
share of training batches per source (from ``model.loss.json`` pulls). Writes
``<out>/compare.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from andrea.config import load_config
from andrea.backends import select_backend
from andrea.engine.checkpoint import read_weights
from andrea.engine.engine import Engine
from andrea.engine.model import ModelConfig
from andrea.errors import AndreaError
from andrea.fsutil import atomic_write_json, atomic_write_text
from andrea.reports.evaluate import heldout, val_shards
from andrea.settings import Settings
from andrea.tokenizer import load as load_tokenizer

POLICIES = ("ucb1", "uniform")


def run_name(policy: str, seed: int) -> str:
    return f"{policy}-s{seed}"


def train_cmds(policy: str, seed: int, args) -> list[list[str]]:
    sets = [x for s in [f"bandit.policy={policy}", f"seed={seed}", *args.set] for x in ("-S", s)]
    base = [sys.executable, "-m", "andrea", "train", "--profile", args.profile, "--params", args.params,
            "--tokenizer", args.tokenizer, "--tokens", args.tokens]
    out = Path(args.out) / run_name(policy, seed)
    return [base + ["--phase", "warmup", "--out", str(out / "warmup")] + sets,
            base + ["--phase", "main", "--init", str(out / "warmup"), "--out", str(out / "main")] + sets]


def train_all(runs: list[tuple[str, int]], args) -> dict[str, float]:
    """Train every (policy, seed) pair, ``args.jobs`` at a time; logs in <out>/<run>.log."""
    pending, active, walls = list(runs), {}, {}
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), OPENBLAS_NUM_THREADS=str(args.threads))
    while pending or active:
        while pending and len(active) < args.jobs:
            pol, seed = pending.pop(0)
            name = run_name(pol, seed)
            log = Path(args.out) / f"{name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            script = " && ".join(" ".join(map(shlex.quote, c)) for c in train_cmds(pol, seed, args))
            print(f"+ {name}: {script}", file=sys.stderr, flush=True)
            active[name] = (subprocess.Popen(["bash", "-c", script], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                             env=env), time.perf_counter())
        time.sleep(0.5)
        for name, (proc, t0) in list(active.items()):
            if proc.poll() is not None:
                del active[name]
                if proc.returncode:
                    raise AndreaError(f"training {name} failed (exit {proc.returncode}); see {args.out}/{name}.log")
                walls[name] = time.perf_counter() - t0
                print(f"  {name} done in {walls[name]:.0f}s", file=sys.stderr, flush=True)
    return walls


def score(run: Path, st: Settings, tok, byte_len: np.ndarray, val: dict) -> dict:
    """Held-out figures of a run's checkpoint by the eval stage's own code (andrea.reports.evaluate)."""
    mc = ModelConfig.of(st.model, tok.vocab_size)
    be, _ = select_backend(st.train.backend)
    eng = Engine(mc, batch_size=st.train.batch_size, backend=be)
    step, w = read_weights(run / "model.bin", eng.n_params)
    be.copy_from_host(eng.w, w)
    ho = heldout(eng, val, byte_len, tok.eot_id, st.eval.max_batches)
    return {"step": step, "per_source": {s: p["bpb"] for s, p in ho["per_source"].items()},
            "overall_bpb": ho["overall"]["bpb"]}


def batch_shares(run: Path) -> dict[str, float]:
    lj = json.loads((run / "model.loss.json").read_text(encoding="utf-8"))
    counts: dict[str, int] = {}
    for r in lj.get("pulls", []):
        if r.get("source") is not None:
            counts[r["source"]] = counts.get(r["source"], 0) + int(r.get("dwell", 1))
    n = sum(counts.values()) or 1
    return {s: c / n for s, c in counts.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="tiny")
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--tokens", required=True)
    p.add_argument("--out", default="bench/out/curriculum")
    p.add_argument("--seeds", default="1337", help="comma-separated seeds; each policy is trained once per seed")
    p.add_argument("--jobs", type=int, default=1, help="trainings run at once")
    p.add_argument("--threads", type=int, default=1, help="BLAS threads per training")
    p.add_argument("-S", "--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--eval-only", action="store_true", help="score existing runs, do not train")
    args = p.parse_args(argv)
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    st = Settings.from_dict(load_config(args.params, args.profile, args.set))
    tok = load_tokenizer(args.tokenizer)
    byte_len = np.array([len(tok.token_bytes(i)) for i in range(tok.vocab_size)], dtype=np.int64)
    val = val_shards(Path(args.tokens), "val")
    runs = [(pol, seed) for seed in seeds for pol in POLICIES]
    walls = {} if args.eval_only else train_all(runs, args)
    res: dict = {"profile": args.profile, "sets": args.set, "seeds": seeds, "runs": {}}
    for pol, seed in runs:
        run = Path(args.out) / run_name(pol, seed) / "main"
        res["runs"][run_name(pol, seed)] = score(run, st, tok, byte_len, val) | {
            "policy": pol, "seed": seed, "train_wall_s": walls.get(run_name(pol, seed)), "shares": batch_shares(run)}

    def mean(pol: str, get) -> float:
        return float(np.mean([get(r) for r in res["runs"].values() if r["policy"] == pol]))

    srcs = sorted(next(iter(res["runs"].values()))["per_source"])
    step = {r["step"] for r in res["runs"].values()}
    lines = [f"ucb1 vs uniform, profile {args.profile}, step {'/'.join(map(str, sorted(step)))}, seeds {seeds}, "
             f"sets {args.set or 'none'}: held-out bits per byte (lower is better), mean over seeds", "",
             "| source | uniform bpb | ucb1 bpb | ucb1/uniform | uniform share | ucb1 share |",
             "|---|---|---|---|---|---|"]
    for s in srcs:
        ub, bb = mean("uniform", lambda r: r["per_source"][s]), mean("ucb1", lambda r: r["per_source"][s])
        us, bs = mean("uniform", lambda r: r["shares"].get(s, 0.0)), mean("ucb1", lambda r: r["shares"].get(s, 0.0))
        lines.append(f"| {s} | {ub:.4f} | {bb:.4f} | {bb / ub:.4f} | {us:.3f} | {bs:.3f} |")
    uo, bo = mean("uniform", lambda r: r["overall_bpb"]), mean("ucb1", lambda r: r["overall_bpb"])
    lines.append(f"| **overall** | {uo:.4f} | {bo:.4f} | {bo / uo:.4f} | | |")
    lines += ["", "per seed, overall bpb: " + ", ".join(
        f"{name} {r['overall_bpb']:.4f}" for name, r in res["runs"].items())]
    md = "\n".join(lines) + "\n"
    atomic_write_json(Path(args.out) / "compare.json", res)
    atomic_write_text(Path(args.out) / "compare.md", md)
    print(md)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except AndreaError as e:
        print(f"curriculum_compare: error: {e}", file=sys.stderr)
        sys.exit(2)
