"""Benchmark: the MLP's proj dgrad with gelu' fused. Our Hopper kernel (andrea/cuda/mm_dgelu.cu) in each
variant, against cuBLASLt's DGELU GEMM (the engine's call) and the same GEMM without the epilogue.

    PYTHONPATH=. python3 bench/dgelu_gemm.py --variants andrea-480m:8,16 andrea-120m:32 \
        --configs default MM_CLUSTER=2 MM_BN=192,MM_STAGES=4 MM_BN=192,MM_STAGES=4,MM_CLUSTER=2 --json dgelu.json

For each variant and batch the problem is the step's: M = B T, N = 4C, K = C (the profile's), random bf16
operands. The arms:
- ``lt_dgelu``: ``cublaslt.Lt.mm`` with the DGELU epilogue, as the engine calls it (its algorithm table);
- ``lt_plain``: the same GEMM without an epilogue, the speed the fusion aims at;
- one arm per ``--configs`` item (comma-separated defines of mm_dgelu.cu; ``default`` the file's own).
Each of ours is checked before it is timed: against lt_dgelu's output (no NaN left from the NaN prefill;
every element within 2e-3 + 2^-7 |ref|) and its own bytes on a repeat. An arm that fails is reported and
not timed. Timing: ``engine_gpu.sustained_ms`` after ``--sustain-ms`` of back-to-back calls (the power
limit a step runs at), ``--rounds`` rounds in alternating order, the median. Printed per arm: us a call,
TFLOP/s, the ratio to lt_dgelu and what it would save a step over the variant's L layers.

With ``--step`` the whole bf16 training step follows (``step_rounds.step_ab``): the engine as committed
(cuBLASLt's DGELU) and, for each arm that passed its check, the engine with ``engine.OWN_DGELU`` on in that
variant, ``--rounds`` alternating rounds, and the ``--anchor`` once: ms, MFU and the ratio to the anchor,
the figures issue 19 holds. ``--json`` is written after every measurement.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import engine_gpu as eg  # noqa: E402
from step_rounds import add_step_args, alternate, anchor_of, power_log_of, print_step, step_ab  # noqa: E402

from andrea.engine.fp8_numpy import bf16_to_f32  # noqa: E402
from andrea.errors import AndreaError  # noqa: E402
from andrea.fsutil import atomic_write_json  # noqa: E402

EPS, TOL = 2.0 ** -7, 2e-3                  # one bf16 unit of the value; fp32 sums in other orders near zero
NAN16 = 0x7FC0


def parse_configs(items: list[str]) -> dict[str, tuple[str, ...]]:
    """{"ours:<item>": defines} for each --configs item ("default" or "NAME=V,NAME=V"), each validated
    by kernels.mm_dgelu_config (an unknown define or a ring too deep is refused here, before any GPU work)."""
    from andrea.cuda.kernels import mm_dgelu_config

    out = {}
    for item in items:
        defines = () if item == "default" else tuple(d for d in item.split(",") if d)
        mm_dgelu_config(defines)
        out[f"ours:{item}"] = defines
    return out


def check(got: np.ndarray, ref: np.ndarray, again: np.ndarray) -> dict:
    """An arm's output (bf16 payloads) against lt_dgelu's: NaN left, elements out of 2e-3 + 2^-7 |ref|, the
    largest difference, and whether a repeat gave the same bytes; ``ok`` when all hold."""
    g, r = bf16_to_f32(got).astype(np.float64), bf16_to_f32(ref).astype(np.float64)
    nan = int(np.isnan(g).sum())
    diff = np.abs(g - r)
    bad = int((diff > TOL + EPS * np.abs(r)).sum())
    same = bool((got == again).all())
    return {"nan": nan, "bad": bad, "max_abs_diff": float(np.nanmax(diff)) if diff.size else 0.0,
            "same_bytes": same, "ok": nan == 0 and bad == 0 and same}


def shape(s: dict, B: int, configs: dict[str, tuple[str, ...]], rounds: int, sustain_ms: float, reps: int) -> dict:
    """Every arm at the proj dgrad of variant shapes ``s`` and batch B: checks, then us a call."""
    import cupy as cp

    from andrea.cuda.cublaslt import EPILOGUE_DGELU, Lt
    from andrea.cuda.fp8 import LT_WORKSPACE
    from andrea.cuda.kernels import MmDgelu, mm_dgelu_config, mm_dgelu_fits, mm_dgelu_grid
    from attention_gpu import random_bf16

    M, N, K = B * s["T"], 4 * s["C"], s["C"]
    cp.random.seed(0)
    a, x, b = random_bf16((M, K)), random_bf16((M, N)), random_bf16((N, K), fan_in=K)
    d = cp.full((M, N), NAN16, cp.uint16)
    lt = Lt(cp.empty(LT_WORKSPACE, cp.uint8))
    calls = {"lt_dgelu": lambda: lt.mm(d, a, b, tb=True, epilogue=EPILOGUE_DGELU, aux=x),
             "lt_plain": lambda: lt.mm(d, a, b, tb=True)}
    calls["lt_dgelu"]()
    ref = cp.asnumpy(d)
    res: dict = {"M": M, "N": N, "K": K, "layers": s["L"]}
    for name, defines in configs.items():
        if not mm_dgelu_fits(M, N, K, mm_dgelu_config(defines)):
            res[name] = {"skipped": f"{M} x {N} x {K} does not fit the variant"}
            continue
        try:
            mm = MmDgelu(defines)
        except AndreaError as e:
            res[name] = {"skipped": str(e)}
            continue
        d.fill(NAN16)
        mm(d, a, b, x)
        got = cp.asnumpy(d)
        d.fill(NAN16)
        mm(d, a, b, x)
        res[name] = check(got, ref, cp.asnumpy(d))
        res[name]["registers"] = int(mm.fn.attributes["num_regs"])
        res[name]["ctas"] = mm_dgelu_grid(M, N, mm.cfg, mm.slots)   # the persistent grid, all resident
        if res[name]["ok"]:
            calls[name] = (lambda m: lambda: m(d, a, b, x))(mm)
    for fn in calls.values():                 # warm every arm once more before the rounds
        fn()
    times = alternate(rounds, list(calls), lambda n: 1e3 * eg.sustained_ms(calls[n], reps, sustain_ms))
    flops = 2.0 * M * N * K
    for n, us in times.items():
        med = statistics.median(us)
        res.setdefault(n, {}).update(us=med, us_rounds=us, tflops=flops / (med * 1e-6) / 1e12)
    base = res["lt_dgelu"]["us"]
    for n in times:
        res[n]["vs_lt_dgelu"] = base / res[n]["us"]
        res[n]["saves_ms_a_step"] = (base - res[n]["us"]) * s["L"] / 1e3
    return res


def report(key: str, res: dict) -> str:
    """One line an arm: checks, us, TFLOP/s, ratio to lt_dgelu and the step's saving."""
    lines = [f"{key}: {res['M']} x {res['N']} x {res['K']}, {res['layers']} layers"]
    for n, r in res.items():
        if not isinstance(r, dict):
            continue
        if "skipped" in r:
            lines.append(f"  {n}: skipped ({r['skipped']})")
            continue
        chk = ""
        if "ok" in r:
            chk = (" checked" if r["ok"] else f" FAILED CHECK (nan {r['nan']}, out of tolerance {r['bad']}, "
                   f"same bytes {r['same_bytes']})") + f", max |diff| {r['max_abs_diff']:.3g}, {r['registers']} regs, {r['ctas']} CTAs"
        if "us" in r:
            lines.append(f"  {n}: {r['us']:.1f} us ({r['tflops']:.0f} TFLOP/s), {r['vs_lt_dgelu']:.3f}x lt_dgelu, "
                         f"{r['saves_ms_a_step']:+.2f} ms a step{chk}")
        else:
            lines.append(f"  {n}:{chk}, not timed")
    return "\n".join(lines)


def step(s: dict, B: int, configs: dict[str, tuple[str, ...]], passed, rounds: int, steps: int, warmup: int,
         anchor: str | None, plog=None) -> dict:
    """The training step with cuBLASLt's DGELU (``lt_dgelu``) and with each config in ``passed`` (names that
    passed their check alone) through engine.OWN_DGELU, alternating; the anchor once (``plog``: step_ab's)."""
    import andrea.cuda.engine as ce

    settings = {"lt_dgelu": lambda: eg.patched(ce, OWN_DGELU=False)}
    for n in passed:
        settings[n] = (lambda d=configs[n]: eg.patched(ce, OWN_DGELU=True, OWN_DGELU_DEFINES=d))
    return step_ab(s, B, rounds, steps, warmup, anchor, settings, plog)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", default=["andrea-480m:8,16", "andrea-120m:32"])
    ap.add_argument("--batch", type=int, default=8, help="batch of a variant named without ':B'")
    ap.add_argument("--configs", nargs="+", default=["default"],
                    help="mm_dgelu.cu variants: 'default' or comma-separated NAME=VALUE defines")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sustain-ms", type=float, default=200.0)
    ap.add_argument("--reps", type=int, default=20, help="timed calls (at least)")
    ap.add_argument("--step", action="store_true", help="then the training step with each arm that passed")
    add_step_args(ap)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        configs = parse_configs(args.configs)
    except AndreaError as e:
        print(f"dgelu_gemm: {e}", file=sys.stderr)
        return 2
    anchor, out = anchor_of(args), {}
    with power_log_of(args, when=args.step) as plog:
        for v, B in eg.parse_variants(args.variants, args.batch):
            key, s = f"{v}:B{B}", eg.variant_shapes(v)
            out[key] = {"alone": shape(s, B, configs, args.rounds, args.sustain_ms, args.reps)}
            print(report(key, out[key]["alone"]), flush=True)
            if args.json:
                atomic_write_json(Path(args.json), out)
            if not args.step:
                continue
            passed = [n for n in configs if out[key]["alone"].get(n, {}).get("ok")]
            out[key]["step"] = step(s, B, configs, passed, args.rounds, args.steps, args.warmup, anchor, plog)
            print_step(key, out[key]["step"], ["lt_dgelu", *passed])
            if args.json:
                atomic_write_json(Path(args.json), out)
    return 0


if __name__ == "__main__":
    eg.exit_gpu_main(main, "dgelu_gemm")
