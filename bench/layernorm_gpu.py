"""Benchmark: each LayerNorm kernel (and the residual add and cast beside it) alone on the GPU, ms and
GB/s of the bytes it must move, with a device copy and torch's F.layer_norm as anchors, same run.

    PYTHONPATH=. python3 bench/layernorm_gpu.py                           # 120M B=32 and 480M B=8 rows
    PYTHONPATH=. python3 bench/layernorm_gpu.py --shapes 32768x768 --sweep --torch --json out.json
    python3 .wt/ln/bench/layernorm_gpu.py --tree .                        # another tree's kernels

A shape is ``NxC`` (N = B * T rows of the residual stream, C = d_model); bf16 storage as the engine
runs it: x, dx and the stream fp32, y, dy and the branch gradient bf16. Rows timed (CUDA events,
``--reps`` calls after one untimed call): ``copy`` (cupy copy of N x C fp32: the device's
read+write bandwidth), ``ln fwd``, ``residual add``, ``ln bwd`` (dx += and dg, db += over the
two-stage partials, the whole launcher), ``wsum`` (the partials' reduction alone), ``cast``
(dres -> bf16), and, where the tree has them, ``residual+ln fwd`` (one kernel) and ``ln bwd+cast``
(the backward writing the branch gradient too). Bytes: each row's compulsory traffic (fp32 4 B,
bf16 2 B per element, dx read and written; the (N,) statistics; the partials and g, b ignored).
``--sweep``: the backward for every (V, R) of kernels.LN_BWD_BUILT that fits C. ``--torch``:
F.layer_norm forward and backward (torch.autograd.grad of x, w, b) on fp32 x, as the anchor's autocast
runs LayerNorm (its bytes: x, y fp32; x, dy read, dx written fp32). ``--tree``: import ``andrea``
from that repository root instead of this script's (to time another version's kernels).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

SHAPES = ["32768x768", "8192x1536"]


def bench_shape(N: int, C: int, reps: int, sweep: bool) -> dict:
    import cupy as cp

    from andrea.cuda import kernels as K
    from andrea.cuda.loader import kernel
    from engine_gpu import event_ms      # bench/ is this script's folder; andrea is already imported (--tree)

    cp.random.seed(0)
    bf16 = lambda *shape: (cp.random.standard_normal(shape, dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
    x = cp.random.standard_normal((N, C), dtype=cp.float32)
    a2 = cp.random.standard_normal((N, C), dtype=cp.float32)
    g, b = cp.ones(C, cp.float32), cp.zeros(C, cp.float32)
    y, dy, br, low = cp.zeros((N, C), cp.uint16), bf16(N, C), bf16(N, C), cp.zeros((N, C), cp.uint16)
    dx, xo = cp.zeros((N, C), cp.float32), cp.zeros((N, C), cp.float32)
    mean, rstd = cp.zeros(N, cp.float32), cp.zeros(N, cp.float32)
    dg, db = cp.zeros(C, cp.float32), cp.zeros(C, cp.float32)
    n_chunks = (N + K.LN_ROWS_PER_CHUNK - 1) // K.LN_ROWS_PER_CHUNK
    part = cp.zeros(n_chunks * 2 * C, cp.float32)
    K.k_layernorm_fwd("bf16", y, mean, rstd, x, g, b, N, C)
    nc, st = N * C, 8 * N
    rows = {}

    def row(name, fn, nbytes):
        ms = event_ms(fn, reps)
        rows[name] = {"ms": ms, "bytes": nbytes, "GBps": nbytes / ms / 1e6}

    row("copy", lambda: cp.copyto(dx, x), 8 * nc)
    row("ln fwd", lambda: K.k_layernorm_fwd("bf16", y, mean, rstd, x, g, b, N, C), 6 * nc + st)
    row("residual add", lambda: K.k_residual_add("bf16", xo, a2, br, nc), 10 * nc)
    if hasattr(K, "k_residual_layernorm_fwd"):
        row("residual+ln fwd", lambda: K.k_residual_layernorm_fwd("bf16", xo, y, mean, rstd, a2, br, g, b, N, C),
            12 * nc + st)
    K.k_layernorm_fwd("bf16", y, mean, rstd, x, g, b, N, C)
    row("ln bwd", lambda: K.k_layernorm_bwd("bf16", dx, dg, db, dy, x, mean, rstd, g, part, N, C), 14 * nc + st)
    if hasattr(K, "k_layernorm_wsum"):
        row("wsum", lambda: K.k_layernorm_wsum(dg, db, part, n_chunks, C), 8 * n_chunks * C)
    else:
        wsum = kernel("layernorm.cu", "k_layernorm_bwd_wsum")
        row("wsum", lambda: wsum((K.blocks(C, 128),), (128,), (part, dg, db, np.int32(n_chunks), np.int32(C))),
            8 * n_chunks * C)
    row("cast", lambda: K.k_cast("bf16", low, dx, nc), 6 * nc)
    if hasattr(K, "ln_bwd_vr"):
        row("ln bwd+cast", lambda: K.k_layernorm_bwd("bf16", dx, dg, db, dy, x, mean, rstd, g, part, N, C, dlow=low),
            16 * nc + st)
        rows["ln bwd"]["vr"] = K.ln_bwd_vr(C)
        if sweep:
            for V, R in sorted(K.LN_BWD_BUILT):
                if 32 * R * (V - 1) < C // 4 <= 32 * R * V:
                    row(f"ln bwd v{V} r{R}", lambda: K.k_layernorm_bwd("bf16", dx, dg, db, dy, x, mean, rstd, g, part,
                                                                       N, C, vr=(V, R)), 14 * nc + st)
    del x, a2, y, dy, br, low, dx, xo, part
    cp.get_default_memory_pool().free_all_blocks()
    return rows


def bench_torch(N: int, C: int, reps: int) -> dict:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    x = torch.randn(N, C, device="cuda", requires_grad=True)
    w = torch.ones(C, device="cuda", requires_grad=True)
    b = torch.zeros(C, device="cuda", requires_grad=True)
    dy = torch.randn(N, C, device="cuda")

    def ms(fn):
        fn()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            fn()
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1) / reps

    nc = N * C
    out = {}
    with torch.no_grad():
        t = ms(lambda: F.layer_norm(x, (C,), w, b, 1e-5))
    out["torch ln fwd"] = {"ms": t, "bytes": 8 * nc + 8 * N, "GBps": (8 * nc + 8 * N) / t / 1e6}
    yt = F.layer_norm(x, (C,), w, b, 1e-5)
    t = ms(lambda: torch.autograd.grad(yt, (x, w, b), dy, retain_graph=True))
    out["torch ln bwd"] = {"ms": t, "bytes": 12 * nc + 8 * N, "GBps": (12 * nc + 8 * N) / t / 1e6}
    del x, w, b, dy, yt
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="NxC, e.g. 32768x768")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also every (V, R) backward that fits C")
    ap.add_argument("--torch", action="store_true", help="also torch's F.layer_norm forward and backward")
    ap.add_argument("--tree", default=None, help="import andrea from this repository root")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(args.tree).resolve() if args.tree else Path(__file__).resolve().parents[1]))
    allres = {}
    for sh in args.shapes:
        try:
            N, C = (int(v) for v in sh.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--shapes {sh}: expected NxC, e.g. 32768x768") from None
        rows = bench_shape(N, C, args.reps, args.sweep)
        if args.torch:
            rows.update(bench_torch(N, C, args.reps))
        allres[sh] = rows
        print(f"\nN x C = {N} x {C} (bf16 storage), ms per call and GB/s of its bytes")
        for k, r in rows.items():
            print(f"  {k:<18} {r['ms']:8.4f} ms {r['bytes'] / 1e6:9.1f} MB {r['GBps']:7.0f} GB/s"
                  + (f"  (V, R) = {r['vr']}" if "vr" in r else ""), flush=True)
    if args.json:
        from andrea.fsutil import atomic_write_json

        atomic_write_json(Path(args.json), allres)
    return 0


if __name__ == "__main__":
    sys.exit(main())
