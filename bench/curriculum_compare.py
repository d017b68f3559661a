"""Bandit variants against uniform at equal steps: held-out bits per byte per source and overall.

The 12M comparison of issue 14 (the recipe's bandit.* against uniform; data built in seconds by
``andrea tokenizer`` / ``andrea diet-alignment --profile andrea-12m -S hermes3.source=embedded``):

    python bench/curriculum_compare.py --profile andrea-12m --tokenizer data/tokenizer/andrea-12m/tokenizer.json \
        --tokens data/tokens/andrea-12m --out bench/out/curriculum-12m --seeds 1337,1,2 --jobs 6 \
        -S train.backend=cupy -S train.precision=bf16 -S train.max_steps=3000 -S curriculum.warmup_steps=1000 \
        -S train.warmup_steps=60
    python bench/curriculum_compare.py --profile tiny --tokenizer data/tokenizer/tiny/tokenizer.json \
        --tokens data/tokens/tiny --out bench/out/curriculum --seeds 1337,1 --jobs 2      # CPU, ~25 min
    python bench/curriculum_compare.py ... --variant ucb1-d34=bandit.policy=ucb1,bandit.dice_main=4 ...
    python bench/curriculum_compare.py ... --eval-only      # re-score existing runs

``train.warmup_steps=60`` keeps the recipe's LR-warmup share (2000 of its 100000 steps, 2%) in the
3000-step run; without it the LR would still be rising at two thirds of the run, which no recipe run
does (docs/FIREHOSE-BANDIT.md, "At the recipe's LR-warmup share"). Both policies get the same.

Each ``--variant NAME=key=value[,key=value]`` is a policy setting (default: ``uniform`` and
``ucb1``, i.e. the params' bandit.*); ``uniform`` (bandit.policy=uniform) is always trained as
the anchor. For each variant and seed the script runs the real pipeline commands (``andrea
train --phase warmup`` then ``--phase main --init``) with the variant's ``-S`` and ``-S
seed=<seed>`` (extra ``-S key=value`` go to every run, before the variant's; the script adds
``train.eval_every=100`` unless given), into ``<out>/<variant>-s<seed>/{warmup,main}``,
``--jobs`` at a time. Then it scores each final checkpoint with the eval stage's held-out code
(``andrea.reports.evaluate.heldout``: up to ``eval.max_batches`` batches of windows spread
evenly over each ``<tokens>/val/<source>.bin``; ``--no-rescore``: the last in-training record
instead):

    bits per byte = sum of loss nats over the scored targets / (their UTF-8 bytes x ln 2)

so the figure is comparable across tokenizers; overall = all sources' nats / all their bytes.
The three figures of each variant (means over seeds, against uniform in the same invocation):

  * overall ratio: variant overall bpb / uniform overall bpb (target <= 0.95 at 12M, <= 1.0 tiny);
  * worst source ratio: the largest per-source bpb ratio (target <= 1.05);
  * steps-to-reach ratio: the first step at which the variant's held-out curve reaches uniform's
    final value, over uniform's last step (target <= 0.8). The curve is the in-training
    estimate (``.loss.json`` "val", every ``train.eval_every`` steps, warmup then main: each
    source's mean loss x its scored targets, over their bytes), the same windows for both.

Also per source: bpb under every variant, its ratio, its share of all training batches and of the
batches of the run's last third (from the main run's ``model.loss.json`` pulls, which include the
warmup's), and its mean pull reward over the last third beside the pooled within-source spread of
those rewards (the unit of the UCB radius): where the spread dwarfs the gaps between the means the
reward is not what sets the mix (docs/FIREHOSE-BANDIT.md, "Why the small sources starve").
Writes ``<out>/compare.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from andrea.config import load_config
from andrea.curriculum import sequential_windows
from andrea.backends import select_backend
from andrea.engine.checkpoint import read_weights
from andrea.engine.engine import Engine
from andrea.engine.model import ModelConfig
from andrea.errors import AndreaError, exit_main
from andrea.fsutil import atomic_write_json, atomic_write_text
from andrea.reports.evaluate import heldout, val_shards
from andrea.settings import Settings
from andrea.tokenizer import load as load_tokenizer

ANCHOR = "uniform"
DEFAULT_VARIANTS = ("uniform=bandit.policy=uniform", "ucb1=bandit.policy=ucb1")


def parse_variant(spec: str) -> tuple[str, list[str]]:
    """``NAME=key=value,key=value`` -> (NAME, ["key=value", ...])."""
    name, _, sets = spec.partition("=")
    if not name or not sets or "=" not in sets:
        raise AndreaError(f"--variant {spec!r}: expected NAME=key=value[,key=value...], e.g. "
                          f"ucb1-f10=bandit.policy=ucb1,bandit.floor=0.1")
    return name, [x for x in sets.split(",") if x]


def run_name(variant: str, seed: int) -> str:
    return f"{variant}-s{seed}"


def train_cmds(variant: str, sets_v: list[str], seed: int, args) -> list[list[str]]:
    sets = [x for s in [*args.set, *sets_v, f"seed={seed}"] for x in ("-S", s)]
    base = [sys.executable, "-m", "andrea", "train", "--profile", args.profile, "--params", args.params,
            "--tokenizer", args.tokenizer, "--tokens", args.tokens]
    out = Path(args.out) / run_name(variant, seed)
    return [base + ["--phase", "warmup", "--out", str(out / "warmup")] + sets,
            base + ["--phase", "main", "--init", str(out / "warmup"), "--out", str(out / "main")] + sets]


def train_all(runs: list[tuple[str, int]], variants: dict, args) -> dict[str, float]:
    """Train every (variant, seed) pair, ``args.jobs`` at a time; logs in <out>/<run>.log."""
    pending, active, walls = list(runs), {}, {}
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), OPENBLAS_NUM_THREADS=str(args.threads))
    while pending or active:
        while pending and len(active) < args.jobs:
            var, seed = pending.pop(0)
            name = run_name(var, seed)
            log = Path(args.out) / f"{name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            script = " && ".join(" ".join(map(shlex.quote, c)) for c in train_cmds(var, variants[var], seed, args))
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


def batch_shares(run: Path, since: int = 0) -> dict[str, float]:
    """Each source's share of the training batches from step ``since`` on (the pull records of the
    main run, which include the warmup's; a pull counts at the step it ended)."""
    lj = json.loads((run / "model.loss.json").read_text(encoding="utf-8"))
    counts: dict[str, int] = {}
    for r in lj.get("pulls", []):
        if r.get("source") is not None and int(r.get("step", 0)) >= since:
            counts[r["source"]] = counts.get(r["source"], 0) + int(r.get("dwell", 1))
    n = sum(counts.values()) or 1
    return {s: c / n for s, c in counts.items()}


def pull_rewards(run: Path, since: int = 0) -> dict:
    """The bandit's learning signal from step ``since`` on: per source the mean and count of its pull
    rewards (records with a reward), and their pooled within-source standard deviation, the unit of
    the UCB radius under ``bandit.ucb_scale: std``. When the spread dwarfs the gaps between the
    means, the radius, not the reward, decides the pulls."""
    lj = json.loads((run / "model.loss.json").read_text(encoding="utf-8"))
    by: dict[str, list[float]] = {}
    for r in lj.get("pulls", []):
        if r.get("source") is not None and r.get("reward") is not None and int(r.get("step", 0)) >= since:
            by.setdefault(r["source"], []).append(float(r["reward"]))
    ss = sum(float(np.sum((np.array(v) - np.mean(v)) ** 2)) for v in by.values())
    dof = sum(len(v) - 1 for v in by.values())
    return {"mean": {s: float(np.mean(v)) for s, v in by.items()}, "n": {s: len(v) for s, v in by.items()},
            "spread": math.sqrt(ss / dof) if dof > 0 else None}


def val_bytes(val: dict, byte_len: np.ndarray, B: int, T: int, max_batches: int) -> dict[str, tuple[int, int]]:
    """(targets, UTF-8 bytes) of the windows the in-training held-out estimate scores per source
    (andrea/train.py ``evaluate``: ``sequential_windows`` of ``train.eval_batches`` batches)."""
    out = {}
    for src, shard in val.items():
        n = b = 0
        for _, y in sequential_windows(shard, B, T, max_batches):
            n, b = n + y.size, b + int(byte_len[y].sum())
        if n:
            out[src] = (n, b)
    return out


def val_curve(run: Path, vb: dict) -> list[tuple[int, float]]:
    """[(step, overall bpb)] of a run's in-training held-out records, warmup then main: each
    source's mean loss x its targets, summed, over all sources' bytes x ln 2."""
    pts = {}
    for part in ("warmup", "main"):
        f = run / part / "model.loss.json"
        if not f.exists():
            continue
        for r in json.loads(f.read_text(encoding="utf-8")).get("val", []):
            per = r.get("per_source") or {}
            if per and all(s in per for s in vb):
                nats = sum(per[s] * vb[s][0] for s in vb)
                pts[int(r["step"])] = nats / (sum(b for _, b in vb.values()) * math.log(2))
    return sorted(pts.items())


def steps_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """First step at which the curve is at or below ``target``, linear between held-out points."""
    for i, (step, v) in enumerate(curve):
        if v <= target:
            if i == 0:
                return float(step)
            s0, v0 = curve[i - 1]
            return s0 + (step - s0) * (v0 - target) / (v0 - v) if v0 != v else float(step)
    return None


def mean_curve(curves: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """Mean over runs at the held-out steps they all share."""
    common = set.intersection(*(set(s for s, _ in c) for c in curves)) if curves else set()
    return [(s, float(np.mean([dict(c)[s] for c in curves]))) for s in sorted(common)]


def figures(res: dict, variant: str, srcs: list[str]) -> dict:
    """The three headline figures of a variant against the anchor, means over seeds."""
    def mean(var, get):
        return float(np.mean([get(r) for r in res["runs"].values() if r["variant"] == var]))

    per = {s: mean(variant, lambda r: r["per_source"][s]) / mean(ANCHOR, lambda r: r["per_source"][s]) for s in srcs}
    worst = max(per, key=per.get)
    anchor_curve = mean_curve([r["curve"] for r in res["runs"].values() if r["variant"] == ANCHOR])
    curve = mean_curve([r["curve"] for r in res["runs"].values() if r["variant"] == variant])
    reach = None
    if anchor_curve and curve:
        at = steps_to_reach(curve, anchor_curve[-1][1])
        reach = None if at is None else at / anchor_curve[-1][0]
    return {"overall_bpb": mean(variant, lambda r: r["overall_bpb"]),
            "overall_ratio": mean(variant, lambda r: r["overall_bpb"]) / mean(ANCHOR, lambda r: r["overall_bpb"]),
            "source_ratio": per, "worst_source": worst, "worst_source_ratio": per[worst],
            "steps_to_reach_ratio": reach, "anchor_final_curve_bpb": anchor_curve[-1][1] if anchor_curve else None,
            "shares": {s: mean(variant, lambda r: r["shares"].get(s, 0.0)) for s in srcs},
            "late_shares": {s: mean(variant, lambda r: r["late_shares"].get(s, 0.0)) for s in srcs},
            "late_reward": {s: mean(variant, lambda r: r["late_reward"]["mean"].get(s, math.nan)) for s in srcs},
            "late_reward_spread": mean(variant, lambda r: r["late_reward"]["spread"] if r["late_reward"]["spread"]
                                       is not None else math.nan),
            "curve": curve}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="tiny")
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--tokens", required=True)
    p.add_argument("--out", default="bench/out/curriculum")
    p.add_argument("--seeds", default="1337", help="comma-separated seeds; each variant is trained once per seed")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE[,KEY=VALUE]",
                   help="a policy variant (repeatable; default: uniform and ucb1 with the params' bandit.*); "
                        "the anchor 'uniform' (bandit.policy=uniform) is always added")
    p.add_argument("--jobs", type=int, default=1, help="trainings run at once")
    p.add_argument("--threads", type=int, default=1, help="BLAS threads per training")
    p.add_argument("-S", "--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override for every run (default adds train.eval_every=100 for the held-out curves)")
    p.add_argument("--eval-only", action="store_true", help="score existing runs, do not train")
    p.add_argument("--no-rescore", action="store_true",
                   help="final figures from the last in-training held-out record instead of the eval stage's code")
    args = p.parse_args(argv)
    if not any(x.startswith("train.eval_every=") for x in args.set):
        args.set = ["train.eval_every=100", *args.set]
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    variants = dict(parse_variant(v) for v in (args.variant or DEFAULT_VARIANTS))
    variants.setdefault(ANCHOR, ["bandit.policy=uniform"])
    st = Settings.from_dict(load_config(args.params, args.profile, args.set))
    tok = load_tokenizer(args.tokenizer)
    byte_len = np.array([len(tok.token_bytes(i)) for i in range(tok.vocab_size)], dtype=np.int64)
    val = val_shards(Path(args.tokens), "val")
    vb = val_bytes(val, byte_len, st.train.batch_size, st.model.context, st.train.eval_batches)
    runs = [(var, seed) for seed in seeds for var in variants]
    walls = {} if args.eval_only else train_all(runs, variants, args)
    res: dict = {"profile": args.profile, "sets": args.set, "seeds": seeds, "variants": variants, "anchor": ANCHOR,
                 "runs": {}}
    for var, seed in runs:
        run = Path(args.out) / run_name(var, seed)
        curve = val_curve(run, vb)
        if args.no_rescore:
            if not curve:
                raise AndreaError(f"{run}: no held-out records in model.loss.json (train.eval_every?)")
            last = json.loads((run / "main" / "model.loss.json").read_text(encoding="utf-8"))["val"][-1]
            per = {s: last["per_source"][s] * vb[s][0] / (vb[s][1] * math.log(2)) for s in vb}
            sc = {"step": int(last["step"]), "per_source": per, "overall_bpb": curve[-1][1]}
        else:
            sc = score(run / "main", st, tok, byte_len, val)
        res["runs"][run_name(var, seed)] = sc | {
            "variant": var, "seed": seed, "train_wall_s": walls.get(run_name(var, seed)),
            "shares": batch_shares(run / "main"), "late_shares": batch_shares(run / "main", since=sc["step"] * 2 // 3),
            "late_reward": pull_rewards(run / "main", since=sc["step"] * 2 // 3), "curve": curve}

    def mean(var: str, get) -> float:
        return float(np.mean([get(r) for r in res["runs"].values() if r["variant"] == var]))

    srcs = sorted(next(iter(res["runs"].values()))["per_source"])
    res["figures"] = {v: figures(res, v, srcs) for v in variants if v != ANCHOR}
    step = {r["step"] for r in res["runs"].values()}
    others = [v for v in variants if v != ANCHOR]
    lines = [f"variants vs {ANCHOR}, profile {args.profile}, step {'/'.join(map(str, sorted(step)))}, seeds {seeds}, "
             f"sets {args.set}: held-out bits per byte (lower is better), mean over seeds", ""]
    for v in others:
        lines.append(f"- `{v}`: {', '.join(variants[v])}")
    lines += ["", "| variant | overall ratio | worst source ratio (source) | steps-to-reach ratio |", "|---|---|---|---|"]
    for v in others:
        f = res["figures"][v]
        reach = "not reached" if f["steps_to_reach_ratio"] is None else f"{f['steps_to_reach_ratio']:.3f}"
        lines.append(f"| {v} | {f['overall_ratio']:.4f} | {f['worst_source_ratio']:.4f} ({f['worst_source']}) | {reach} |")
    lines += ["", f"| source | {ANCHOR} bpb | " + " | ".join(f"{v} bpb (ratio, share, late share)" for v in others) +
              f" | {ANCHOR} share |", "|---|---|" + "---|" * len(others) + "---|"]
    for s in srcs:
        ub = mean(ANCHOR, lambda r: r["per_source"][s])
        cells = [f"{mean(v, lambda r: r['per_source'][s]):.4f} ({res['figures'][v]['source_ratio'][s]:.3f}, "
                 f"{res['figures'][v]['shares'][s]:.3f}, {res['figures'][v]['late_shares'][s]:.3f})" for v in others]
        lines.append(f"| {s} | {ub:.4f} | " + " | ".join(cells) +
                     f" | {mean(ANCHOR, lambda r: r['shares'].get(s, 0.0)):.3f} |")
    lines.append(f"| **overall** | {mean(ANCHOR, lambda r: r['overall_bpb']):.4f} | " + " | ".join(
        f"{res['figures'][v]['overall_bpb']:.4f} ({res['figures'][v]['overall_ratio']:.3f})" for v in others) + " | |")
    lines += ["", "| source | " + " | ".join(f"{v} mean pull reward, last third" for v in others) + " |",
              "|---|" + "---|" * len(others)]
    for s in srcs:
        lines.append(f"| {s} | " + " | ".join(f"{res['figures'][v]['late_reward'][s]:.2f}" for v in others) + " |")
    lines.append("| *pooled within-source std* | " + " | ".join(
        f"{res['figures'][v]['late_reward_spread']:.2f}" for v in others) + " |")
    lines += ["", "steps-to-reach: the first step at which the variant's mean held-out curve (in-training "
              f"estimate, every train.eval_every steps) reaches {ANCHOR}'s final value on the same curve, "
              "over the run's steps. share: of all training batches (warmup included); late share: of the "
              "batches of the run's last third.", "", "per seed, overall bpb: " + ", ".join(
        f"{name} {r['overall_bpb']:.4f}" for name, r in res["runs"].items())]
    md = "\n".join(lines) + "\n"
    atomic_write_json(Path(args.out) / "compare.json", res)
    atomic_write_text(Path(args.out) / "compare.md", md)
    print(md)
    return 0


if __name__ == "__main__":
    exit_main(main, "curriculum_compare")
