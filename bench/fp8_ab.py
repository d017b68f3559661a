"""Benchmark: our engine's bf16 and fp8 steps (and fp8 with andrea/cuda/fp8.py switches flipped) in
alternating rounds of one process, so the H200's clock drift within a call (up to ~1.4 ms a step over
a minute, docs/bench/s16_h200.md) falls on every configuration alike.

    PYTHONPATH=. python3 bench/fp8_ab.py --variants andrea-120m:32 andrea-480m:8 \
        --flip HPRE_E4M3 --rounds 2 --json ab.json                   # on the GPU, ~2 min

Round r runs the configurations bf16, fp8:delayed, then each flip, in that order when r is even and
reversed when it is odd (A B C, C B A, ...); each run is ``bench/engine_gpu.py``'s ``bench_ours``
(CUDA graph, ``--steps`` after ``--warmup``, median of windows). Printed and saved per variant: every
round's ms a step per configuration, per round bf16's ms over each configuration's (the tokens/s
ratio of that round: a paired window), and the median of those paired ratios over the rounds (the
figure held to issue 12's targets, as issue 19 asks for its own). Needs CuPy and a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import engine_gpu as eg  # noqa: E402

from andrea.fsutil import atomic_write_json  # noqa: E402


def configurations(flips: list[str]) -> list[tuple[str, str, list[str]]]:
    """(name, precision, fp8 switches to flip) of each configuration, in a round's first order."""
    return [("bf16", "bf16", []), ("fp8", "fp8:delayed", [])] + [(f"fp8-flip-{sw}", "fp8:delayed", [sw])
                                                                  for sw in flips]


def round_order(cfgs: list, r: int) -> list:
    return cfgs if r % 2 == 0 else cfgs[::-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", default=["andrea-120m:32", "andrea-480m:8"])
    ap.add_argument("--flip", nargs="*", default=[], choices=list(eg.FP8_SWITCHES),
                    help="one more configuration per switch: fp8 with that andrea/cuda/fp8.py boolean flipped")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import andrea.cuda.fp8 as k8

    cfgs = configurations(args.flip)
    out = {}
    for v, B in eg.parse_variants(args.variants, 8):
        s = eg.variant_shapes(v)
        ms = {name: [] for name, _, _ in cfgs}
        for r in range(args.rounds):
            for name, prec, flips in round_order(cfgs, r):
                with eg.patched(k8, **{sw: not getattr(k8, sw) for sw in flips}):
                    ms[name].append(eg.bench_ours(s, B, args.steps, args.warmup, prec)["ms"])
                print(f"{v}:B{B} round {r} {name}: {ms[name][-1]:.2f} ms/step", file=sys.stderr, flush=True)
        ratios = {name: [b / x for b, x in zip(ms["bf16"], m)] for name, m in ms.items()}
        medians = {name: statistics.median(r) for name, r in ratios.items()}
        out[f"{v}:B{B}"] = {"ms": ms, "ratio_vs_bf16": ratios, "median_ratio_vs_bf16": medians}
        for name in ms:
            print(f"{v}:B{B} {name:<22} ms/step {' '.join(f'{x:.2f}' for x in ms[name])}   bf16/this "
                  f"{' '.join(f'{x:.3f}x' for x in ratios[name])}   median {medians[name]:.3f}x", flush=True)
        if args.json:
            atomic_write_json(Path(args.json), out)
    return 0


if __name__ == "__main__":
    eg.exit_gpu_main(main, "fp8_ab")
