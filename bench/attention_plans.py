"""Benchmark: every execution plan cuDNN offers for the engine's attention graphs, timed alone.

    PYTHONPATH=. python3 bench/attention_plans.py --variants andrea-480m:8 --json plans.json   # on the GPU

The engine (``andrea.cuda.cudnn_attention``) builds the plan its FWD_PLAN / BWD_PLAN name, or cuDNN's first
(heuristics mode A). For each variant and batch (T, C, H from its profile) this builds, for the causal forward
and for the deterministic backward over the whole batch, a ``CudnnAttention`` under each plan that cuDNN's
heuristics A, B and its fallback offer (``CudnnAttention.offered``), and the engine's as committed. Each
runs on the same random bf16 qkv and dy (the backward on the committed forward's y and lse); recorded per
plan: whether it built, whether ``--repeats`` calls leave the same output bytes (the engine's runs must
repeat theirs), its largest difference from the committed plan's output, and its us a call (median of
``--rounds`` rounds of ``engine_gpu.sustained_ms`` after ``--sustain-ms`` back to back: the power-capped
steady state a step runs in). The backward is also timed in chunks of fewer sequences a call (rows
"chunk c": the committed plan over a scratch that fits c sequences' workspace, as the engine runs a layer
where its free bytes are fewer). Printed: one line a plan, fastest last. The step's figure of a plan is
``bench/engine_ab.py --flip "cudnn_attention.BWD_PLAN='NAME'"``. ``--json`` is written after each variant.
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

from andrea.engine.fp8_numpy import bf16_to_f32  # noqa: E402
from andrea.fsutil import atomic_write_json  # noqa: E402

PASSES = {"forward": ("FWD_PLAN", False), "backward": ("BWD_PLAN", True)}


def one_variant(name: str, B: int, a) -> dict:
    """Every offered plan of both passes at (name, B): its row, and the committed plan's."""
    import cupy as cp

    import andrea.cuda.cudnn_attention as ca
    from attention_gpu import random_bf16

    s = eg.variant_shapes(name)
    T, C, H = s["T"], s["C"], s["H"]
    cp.random.seed(0)
    qkv, dy = random_bf16((B * T, 3 * C)), random_bf16((B * T, C))
    y, lse, dqkv = cp.zeros((B * T, C), cp.uint16), cp.zeros((B * H, T), cp.float32), cp.zeros_like(qkv)
    committed = ca.CudnnAttention(B, T, C, H, room=1 << 40)
    scratch = cp.empty(1 << 31, cp.uint8)
    committed.forward(y, lse, qkv, scratch)
    y0, lse0 = y.copy(), lse.copy()
    out = {"describe": committed.describe(), "B": B, "T": T, "C": C, "H": H}

    def run(att, backward: bool, room):
        if backward:
            att.backward(dqkv, dy, y0, lse0, qkv, room)
        else:
            att.forward(y, lse, qkv, room)
        return dqkv if backward else y

    def measure(row: dict, att, backward: bool, room, ref) -> dict:
        """``row`` with the bytes checks and the us a call of ``att`` over ``room``."""
        outs = []
        for _ in range(a.repeats):
            (dqkv if backward else y).fill(0xFFFF)       # NaN bits: a plan that leaves bytes unwritten shows
            outs.append(run(att, backward, room).copy())
        row["same_bytes"] = all(bool((o == outs[0]).all()) for o in outs[1:])
        row["same_as_committed"] = bool((outs[0] == ref).all())
        diff = np.abs(bf16_to_f32(cp.asnumpy(outs[0])) - bf16_to_f32(cp.asnumpy(ref)))
        row["max_abs_diff"] = float(np.nan_to_num(diff, nan=np.inf).max())
        us = [1e3 * eg.sustained_ms(lambda: run(att, backward, room), a.reps, a.sustain_ms) for _ in range(a.rounds)]
        row["us"], row["us_rounds"] = statistics.median(us), us
        return row

    for kind, (var, backward) in PASSES.items():
        ref = run(committed, backward, scratch).copy()
        rows = [measure({"plan": "committed"}, committed, backward, scratch, ref)]
        for plan in committed.offered(backward):
            with eg.patched(ca, **{var: plan}):
                att = ca.CudnnAttention(B, T, C, H, room=1 << 40)
            if att.built.get(backward) != plan:               # offered, but not built: say why
                rows.append({"plan": plan, "error": att.built.get(backward)})
                print(f"  {kind} {plan}: {rows[-1]['error']}", flush=True)
            else:
                rows.append(measure({"plan": plan}, att, backward, scratch, ref))
        for c in range(B - 1, 0, -1) if backward else ():   # the committed plan, c sequences a call
            if B % c == 0:
                rows.append(measure({"plan": f"chunk {c}"}, committed, backward, scratch[:committed._ws(c)], ref))
        base = rows[0]["us"]
        for row in sorted((r for r in rows if "us" in r), key=lambda r: -r["us"]):
            print(f"  {kind} {row['plan']}: {row['us']:.1f} us ({row['us'] / base:.3f}x committed), same bytes "
                  f"{row['same_bytes']}, = committed {row['same_as_committed']}, max diff {row['max_abs_diff']:.3g}",
                  flush=True)
        out[kind] = rows
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", default=["andrea-480m:8"], help="NAME or NAME:B,B (engine_gpu's)")
    ap.add_argument("--batch", type=int, default=8, help="batch of a variant named without ':B'")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds a plan (median)")
    ap.add_argument("--sustain-ms", type=float, default=200.0)
    ap.add_argument("--reps", type=int, default=20, help="timed calls a round (at least)")
    ap.add_argument("--repeats", type=int, default=3, help="calls compared for their bytes")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    specs = eg.parse_variants(a.variants, a.batch)           # refused before any GPU work
    res = {}
    for name, B in specs:
        print(f"{name} B={B}", flush=True)
        res[f"{name}:{B}"] = one_variant(name, B, a)
        if a.json:
            atomic_write_json(a.json, res)
    return 0


if __name__ == "__main__":
    eg.exit_gpu_main(main, "attention_plans")
