"""Benchmark: what the CUDA graph of one bf16 engine step replays besides kernels, which library call adds
each memset, and whether a cuBLASLt candidate without one runs as fast (issue 19).

    PYTHONPATH=. python3 bench/graph_nodes.py --variants andrea-480m:8,16 andrea-120m:32 --candidates \
        --json nodes.json                                                  # on the GPU, ~1 min a shape

Why: session 34's profile (docs/bench/s34_kernels_h200.json) counts 166-167 memsets a step at 480M and
126 at 120M B=32, each just before a GEMM or a cuDNN kernel (1.1 us apiece), and puts most of the step's
idle time (0.58-0.74 ms) in the gaps beside them: with the memsets' own time 0.8-1.3% of the step. In bf16
the engine clears nothing inside its captured graphs, so the libraries add them. For each (variant, batch):
1. the step's graphs (``GpuEngine.graph``: the forward + backward and the tail, per weight-gradient
   beta; the step's figures are the first beta's, which a one-microbatch step replays) read node by node
   through the driver API (cuGraphGetNodes, cuGraphNodeGetType): the nodes by type, the memsets by size,
   by the kernel each one precedes and by the buffer it clears (cuBLASLt's workspace, the logits, where
   cuDNN's scratch lives, or elsewhere in the engine's arena);
2. each cuBLASLt problem and each cuDNN attention call of the step (recorded from one eager step)
   captured alone, one call in a graph of its own: the memsets it adds under the algorithm the engine
   runs, times its calls a step, against the graphs' count;
3. ``--candidates``: each cuBLASLt problem under every candidate of the heuristic (the engine's 32 MiB
   workspace) and every candidate offered with no workspace (``lt_algos.pools``; the table names those
   "w0:i", cublaslt.table_choice): the memsets a call adds and the ms a call
   in a graph of ``--reps`` calls back to back after ``--sustain-ms`` of them (the way the step replays
   it, at the card's power limit); then the fastest candidate that adds none, and the ms a step it
   would save over the engine's.
Parts 1 and 2-3 run on engines of their own; a part that fails is reported in one line and the other's
figures still land in ``--json``. Only reads and times: the engine's table (andrea/cuda/lt_choices.json) is
not written (bench/lt_algos.py --no-workspace --write-table writes "w0:i" entries).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import engine_gpu as eg  # noqa: E402
import lt_algos  # noqa: E402

from andrea.fsutil import atomic_write_json  # noqa: E402

# CUgraphNodeType (cuda.h)
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "child graph", 5: "empty", 6: "event wait",
              7: "event record", 8: "semaphore signal", 9: "semaphore wait", 10: "mem alloc", 11: "mem free",
              12: "batch mem op", 13: "conditional"}


class _MemsetParams(ctypes.Structure):              # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [("dst", ctypes.c_uint64), ("pitch", ctypes.c_size_t), ("value", ctypes.c_uint),
                ("elementSize", ctypes.c_uint), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]


class _KernelParams(ctypes.Structure):              # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p)] + [(f, ctypes.c_uint) for f in (
        "gridDimX", "gridDimY", "gridDimZ", "blockDimX", "blockDimY", "blockDimZ", "sharedMemBytes")] + [
        ("kernelParams", ctypes.c_void_p), ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p)]


class Driver:
    """The graph-reading calls of libcuda (one per process, whichever runtime built the graph)."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")

    def _call(self, name: str, *args) -> int:
        fn = getattr(self.lib, name, None)
        return 999 if fn is None else int(fn(*args))

    def nodes(self, graph: int) -> list[int]:
        n = ctypes.c_size_t(0)
        if self._call("cuGraphGetNodes", ctypes.c_void_p(graph), None, ctypes.byref(n)):
            raise RuntimeError("cuGraphGetNodes failed")
        arr = (ctypes.c_void_p * max(n.value, 1))()
        if self._call("cuGraphGetNodes", ctypes.c_void_p(graph), arr, ctypes.byref(n)):
            raise RuntimeError("cuGraphGetNodes failed")
        return [int(arr[i] or 0) for i in range(n.value)]

    def node_type(self, node: int) -> str:
        t = ctypes.c_int(-1)
        self._call("cuGraphNodeGetType", ctypes.c_void_p(node), ctypes.byref(t))
        return NODE_TYPES.get(t.value, f"type {t.value}")

    def memset(self, node: int) -> dict:
        p = _MemsetParams()
        if self._call("cuGraphMemsetNodeGetParams", ctypes.c_void_p(node), ctypes.byref(p)):
            return {}
        return {"dst": int(p.dst), "bytes": int(p.elementSize) * int(p.width) * max(int(p.height), 1),
                "value": int(p.value)}

    def kernel_name(self, node: int) -> str:
        """The kernel's name (cuFuncGetName / cuKernelGetName, CUDA 12.3+ drivers), or "?"."""
        p = _KernelParams()
        if self._call("cuGraphKernelNodeGetParams_v2", ctypes.c_void_p(node), ctypes.byref(p)):
            return "?"
        name = ctypes.c_char_p()
        for fn, h in (("cuFuncGetName", p.func), ("cuKernelGetName", p.kern)):
            if h and not self._call(fn, ctypes.byref(name), ctypes.c_void_p(h)) and name.value:
                return name.value.decode(errors="replace")
        return "?"

    def dependents(self, node: int) -> list[int] | None:
        """The nodes that wait for this one (cuGraphNodeGetDependentNodes_v2 with no edge data, CUDA 12.3+
        drivers, else the 3-argument original), or None where the driver gives neither."""
        v2 = hasattr(self.lib, "cuGraphNodeGetDependentNodes_v2")

        def get(arr, n):
            if v2:
                return self._call("cuGraphNodeGetDependentNodes_v2", ctypes.c_void_p(node), arr, None, ctypes.byref(n))
            return self._call("cuGraphNodeGetDependentNodes", ctypes.c_void_p(node), arr, ctypes.byref(n))

        n = ctypes.c_size_t(0)
        if get(None, n):
            return None
        arr = (ctypes.c_void_p * max(n.value, 1))()
        if get(arr, n):
            return None
        return [int(arr[i] or 0) for i in range(n.value)]


def read_graph(drv: Driver, graph: int) -> list[dict]:
    """The graph's nodes in the driver's order: {"type", and for a kernel "name", for a memset "dst",
    "bytes", "value" and "next" (the name of the node that depends on it; where the driver gives no
    edges, of the next kernel listed)}."""
    handles = drv.nodes(graph)
    rows = [{"type": drv.node_type(h)} for h in handles]
    at = {h: i for i, h in enumerate(handles)}
    for h, r in zip(handles, rows):
        if r["type"] == "kernel":
            r["name"] = drv.kernel_name(h)
    for i, (h, r) in enumerate(zip(handles, rows)):
        if r["type"] != "memset":
            continue
        r.update(drv.memset(h))
        deps = drv.dependents(h)
        j = at.get(deps[0]) if deps else next((k for k in range(i + 1, len(rows)) if rows[k]["type"] == "kernel"),
                                               None)
        nxt = rows[j] if j is not None else {}
        r["next"] = nxt.get("name", nxt.get("type", "-"))
    return rows


def short(name: str, n: int = 60) -> str:
    """A kernel name cut to its first ``n`` characters after any ``void `` or template noise at the front."""
    return name.removeprefix("void ")[:n]


def summarise(rows: list[dict], regions: dict | None = None) -> dict:
    """Counts of one graph's (or several graphs') nodes: by type, memsets by size, by the kernel after and
    by the buffer they clear (``regions``, see ``region_of``)."""
    mem = [r for r in rows if r["type"] == "memset"]
    return {"nodes": len(rows), "by_type": dict(Counter(r["type"] for r in rows).most_common()),
            "memset_bytes": dict(Counter(str(r.get("bytes", "?")) for r in mem).most_common()),
            "memset_before": dict(Counter(short(str(r.get("next", "-"))) for r in mem).most_common()),
            "memset_in": dict(Counter(region_of(r.get("dst"), regions or {}) for r in mem).most_common())}


def region_of(dst: int | None, regions: dict) -> str:
    """The name of the first of ``regions`` ({name: (start, bytes)}) that holds address ``dst``, else "other"."""
    for name, (lo, n) in regions.items():
        if dst is not None and lo <= dst < lo + n:
            return name
    return "other"


def best_free(cands: list[dict]) -> dict | None:
    """The fastest candidate that ran and added no memset, or None."""
    ok = [c for c in cands if c.get("ms") is not None and c.get("memsets") == 0]
    return min(ok, key=lambda c: c["ms"]) if ok else None


def capture(fn):
    """fn(stream pointer) captured on a fresh stream: the CuPy graph (its ``graph`` is the cudaGraph_t)."""
    import cupy as cp

    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        try:
            fn(s.ptr)
        finally:
            g = s.end_capture()
    if not hasattr(g, "graph"):
        raise SystemExit("graph_nodes: this CuPy's Graph does not expose its cudaGraph_t (.graph)")
    return g


def memsets_of(drv: Driver, fn) -> int | None:
    """Memset nodes that one call adds, captured alone; None if it refused (a nonzero status) or its
    capture failed (printed)."""
    status = []
    try:
        g = capture(lambda s: status.append(fn(s)))
    except Exception as e:  # noqa: BLE001 - one candidate that cannot be captured: say so, go on
        print(f"  (capture failed: {type(e).__name__}: {e})", flush=True)
        return None
    if any(status):
        return None
    return sum(r["type"] == "memset" for r in read_graph(drv, g.graph))


def graph_ms(fn, reps: int, sustain_ms: float) -> float:
    """ms a call of fn replayed as a graph of ``reps`` calls back to back (engine_gpu.sustained_ms)."""
    import cupy as cp

    g = capture(lambda s: [fn(s) for _ in range(reps)])
    stream = cp.cuda.get_current_stream()
    for _ in range(2):
        g.launch(stream=stream)
    return eg.sustained_ms(lambda: g.launch(stream=stream), 5, sustain_ms) / reps


def candidates(drv: Driver, lt, plan, args, reps: int, sustain_ms: float) -> list[dict]:
    """Every candidate of a problem with the engine's workspace, then those the heuristic offers with none
    (lt_algos.pools): {"choice" (as the table names it), "ws", "memsets", "ms"} (None where it refused)."""
    out = []
    for pre, ws, owner in lt_algos.pools(lt, plan, True):
        for i, algo in enumerate(owner[5]):
            fn = lt_algos.call_of(lt, plan, args, algo, ws)
            m = memsets_of(drv, fn)
            out.append({"choice": f"{pre}{i}" if pre else i, "ws": ws, "memsets": m,
                        "ms": None if m is None else graph_ms(fn, reps, sustain_ms)})
    return out


def record_dnn(eng) -> dict:
    """id(graph) -> [CudnnAttention, its graph, (ptrs, scratch) of the last call, calls a step] over one
    eager step (eng.train_step_once)."""
    from andrea.cuda.cudnn_attention import CudnnAttention

    seen: dict = {}
    orig = CudnnAttention._run

    def run(self, graph, ptrs, scratch):
        orig(self, graph, ptrs, scratch)
        hit = seen.setdefault(id(graph), [self, graph, None, 0])
        hit[2] = (ptrs, scratch)
        hit[3] += 1

    with eg.patched(CudnnAttention, _run=run):
        eng.train_step_once()
    return seen


def step_graphs(drv: Driver, mc, B: int, batch, name: str) -> dict:
    """Part 1: the step's graphs as the engine captures and replays them, summarised (``summarise``)."""
    import cupy as cp

    from andrea.cuda.backend import make_backend
    from andrea.engine.engine import Hyper

    res: dict = {}
    eng = make_backend().make_engine(mc, B, precision="bf16", cuda_graph=True, grad_accum=1)
    eng.init_weights(1337)
    for t in (1, 2):
        eng.train_step([batch], 3e-4, t, Hyper())
    cp.cuda.Device().synchronize()
    if not eng.graph:
        raise RuntimeError("the engine runs without a CUDA graph (its capture failed; the reason is printed above)")
    rows = []                                       # the step's: a one-microbatch step replays the first beta's pair
    for beta, pair in sorted(eng.graph.items()):
        for part, g in zip(("main", "tail"), pair):
            got = read_graph(drv, g.graph)
            res[f"graph beta={beta} {part}"] = summarise(got)
            rows += got if beta == min(eng.graph) else []
    lg = eng.a["logits"]                            # cuDNN's scratch (in a layer's backward, maybe h_pre's)
    regions = {"cuBLASLt workspace": (eng.lt.ws.data.ptr, eng.lt.ws_bytes), "logits": (lg.data.ptr, lg.nbytes),
               "engine arena": (eng.arena.data.ptr, eng.arena.nbytes)}
    res["step"] = step = summarise(rows, regions)
    print(f"{name} step graphs: {step['nodes']} nodes, " + ", ".join(f"{k} {n}" for k, n in step["by_type"].items()),
          flush=True)
    print(f"  memsets by bytes: {step['memset_bytes']}; by buffer: {step['memset_in']}", flush=True)
    for k, n in list(step["memset_before"].items())[:12]:
        print(f"  {n:4d} memsets before {k}", flush=True)
    return res


def library_calls(drv: Driver, mc, B: int, batch, args) -> dict:
    """Part 2 (and 3 with --candidates): each cuBLASLt problem and cuDNN call of one eager step alone."""
    import cupy as cp

    from andrea.cuda.backend import make_backend
    from andrea.engine.engine import Hyper

    eng = make_backend().make_engine(mc, B, precision="bf16", cuda_graph=False, grad_accum=1)
    eng.init_weights(1337)
    eng.train_step([batch], 3e-4, 1, Hyper())
    eng.train_step_once = lambda: eng.train_step([batch], 3e-4, 2, Hyper())
    gemms = lt_algos.record(eng)
    dnn = record_dnn(eng) if getattr(eng, "dnn", None) is not None else {}
    cp.cuda.Device().synchronize()
    probs, total_lt = [], 0
    for plan, call_args, calls, what, lt in gemms.values():
        label = lt_algos.engine_label(lt, plan)
        m = memsets_of(drv, lt_algos.call_of(lt, plan, call_args, plan[5][plan[6]], lt.plan_ws.get(plan[8], lt.ws_bytes)))
        total_lt += calls * (m or 0)
        row = {"problem": what, "calls": calls, "chosen": label, "memsets": m}
        text = f"  {what}: {calls} calls, #{label} adds {m} memset(s) a call"
        if args.candidates:
            row["candidates"] = cands = candidates(drv, lt, plan, call_args, args.reps, args.sustain_ms)
            cur = next((c for c in cands if c["choice"] == label), None)
            row["best_free"] = free = best_free(cands)
            if cur is not None and cur["ms"] is not None:
                text += f"; in a graph {cur['ms']:.4f} ms a call"
                if free is None:
                    text += ", no candidate without a memset"
                else:
                    row["save_ms_per_step"] = calls * (cur["ms"] - free["ms"])
                    text += (f", fastest without a memset #{free['choice']} "
                             f"{free['ms']:.4f} ms: {row['save_ms_per_step']:+.3f} ms a step")
        probs.append(row)
        print(text, flush=True)
    total_dnn, calls_dnn = 0, []
    for att, graph, (ptrs, scratch), calls in dnn.values():
        def fn(_stream, att=att, graph=graph, ptrs=ptrs, scratch=scratch):
            att._run(graph, ptrs, scratch)          # on the current stream: capture()'s
            return 0
        m = memsets_of(drv, fn)
        total_dnn += calls * (m or 0)
        kind = "backward" if len(ptrs) == 9 else "forward"
        calls_dnn.append({"call": kind, "calls": calls, "memsets": m})
        print(f"  cuDNN SDPA {kind}: {calls} calls, adds {m} memset(s) a call", flush=True)
    res = {"gemms": probs, "cudnn": calls_dnn, "memsets_a_step": {"cublaslt": total_lt, "cudnn": total_dnn}}
    print(f"  memsets a step: cuBLASLt {total_lt} + cuDNN {total_dnn}", flush=True)
    if args.candidates:
        save = sum(r.get("save_ms_per_step", 0.0) for r in probs if r.get("save_ms_per_step", 0.0) > 0)
        res["save_ms_per_step"] = save
        print(f"  the fastest memset-free candidates would save {save:.3f} ms a step (where faster)", flush=True)
    return res


def one_shape(drv: Driver, v: str, B: int, args) -> dict:
    """Both parts for one (variant, batch); a part that fails is reported in one line and the other still runs."""
    from andrea.engine.model import ModelConfig

    s = eg.variant_shapes(v)
    mc = ModelConfig(s["V"], s["C"], s["H"], s["L"], s["T"])
    rng = np.random.default_rng(0)
    x = rng.integers(0, s["V"], (B, s["T"])).astype(np.int32)
    batch = (x, np.roll(x, -1, axis=1))
    res: dict = {}
    for part, fn in (("graphs", lambda: step_graphs(drv, mc, B, batch, f"{v}:B{B}")),
                     ("calls", lambda: library_calls(drv, mc, B, batch, args))):
        try:
            res.update(fn())
        except Exception as e:  # noqa: BLE001 - a diagnostic: keep what the other part finds
            res[f"{part}_error"] = f"{type(e).__name__}: {e}"
            print(f"graph_nodes: {v}:B{B}: the {part} part failed ({type(e).__name__}: {e})", flush=True)
        eg.release_pool()
    if "step" in res and "memsets_a_step" in res:
        print(f"  the graphs hold {res['step']['by_type'].get('memset', 0)} memsets a step", flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", default=["andrea-480m:8"])
    ap.add_argument("--candidates", action="store_true",
                    help="also every cuBLASLt candidate, with the workspace and without: memsets and ms in a graph")
    ap.add_argument("--reps", type=int, default=20, help="calls in a timed graph")
    ap.add_argument("--sustain-ms", type=float, default=100.0, help="back-to-back replays before timing one")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        import cupy  # noqa: F401
        drv = Driver()
    except (ImportError, OSError) as e:
        print(f"graph_nodes: needs CuPy and an NVIDIA driver ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    out = {}
    for v, B in eg.parse_variants(args.variants, 8):
        out[f"{v}:B{B}"] = one_shape(drv, v, B, args)
        if args.json:
            atomic_write_json(Path(args.json), out)
    return 0


if __name__ == "__main__":
    eg.exit_gpu_main(main, "graph_nodes")
