"""Benchmark: every kernel of our engine's training step, as it runs (CUDA graph), timed by the device.

    PYTHONPATH=. python3 bench/kernel_profile.py --variants andrea-120m:32 andrea-480m:8 \
        --precision bf16 fp8:delayed --json kernels.json                # on the GPU, ~1 min

For each (variant, batch, precision): 4 warm-up steps, the step's ms (host clock over 10 steps), then
torch.profiler (CUPTI, which sees CuPy's and cuBLASLt's launches in this process, graph nodes included)
over ``--steps`` steps: per kernel name its device ms a step, calls a step and us a call, the 40
largest printed. Unlike ``bench/engine_gpu.py --breakdown`` (CUDA events around each launcher, eager
launches) nothing is added between the kernels, so the sum is what the graph runs; the profiler's own
overhead can still stretch it by ~1-2% against the step time. ``--fp8-gelu none`` runs fp8 with
engine.FUSE_GELU_FP8 empty (the fc GEMM plain, GELU passes of their own) for comparison; ``--fp8-flip
SWITCH ...`` runs fp8 again with each of those andrea/cuda/fp8.py booleans flipped alone
(bench/engine_gpu.py's FP8_SWITCHES).
Needs CuPy and PyTorch with CUDA.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import engine_gpu as eg  # noqa: E402

from andrea.fsutil import atomic_write_json  # noqa: E402


def profile(name: str, B: int, spec: str, steps: int = 3, fp8_gelu=None, top: int = 40) -> dict:
    """ms/step and {kernel name: [device ms a step, calls a step]} of one configuration."""
    import cupy as cp
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    import andrea.cuda.engine as ce
    from andrea.cuda.backend import make_backend
    from andrea.engine.engine import Hyper
    from andrea.engine.model import ModelConfig

    s = eg.variant_shapes(name)
    mc = ModelConfig(s["V"], s["C"], s["H"], s["L"], s["T"])
    prec, kw = eg.engine_args(spec)
    with eg.patched(ce, **({} if fp8_gelu is None else {"FUSE_GELU_FP8": fp8_gelu})):
        eng = make_backend().make_engine(mc, B, precision=prec, cuda_graph=True, **kw)
    eng.init_weights(1337)
    x = np.random.default_rng(0).integers(0, s["V"], (B, s["T"])).astype(np.int32)
    y = np.roll(x, -1, axis=1)
    hp, it = Hyper(), [0]

    def step():
        it[0] += 1
        eng.train_step([(x, y)], 3e-4, it[0], hp)

    for _ in range(4):
        step()
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        step()
    cp.cuda.Device().synchronize()
    ms = (time.perf_counter() - t0) * 100
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        cp.cuda.Device().synchronize()
    by = eg.kernel_times(prof, steps)
    del eng
    cp.get_default_memory_pool().free_all_blocks()
    total = sum(v[0] for v in by.values())
    print(f"== {name} B={B} {spec}{'' if fp8_gelu is None else ' fp8-gelu ' + (','.join(fp8_gelu) or 'none')}: "
          f"step {ms:.2f} ms, kernels {total:.2f} ms", flush=True)
    for k, (t, n) in sorted(by.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {t:8.3f} ms {n:6.1f}x  {t / max(n, 1) * 1e3:8.1f} us  {k[:110]}", flush=True)
    return {"ms": ms, "kernels_ms": total, "by": by}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", default=["andrea-120m:32", "andrea-480m:8"])
    ap.add_argument("--precision", nargs="+", default=["bf16", "fp8:delayed"])
    ap.add_argument("--fp8-gelu", default=None, help="'none' (or e.g. 'fwd'): fp8 again with that FUSE_GELU_FP8")
    ap.add_argument("--fp8-flip", nargs="*", default=[], choices=list(eg.FP8_SWITCHES),
                    help="fp8 again with each of these andrea/cuda/fp8.py switches flipped alone")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import andrea.cuda.fp8 as k8

    out = {}
    for v, B in eg.parse_variants(args.variants, 8):
        for p in args.precision:
            out[f"{v}:{B}:{p}"] = profile(v, B, p, args.steps)
            if args.fp8_gelu is not None and p.startswith("fp8"):
                g = frozenset(args.fp8_gelu.split(",")) - {"none", ""}
                out[f"{v}:{B}:{p}:gelu-{args.fp8_gelu}"] = profile(v, B, p, args.steps, fp8_gelu=g)
            for sw in args.fp8_flip if p.startswith("fp8") else ():
                with eg.patched(k8, **{sw: not getattr(k8, sw)}):
                    print(f"(fp8.{sw} = {getattr(k8, sw)})", flush=True)
                    out[f"{v}:{B}:{p}:flip-{sw}"] = profile(v, B, p, args.steps)
            if args.json:
                atomic_write_json(Path(args.json), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
