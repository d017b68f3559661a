"""Benchmark: andrea/cuda/attention.cu built with -D switches, against the plain build, in one process.

    PYTHONPATH=. python3 bench/attention_variants.py --variant ftz=ATTN_EX2_FTZ \
        --variant late=ATTN_DS_LATE,ATTN_DKVS_MINB=3 --rounds 2 --json av.json      # on the GPU

For a kernel change kept behind an #ifdef while it is measured (the losers are deleted after). Each
variant NAME=DEF[,DEF...] is the file with those `#define`s first (andrea.cuda.loader.build, the
loader's options); "base" is the plain build. Per shape (--shapes, default the 480M B=8 and 120M B=32
layers of bench/attention_gpu.py) and round, every build in turn (the order reversed on odd rounds, so
clock drift within the call falls on all alike) runs the engine's attention forward and backward
(kernels.attn_impl's pick; "wgds" at D = 64 on a Hopper GPU) on the same seeded bf16 inputs:
- ms per call of each, CUDA events, one untimed call then --reps;
- then one more forward and backward into NaN-filled outputs, and those (y, lse2 and dqkv) against
  base's: "same bytes", or how many elements differ and the largest difference over the largest
  |base value| (a variant may change bits on purpose; an element it leaves unwritten stays NaN).
Needs CuPy and a GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from attention_gpu import SHAPES, T, random_bf16  # noqa: E402
from engine_gpu import event_ms, exit_gpu_main  # noqa: E402
from fp8_ab import round_order  # noqa: E402  (A B C, C B A, ...)

from andrea.errors import AndreaError  # noqa: E402
from andrea.fsutil import atomic_write_json  # noqa: E402

FILE = "attention.cu"


def parse_variant(text: str) -> tuple[str, tuple[str, ...]]:
    """"NAME=DEF[,DEF...]" -> (NAME, defines); each DEF is MACRO or MACRO=VALUE (loader.define_lines)."""
    from andrea.cuda.loader import define_lines

    name, sep, defs = text.partition("=")
    defines = tuple(d for d in defs.split(",") if d)
    if not sep or not name or name == "base" or not defines:
        raise AndreaError(f"--variant {text!r}: expected NAME=MACRO[=VALUE][,MACRO...] with NAME other than 'base'")
    define_lines(defines)                                    # refuses a malformed macro in one line
    return name, defines


def compare(got, ref, xp) -> str:
    """"same bytes", or the count of differing elements and the largest difference relative to max |ref|;
    16-bit outputs are bf16 bits, the others float32; xp is numpy or cupy (the arrays' module)."""
    bits = xp.uint16 if got.dtype == xp.uint16 else xp.uint32
    n = int((got.view(bits) != ref.view(bits)).sum())
    if n == 0:
        return "same bytes"
    g, f = ((x.astype(xp.uint32) << 16).view(xp.float32) if bits == xp.uint16 else x for x in (got, ref))
    rel = float(xp.nanmax(xp.abs(g - f))) / max(float(xp.nanmax(xp.abs(f))), 1e-30)
    return f"{n} elements differ, max |diff| = {rel:.2e} of max |value|"


def run_shape(B: int, C: int, H: int, builds: dict, rounds: int, reps: int) -> dict:
    import cupy as cp

    from andrea.cuda import kernels as K
    from andrea.cuda import loader

    N = B * T
    cp.random.seed(0)
    qkv, dy = random_bf16((N, 3 * C)), random_bf16((N, C))
    y, dqkv = cp.empty((N, C), cp.uint16), cp.empty((N, 3 * C), cp.uint16)
    lse, dvec = cp.empty(B * H * T, cp.float32), cp.empty(B * H * T, cp.float32)
    impl = K.attn_impl("bf16", C // H, 3 * C, "bwd")
    ds = cp.empty(K.attn_ds_bytes(T, B * H), cp.uint8) if impl == "wgds" else None
    fwd = lambda: K.k_attn_fwd("bf16", y, lse, qkv, B, T, C, H)  # noqa: E731
    bwd = lambda: K.k_attn_bwd("bf16", dqkv, dy, y, lse, dvec, qkv, B, T, C, H, False, impl=impl, ds=ds)  # noqa: E731
    res = {name: {"fwd_ms": [], "bwd_ms": []} for name in builds}
    ref = None
    for r in range(rounds):
        for name in round_order(list(builds), r):
            loader.swap(FILE, builds[name])
            res[name]["fwd_ms"].append(event_ms(fwd, reps))
            res[name]["bwd_ms"].append(event_ms(bwd, reps))
            if "outputs" in res[name]:                       # each build's outputs are checked once
                continue
            for a, nan in ((y, 0x7FC0), (dqkv, 0x7FC0), (lse, cp.nan), (dvec, cp.nan)):
                a.fill(nan)                                  # an element a build leaves unwritten shows
            fwd()
            bwd()
            outs = (y.copy(), lse.copy(), dqkv.copy())
            ref = ref or outs                                # round 0 runs base first
            res[name]["outputs"] = {k: compare(o, f, cp) for k, o, f in zip(("y", "lse2", "dqkv"), outs, ref)}
    loader.swap(FILE, builds["base"])
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=DEF[,DEF...]",
                    help="a build of attention.cu with these #defines (MACRO or MACRO=VALUE); repeatable")
    ap.add_argument("--shapes", nargs="+", default=["andrea-480m", "andrea-120m"],
                    help="layers of bench/attention_gpu.py's SHAPES, by variant name")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    try:
        variants = dict(parse_variant(v) for v in args.variant)
        shapes = {s[0]: s for s in SHAPES}
        unknown = [s for s in args.shapes if s not in shapes]
        if unknown:
            raise AndreaError(f"--shapes {' '.join(unknown)}: not in bench/attention_gpu.py's "
                              f"{', '.join(shapes)}")
        from andrea.cuda.loader import build, cupy_or_none

        if cupy_or_none() is None:
            raise AndreaError("attention variants: needs CuPy and a CUDA device (pip install -e '.[gpu]')")
        builds = {"base": build(FILE)}
        for name, defines in variants.items():
            builds[name] = build(FILE, defines)
            print(f"built {name}: {' '.join(defines)}", flush=True)
    except AndreaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = {"variants": {name: list(d) for name, d in variants.items()}}
    for s in args.shapes:
        _, B, C, H = shapes[s]
        res = run_shape(B, C, H, builds, args.rounds, args.reps)
        out[f"{s}:B{B}"] = res
        print(f"{s} B={B} (D={C // H}), ms per call by round:")
        for name, r in res.items():
            print(f"  {name:<12} fwd {' '.join(f'{x:.4f}' for x in r['fwd_ms'])}   bwd "
                  f"{' '.join(f'{x:.4f}' for x in r['bwd_ms'])}   "
                  + "; ".join(f"{k}: {v}" for k, v in r["outputs"].items()), flush=True)
        if args.json:
            atomic_write_json(Path(args.json), out)
    return 0


if __name__ == "__main__":
    exit_gpu_main(main, "attention_variants")
