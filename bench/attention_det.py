"""Benchmark: what byte-identical runs cost in attention. cuDNN's deterministic SDPA backward (the
engine's) against cuDNN's default one, which adds dQ by float atomics: alone and in the training step.

    PYTHONPATH=. python3 bench/attention_det.py --variants andrea-480m:8,16 --json det.json   # on the GPU

For each variant and batch (T, C, H, L from its profile):
- alone: one layer's backward as the engine builds it (``CudnnAttention`` over the whole batch, after
  its forward on random bf16 qkv), once with each setting of ``cudnn_attention.DETERMINISTIC``. Each is
  timed by ``engine_gpu.sustained_ms``, after ``--sustain-ms`` of back-to-back calls (the power limit
  the step runs at). ``--rounds`` rounds alternate which goes first; the median is reported. Also
  recorded: whether ``--repeats`` calls leave the same dqkv bytes, and the largest difference between
  the two settings' dqkv;
- step (unless ``--no-step``): ``engine_gpu.bench_ours`` under each setting, ``--rounds`` alternating
  rounds, and the ``--anchor`` (``none``: no anchor) once in the same process; each setting's ratio of
  tokens/s and its MFU against it.
Printed: each setting's us a layer and their difference over the variant's L layers as ms a step; the
step's ms and ratios. ``--json`` is written after every measurement. DETERMINISTIC = False exists for
this bench: the engine never sets it, and the runs the issue holds byte-identical never use it.
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
from andrea.fsutil import atomic_write_json  # noqa: E402

SETTINGS = {"deterministic": True, "default": False}        # name -> cudnn_attention.DETERMINISTIC


def alone(s: dict, B: int, rounds: int, sustain_ms: float, reps: int, repeats: int) -> dict:
    """One layer's backward under each setting: us a call (median of the rounds), same bytes over
    ``repeats`` calls, the workspace bytes; and the largest |default - deterministic| of dqkv beside the
    largest |deterministic| (both as float values)."""
    import cupy as cp

    import andrea.cuda.cudnn_attention as ca
    from attention_gpu import random_bf16

    T, C, H = s["T"], s["C"], s["H"]
    cp.random.seed(0)
    qkv, dy = random_bf16((B * T, 3 * C)), random_bf16((B * T, C))
    y, lse, dqkv = cp.zeros((B * T, C), cp.uint16), cp.zeros((B * H, T), cp.float32), cp.zeros_like(qkv)
    arms = {}
    for name, det in SETTINGS.items():
        with eg.patched(ca, DETERMINISTIC=det):
            att = ca.CudnnAttention(B, T, C, H, room=1 << 40)      # the whole batch a call
        arms[name] = (att, cp.empty(max(att.fwd[1], att.bwd[att.chunk][1], 1), cp.uint8))
    arms["deterministic"][0].forward(y, lse, qkv, arms["deterministic"][1])   # y and lse as a step has them

    res, first = {}, {}
    for name, (att, scratch) in arms.items():
        outs = []
        for _ in range(repeats):
            att.backward(dqkv, dy, y, lse, qkv, scratch)
            outs.append(dqkv.copy())
        first[name] = outs[0]
        res[name] = {"workspace_bytes": int(scratch.nbytes), "repeats": repeats,
                     "same_bytes": all(bool((o == outs[0]).all()) for o in outs[1:])}
    ref, other = (bf16_to_f32(cp.asnumpy(first[n])) for n in ("deterministic", "default"))
    res["max_abs_diff"] = float(np.abs(other - ref).max())
    res["max_abs_deterministic"] = float(np.abs(ref).max())

    def measure(name: str) -> float:
        att, scratch = arms[name]
        return 1e3 * eg.sustained_ms(lambda: att.backward(dqkv, dy, y, lse, qkv, scratch), reps, sustain_ms)

    for name, us in alternate(rounds, list(SETTINGS), measure).items():
        res[name].update(us=statistics.median(us), us_rounds=us)
    res["det_minus_default_us"] = res["deterministic"]["us"] - res["default"]["us"]
    res["det_minus_default_ms_a_step"] = res["det_minus_default_us"] * s["L"] / 1e3
    return res


def step(s: dict, B: int, rounds: int, steps: int, warmup: int, anchor: str | None, plog=None) -> dict:
    """The engine's bf16 step (train.attention=cudnn) under each setting, alternating; the anchor once;
    ratios of tokens/s and MFU against it (``plog``: step_ab's)."""
    import andrea.cuda.cudnn_attention as ca

    settings = {n: (lambda det=det: eg.patched(ca, DETERMINISTIC=det)) for n, det in SETTINGS.items()}
    return step_ab(s, B, rounds, steps, warmup, anchor, settings, plog, attention="cudnn")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", default=["andrea-480m:8,16"])
    ap.add_argument("--batch", type=int, default=8, help="batch of a variant named without ':B'")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds, alone and in the step")
    ap.add_argument("--sustain-ms", type=float, default=200.0)
    ap.add_argument("--reps", type=int, default=20, help="timed calls alone (at least)")
    ap.add_argument("--repeats", type=int, default=5, help="backward calls compared for their bytes")
    ap.add_argument("--no-step", action="store_true", help="only the backward alone")
    add_step_args(ap)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    anchor, out = anchor_of(args), {}
    with power_log_of(args, when=not args.no_step) as plog:
        for v, B in eg.parse_variants(args.variants, args.batch):
            s, key = eg.variant_shapes(v), f"{v}:B{B}"
            out[key] = {"alone": alone(s, B, args.rounds, args.sustain_ms, args.reps, args.repeats)}
            a = out[key]["alone"]
            print(f"{key} alone: " + ", ".join(
                f"{n} {a[n]['us']:.1f} us (same bytes over {a[n]['repeats']}: {'yes' if a[n]['same_bytes'] else 'NO'})"
                for n in SETTINGS) + f"; {a['det_minus_default_us']:.1f} us a layer, "
                f"{a['det_minus_default_ms_a_step']:.2f} ms a step over {s['L']} layers; dqkv differs by up to "
                f"{a['max_abs_diff']:.3g} (largest |dqkv| {a['max_abs_deterministic']:.3g})", flush=True)
            if args.json:
                atomic_write_json(Path(args.json), out)
            if args.no_step:
                continue
            out[key]["step"] = step(s, B, args.rounds, args.steps, args.warmup, anchor, plog)
            print_step(key, out[key]["step"], SETTINGS)
            if args.json:
                atomic_write_json(Path(args.json), out)
    return 0


if __name__ == "__main__":
    eg.exit_gpu_main(main, "attention_det")
