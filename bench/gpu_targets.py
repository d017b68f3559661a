"""Issue 19's GPU targets, checked over the JSON of several bench/engine_gpu.py runs: per shape and run, ours
against the FASTEST torch.compile mode measured beside it (the ratio of their median windows and the median of
their paired windows, engine_gpu's ``paired_ratio``: both must reach the floor), the MFU floors and peak memory;
a target counts as met only when each of ``--need`` runs meets it with every compile mode measured.

    python3 bench/gpu_targets.py run1.json run2.json run3.json
    python3 bench/gpu_targets.py run1a.json,run1b.json run2.json run3.json   # one run split over device calls

An argument is one run: its files joined by commas (a shape may appear in one file of a run only). Printed per
target: each run's ratio (tokens/s of ours over the fastest mode's) and its paired-window median, MFU and memory
ratio, then the verdict and
why. Exit 0 when every target is met, 1 when one is not; a file that cannot be read is a one-line error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine_gpu import paired_ratio  # noqa: E402

from andrea.errors import AndreaError, exit_main  # noqa: E402
from andrea.fsutil import read_json  # noqa: E402

# (variant, batch, floor of ours / fastest compile mode in tokens/s, floor of our MFU or None)
TARGETS = [("andrea-12m", 8, 1.10, None), ("andrea-12m", 64, 1.10, None),
           ("andrea-120m", 8, 1.10, None), ("andrea-120m", 32, 1.10, 0.50),
           ("andrea-480m", 8, 1.10, 0.55), ("andrea-480m", 16, 1.10, None)]
MODES = ("compile-default", "compile-reduce-overhead", "compile-max-autotune")   # the "fastest of them"


def load_run(spec: str) -> dict:
    """{shape key: engine_gpu's record} of one run, from its comma-joined files."""
    run, where = {}, {}
    for name in spec.split(","):
        for key, rec in read_json(name, "engine_gpu.py --json file").items():
            if key in run:
                raise AndreaError(f"{key} is in both {where[key]} and {name} of one run; give a run each shape once")
            run[key], where[key] = rec, name
    return run


def check_shape(rec: dict | None, floor: float, mfu_floor: float | None) -> dict:
    """One run's figures for one target and what keeps it from counting (``why``: empty when it is met)."""
    if rec is None or rec.get("partial") or "ours" not in rec:
        return {"why": ["not measured" if rec is None else "partial (the run stopped inside it)"]}
    ours, best = rec["ours"], rec.get("best_compile")          # engine_gpu's fastest compile mode of the run
    why = [f"no {m}" for m in MODES if m not in rec]
    out = {"device": ours.get("device"), "mfu": ours.get("mfu")}
    if best:
        out |= {"best": best, "ratio": rec["ratio_vs_best"], "mem": rec["mem_vs_best"],
                "paired": paired_ratio(ours, rec[best])}           # from the windows: older files lack paired_vs_best
        if out["ratio"] < floor:
            why.append(f"{out['ratio']:.3f}x < {floor:.2f}x against {best}")
        if out["paired"] is None:
            why.append("no timed windows to pair")
        elif out["paired"] < floor:
            why.append(f"paired windows {out['paired']:.3f}x < {floor:.2f}x against {best}")
        if out["mem"] > 1.0:
            why.append(f"memory {out['mem']:.2f} of {best}'s")
    if mfu_floor is not None and (out["mfu"] is None or out["mfu"] < mfu_floor):
        why.append("no MFU" if out["mfu"] is None else f"MFU {out['mfu']:.1%} < {mfu_floor:.0%}")
    return out | {"why": why}


def verdict(per_run: list[dict], runs: int) -> tuple[bool, str]:
    """(met, why) of one target over its runs: met when ``runs`` runs were given and none has a reason against
    it, on one card where the runs name theirs."""
    runs_of: dict[str, list[int]] = {}                       # a reason -> the runs it holds in, in order
    for i, r in enumerate(per_run, 1):
        for w in r["why"]:
            runs_of.setdefault(w, []).append(i)
    reasons = [f"{w} (run{'s' if len(ns) > 1 else ''} {', '.join(map(str, ns))})" for w, ns in runs_of.items()]
    cards = {r.get("device") for r in per_run} - {None}
    if len(per_run) < runs:
        reasons.insert(0, f"{len(per_run)} of {runs} runs")
    if len(cards) > 1:
        reasons.append(f"runs on different cards: {', '.join(sorted(cards))}")
    return not reasons, "; ".join(reasons) or "met"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="one run each: engine_gpu.py --json files, comma-joined")
    ap.add_argument("--need", type=int, default=3, help="runs a target must be met in (the issue: three)")
    args = ap.parse_args(argv)
    runs = [load_run(spec) for spec in args.runs]
    all_met = True
    for v, B, floor, mfu_floor in TARGETS:
        per_run = [check_shape(run.get(f"{v}:B{B}"), floor, mfu_floor) for run in runs]
        met, why = verdict(per_run, args.need)
        all_met &= met
        cells = [f"{r['ratio']:.3f}x" + (f" (paired {r['paired']:.3f}x)" if r["paired"] is not None else "")
                 + (f" MFU {r['mfu']:.1%}" if r.get("mfu") is not None else "")
                 + f" mem {r['mem']:.2f}" if "ratio" in r else "-" for r in per_run]
        need = f">= {floor:.2f}x" + (f", MFU >= {mfu_floor:.0%}" if mfu_floor else "")
        print(f"{v}:B{B} ({need}): {' | '.join(cells)}  ->  {'MET' if met else 'NOT MET'}"
              + ("" if met else f" ({why})"))
    cards = sorted({r.get("ours", {}).get("device") or "card not recorded" for run in runs for r in run.values()})
    print(f"cards: {', '.join(cards)}")
    return 0 if all_met else 1


if __name__ == "__main__":
    exit_main(main, "gpu_targets")
