"""Benchmark: the optimizer's kernels alone on the GPU at a model's parameter count, ms and GB/s of
the bytes each must move, with a device copy as the anchor, same run.

    PYTHONPATH=. python3 bench/optim_gpu.py                          # andrea-120m and andrea-480m
    PYTHONPATH=. python3 bench/optim_gpu.py --variants andrea-480m --reps 20 --json optim.json

Rows (CUDA events, ``--reps`` calls after one untimed call, flat fp32 buffers of n = the variant's
parameter count, bf16 compute weights): ``copy`` (n fp32 read + written: the device's streaming
bandwidth), ``grad norm`` (k_grad_norm: the partial sums and the final block, 4 B a parameter),
``adamw 1/thread`` (k_adamw_bf16, one parameter a thread), ``adamw`` (kernels.k_adamw: four a
thread, the same bits) and ``adamw + amax`` (the same, also leaving the max |bf16 copy| of each
kernels.ADAMW_CHUNK parameters, what the fp8 engine's weight casts read instead of the copy): g read,
w, m, v read and written, the bf16 copy written, 30 B a parameter. ``ratio`` is each row's GB/s over the copy's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine_gpu import exit_gpu_main  # noqa: E402


def bench_variant(name: str, reps: int) -> dict:
    import cupy as cp
    import numpy as np

    from andrea.cuda import kernels as K
    from andrea.cuda.loader import kernel
    from andrea.engine.model import ModelConfig, param_layout
    from engine_gpu import event_ms, variant_shapes

    s = variant_shapes(name)
    layout = param_layout(ModelConfig(s["V"], s["C"], s["H"], s["L"], s["T"]))
    n = layout.n_params
    cp.random.seed(0)
    w = cp.random.standard_normal(n, dtype=cp.float32)
    g = cp.random.standard_normal(n, dtype=cp.float32) * 1e-3
    m = cp.zeros(n, cp.float32)
    v = cp.zeros(n, cp.float32)
    low = cp.zeros(n, cp.uint16)
    dst = cp.empty_like(w)
    part = cp.zeros(K.NORM_BLOCKS, cp.float32)
    gstate = cp.asarray(np.array([0.0, 1.0, 1.0, 0.0], np.float32))
    hp = cp.asarray(K.adam_hyper(10, 1e-4, 0.9, 0.95, 1e-8, 0.1))
    rows = {}

    def row(what, fn, nbytes):
        ms = event_ms(fn, reps)
        rows[what] = {"ms": ms, "bytes": nbytes, "GBps": nbytes / ms / 1e6}

    row("copy", lambda: cp.copyto(dst, w), 8 * n)
    row("grad norm", lambda: K.k_grad_norm(g, n, part, 1.0, 1.0, gstate), 4 * n)
    args = (w, g, m, v, low, np.int64(n), hp, gstate, np.int64(layout.n_decay), np.int32(1))
    row("adamw 1/thread", lambda: kernel("optim.cu", "k_adamw_bf16")((K.blocks(n),), (256,), args), 30 * n)
    row("adamw", lambda: K.k_adamw("bf16", w, g, m, v, low, n, hp, gstate, layout.n_decay, 1), 30 * n)
    part = cp.zeros(-(-n // K.ADAMW_CHUNK), cp.float32)
    row("adamw + amax", lambda: K.k_adamw("bf16", w, g, m, v, low, n, hp, gstate, layout.n_decay, 1, part=part),
        30 * n)
    cp.cuda.Stream.null.synchronize()
    copy = rows["copy"]["GBps"]
    for r in rows.values():
        r["ratio"] = r["GBps"] / copy
    return {"variant": name, "n_params": n, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["andrea-120m", "andrea-480m"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    out = []
    for name in args.variants:
        res = bench_variant(name, args.reps)
        out.append(res)
        print(f"\n{name}: n = {res['n_params']:,} parameters")
        print(f"  {'kernel':<16} {'ms':>8} {'GB/s':>8} {'of copy':>8}")
        for what, r in res["rows"].items():
            print(f"  {what:<16} {r['ms']:8.3f} {r['GBps']:8.0f} {r['ratio']:8.2f}")
    if args.json:
        from andrea.fsutil import atomic_write_json
        atomic_write_json(Path(args.json), out)
    return 0


if __name__ == "__main__":
    exit_gpu_main(main, "optim_gpu")
