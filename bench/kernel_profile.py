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
(bench/engine_gpu.py's FP8_SWITCHES). ``--gaps`` also prints where the device sits idle between
operations (``step_gaps``): per step its wall and busy ms, and the idle ms a step after each pair of
neighbouring operations, largest first (session 22: a memset node before nearly every cuBLASLt GEMM,
and bf16 kernels slowing from step to step while the idle time stays put). ``--streams`` prints where the
engine's own stream idles (``stream_waits``): per step, that idle time split into the part beside a side
stream's work (with OVERLAP_UPDATE, the forward waiting for the update's pieces) and the part with the device
idle, the largest such waits by neighbouring pair, and the side streams' operations (session 44: at 480M B=8
the forward waits 0.67 ms a step on an H200 for the update beside it).
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


def device_ops(prof) -> list[tuple[int, int, str, int]]:
    """(start ns, duration ns, name, stream) of every device operation a torch.profiler run saw (kernels,
    memsets, copies; its own bookkeeping rows left out), in start order."""
    ops = [(e.start_ns(), e.duration_ns(), e.name(), int(e.device_resource_id()))
           for e in prof.profiler.kineto_results.events()
           if e.device_type().name == "CUDA" and not e.name().startswith(("ProfilerStep", "cudaGraph"))]
    return sorted(ops)


def step_segments(ops: list, first: str) -> list[list]:
    """``ops`` cut into steps at each operation whose name starts with ``first`` (the step's first kernel):
    each step's operations followed by the next step's first one (the last step, which has no next start,
    is left out)."""
    starts = [i for i, o in enumerate(ops) if o[2].startswith(first)]
    return [ops[a:b + 1] for a, b in zip(starts[:-1], starts[1:])]


def idle_before(seg: list):
    """For each operation of ``seg`` after its first: (the end of everything before it, its start, the name
    of the operation that ended last before it, its name); idle where the start is later than that end."""
    end, last = seg[0][0] + seg[0][1], seg[0][2]
    for start, dur, name, *_ in seg[1:]:
        yield end, start, last, name
        if start + dur >= end:
            end, last = start + dur, name


def step_gaps(ops: list, first: str = "k_embed_fwd", top: int = 12) -> dict:
    """Where the device idles in a step: ``ops`` (``device_ops``) cut into steps (``step_segments``). Per
    step: wall ms (its first operation's start to the next step's) and busy ms (its operations' durations).
    Idle: the time between an operation's start and the end of everything before it (0 when they overlap),
    per (name before, name after) pair, in ms a step and operations a step, the ``top`` largest; ``idle_ms``
    is the whole idle time a step."""
    segs = step_segments(ops, first)
    n = len(segs)
    if n < 1:
        return {"wall_ms": [], "busy_ms": [], "idle_ms": 0.0, "pairs": []}
    pairs: dict[tuple[str, str], list] = {}
    wall, busy = [], []
    for seg in segs:
        wall.append((seg[-1][0] - seg[0][0]) / 1e6)
        busy.append(sum(o[1] for o in seg[:-1]) / 1e6)
        for end, start, last, name in idle_before(seg):
            acc = pairs.setdefault((last, name), [0, 0])
            acc[0] += max(0, start - end)
            acc[1] += 1
    rows = sorted(([t / n / 1e6, c / n, k[0], k[1]] for k, (t, c) in pairs.items()), key=lambda r: -r[0])
    return {"wall_ms": wall, "busy_ms": busy, "idle_ms": sum(r[0] for r in rows), "pairs": rows[:top]}


def _covered(lo: int, hi: int, spans: list) -> int:
    """ns of [lo, hi) that the union of ``spans`` ((start, end) sorted by start) covers."""
    got, reach = 0, lo
    for a, b in spans:
        if b <= reach:
            continue
        if a >= hi:
            break
        a = max(a, reach)
        got += min(b, hi) - a
        reach = min(b, hi)
    return got


def stream_waits(ops: list, first: str = "k_embed_fwd", top: int = 8) -> dict:
    """Where the engine's stream waits in a step: ``ops`` (``device_ops``, with streams) cut into steps
    (``step_segments``); the engine's stream is the one ``first`` runs on, every other is a side stream (with
    OVERLAP_UPDATE: AdamW's). Per step: the engine stream's idle ms (the time between one of its operations'
    start and the end of all of its operations before it), split into ``beside_ms`` (another stream busy
    then: the engine stream waiting for the update, or its next kernel not yet placed beside it) and
    ``device_idle_ms`` (nothing running). ``waits``: that idle time per (engine op before, engine op after)
    pair with the part beside side work, ms a step, the ``top`` largest; ``side``: each side operation's
    name with its ms and calls a step."""
    segs = step_segments(ops, first)
    n = len(segs)
    out = {"idle_ms": [], "beside_ms": [], "device_idle_ms": [], "waits": [], "side": {}}
    if n < 1:
        return out
    main = segs[0][0][3]
    side = sorted((o[0], o[0] + o[1]) for o in ops if o[3] != main)
    pairs: dict[tuple[str, str], list] = {}
    for seg in segs:
        for o in seg[:-1]:
            if o[3] != main:
                acc = out["side"].setdefault(o[2], [0.0, 0.0])
                acc[0] += o[1] / n / 1e6
                acc[1] += 1 / n
        idle = beside = 0
        for end, start, last, name in idle_before([o for o in seg if o[3] == main]):
            gap = max(0, start - end)
            cov = _covered(end, start, side) if gap else 0
            idle, beside = idle + gap, beside + cov
            acc = pairs.setdefault((last, name), [0, 0, 0])
            acc[0] += gap
            acc[1] += cov
            acc[2] += 1
        out["idle_ms"].append(idle / 1e6)
        out["beside_ms"].append(beside / 1e6)
        out["device_idle_ms"].append((idle - beside) / 1e6)
    rows = sorted(([t / n / 1e6, c / n / 1e6, k / n, p[0], p[1]] for p, (t, c, k) in pairs.items()),
                  key=lambda r: -r[1])
    out["waits"] = rows[:top]
    return out


def profile(name: str, B: int, spec: str, steps: int = 3, fp8_gelu=None, top: int = 40, gaps: bool = False,
            streams: bool = False) -> dict:
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
        eng = make_backend().make_engine(mc, B, precision=prec, cuda_graph=True, grad_accum=1, **kw)   # bench_ours' engine
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
    ops = device_ops(prof) if gaps or streams else None
    idle = step_gaps(ops) if gaps else None
    waits = stream_waits(ops) if streams else None
    del eng
    eg.release_pool()
    total = sum(v[0] for v in by.values())
    print(f"== {name} B={B} {spec}{'' if fp8_gelu is None else ' fp8-gelu ' + (','.join(fp8_gelu) or 'none')}: "
          f"step {ms:.2f} ms, kernels {total:.2f} ms", flush=True)
    for k, (t, n) in sorted(by.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {t:8.3f} ms {n:6.1f}x  {t / max(n, 1) * 1e3:8.1f} us  {k[:110]}", flush=True)
    res = {"ms": ms, "kernels_ms": total, "by": by}
    if idle is not None:
        print(f"  steps' wall ms {[round(x, 3) for x in idle['wall_ms']]}, busy ms "
              f"{[round(x, 3) for x in idle['busy_ms']]}; idle {idle['idle_ms']:.3f} ms a step, largest after:",
              flush=True)
        for t, n, before, after in idle["pairs"]:
            print(f"  {t:8.3f} ms {n:6.1f}x  {before[:50]}  ->  {after[:50]}", flush=True)
        res["gaps"] = idle
    if waits is not None:
        per_step = {k: [round(x, 3) for x in waits[k]] for k in ("idle_ms", "beside_ms", "device_idle_ms")}
        print(f"  engine stream idle ms a step {per_step['idle_ms']}: beside side-stream work "
              f"{per_step['beside_ms']}, device idle {per_step['device_idle_ms']}; side streams:", flush=True)
        for k, (t, c) in sorted(waits["side"].items(), key=lambda kv: -kv[1][0])[:4]:
            print(f"  {t:8.3f} ms {c:6.1f}x  {k[:90]}", flush=True)
        print("  the engine stream's largest waits beside side work (ms a step, of its idle ms):", flush=True)
        for t, c, k, before, after in waits["waits"]:
            print(f"  {c:8.3f} of {t:6.3f} ms {k:5.1f}x  {before[:45]}  ->  {after[:45]}", flush=True)
        res["streams"] = waits
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", default=["andrea-120m:32", "andrea-480m:8"])
    ap.add_argument("--precision", nargs="+", default=["bf16", "fp8:delayed"])
    ap.add_argument("--fp8-gelu", default=None, help="'none' (or e.g. 'fwd'): fp8 again with that FUSE_GELU_FP8")
    ap.add_argument("--fp8-flip", nargs="*", default=[], choices=list(eg.FP8_SWITCHES),
                    help="fp8 again with each of these andrea/cuda/fp8.py switches flipped alone")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--gaps", action="store_true", help="also the device's idle time between operations a step")
    ap.add_argument("--streams", action="store_true",
                    help="also where the engine's stream waits while a side stream (the update) runs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import andrea.cuda.fp8 as k8

    out = {}
    for v, B in eg.parse_variants(args.variants, 8):
        for p in args.precision:
            out[f"{v}:{B}:{p}"] = profile(v, B, p, args.steps, gaps=args.gaps, streams=args.streams)
            if args.fp8_gelu is not None and p.startswith("fp8"):
                g = frozenset(args.fp8_gelu.split(",")) - {"none", ""}
                out[f"{v}:{B}:{p}:gelu-{args.fp8_gelu}"] = profile(v, B, p, args.steps, fp8_gelu=g, gaps=args.gaps,
                                                                    streams=args.streams)
            for sw in args.fp8_flip if p.startswith("fp8") else ():
                with eg.patched(k8, **{sw: not getattr(k8, sw)}):
                    print(f"(fp8.{sw} = {getattr(k8, sw)})", flush=True)
                    out[f"{v}:{B}:{p}:flip-{sw}"] = profile(v, B, p, args.steps, gaps=args.gaps, streams=args.streams)
            if args.json:
                atomic_write_json(Path(args.json), out)
    return 0


if __name__ == "__main__":
    eg.exit_gpu_main(main, "kernel_profile")
