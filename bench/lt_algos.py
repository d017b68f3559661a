"""Every cuBLASLt GEMM problem of one engine step, timed under each of the heuristic's candidate
algorithms: how much the engine leaves on the table by running the first candidate that works
(andrea/cuda/cublaslt.py ``_run``).

    PYTHONPATH=. python3 bench/lt_algos.py --variants andrea-120m:32 andrea-480m:8 \
        --precision bf16 fp8:delayed --json lt_algos.json            # on the GPU, ~1 min

For each variant and precision: one eager training step records every cublasLtMatmul call (the
problem's plan and the buffers of its last call); then each problem runs ``--reps`` times under
every candidate (after 3 untimed calls; CUDA events on the stream; the buffers of that last call, so
an accumulating weight gradient keeps accumulating, which does not change its time). Printed per
problem: calls a step, the candidate the engine runs and its ms, the fastest candidate and its ms,
and the step time the fastest would save; the total at the end. ``--sustain-ms MS`` times each candidate
after MS of back-to-back calls, at the power limit where the step runs (``time_candidates``).
``--write-table PATH`` merges the choices into that table (andrea/cuda/lt_choices.json is the engine's,
read by cublaslt.Lt): for each problem the fastest candidate when it beats the heuristic's first by
``MARGIN`` or more, else the first; keyed by GPU model and cuBLASLt version. Measure with
``USE_CHOICES`` as committed: the candidate lists do not depend on it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import engine_gpu as eg  # noqa: E402

from andrea.fsutil import atomic_write_json  # noqa: E402


MARGIN = 0.02        # a candidate replaces the heuristic's first only when this much faster (not noise)


def choose(times: list) -> int:
    """The table's candidate for one problem: the fastest when it beats candidate 0 by MARGIN, else 0."""
    ok = [(t, i) for i, t in enumerate(times) if t is not None]
    best_t, best_i = min(ok)
    first = times[0]
    return best_i if first is None or best_t <= first * (1 - MARGIN) else 0


def record(eng) -> dict:
    """id(plan) -> [plan, (a, b, d, beta, c), calls in one step, the problem's description] (the stream is
    not kept: time_candidates runs on the current one)."""
    from andrea.cuda.cublaslt import Lt

    seen: dict = {}
    orig = Lt._run

    def run(self, plan, a_ptr, b_ptr, d_ptr, beta, stream, what, c_ptr=None):
        orig(self, plan, a_ptr, b_ptr, d_ptr, beta, stream, what, c_ptr=c_ptr)
        hit = seen.setdefault(id(plan), [plan, None, 0, what(), self])
        hit[1] = (a_ptr, b_ptr, d_ptr, beta, c_ptr)
        hit[2] += 1

    Lt._run = run
    try:
        eng.train_step_once()
    finally:
        Lt._run = orig
    return seen


def time_candidates(lt, plan, args, reps: int, sustain_ms: float = 0.0) -> list[float | None]:
    """ms per call of each candidate (None: it refused the problem), after 3 untimed calls:
    ``engine_gpu.sustained_ms`` over ``reps`` calls, or with ``sustain_ms`` > 0 after that long back to
    back, at the card's power limit where a training step runs, not a short burst at full clock."""
    import cupy as cp

    desc, a_l, b_l, d_l, _, algos, chosen, c_l, _ = plan
    a_ptr, b_ptr, d_ptr, beta, c_ptr = args
    c_ptr = d_ptr if c_ptr is None else c_ptr
    out = []
    stream = cp.cuda.get_current_stream().ptr     # timed where sustained_ms records its events
    for algo in algos:
        def call():
            return lt.lib.cublasLtMatmul(lt.h, desc, lt._alpha.ctypes.data, a_ptr, a_l, b_ptr, b_l,
                                         lt._beta[float(beta)].ctypes.data, c_ptr, c_l, d_ptr, d_l, algo,
                                         lt.ws.data.ptr, lt.ws_bytes, stream)
        if call():
            out.append(None)
            continue
        for _ in range(3):
            call()
        out.append(eg.sustained_ms(call, reps, sustain_ms))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", default=["andrea-120m:32"])
    ap.add_argument("--precision", nargs="+", default=["bf16", "fp8:delayed"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sustain-ms", type=float, default=0.0,
                    help="run each candidate this long before timing it, so it is timed at the power limit")
    ap.add_argument("--json", default=None)
    ap.add_argument("--write-table", default=None, metavar="PATH",
                    help="merge each problem's choice into this table (e.g. andrea/cuda/lt_choices.json)")
    args = ap.parse_args(argv)
    table = {}
    if args.write_table and Path(args.write_table).exists():
        import json

        table = json.loads(Path(args.write_table).read_text())
    import cupy as cp

    from andrea.cuda.backend import make_backend
    from andrea.engine.engine import Hyper
    from andrea.engine.model import ModelConfig

    allres = {}
    for v, B in eg.parse_variants(args.variants, 8):
        s = eg.variant_shapes(v)
        mc = ModelConfig(s["V"], s["C"], s["H"], s["L"], s["T"])
        for p in args.precision:
            prec, kw = eg.engine_args(p)
            eng = make_backend().make_engine(mc, B, precision=prec, cuda_graph=False, grad_accum=1, **kw)
            eng.init_weights(1337)
            rng = np.random.default_rng(0)
            x = rng.integers(0, s["V"], (B, s["T"])).astype(np.int32)
            batch = (x, np.roll(x, -1, axis=1))
            for t in (1, 2):                                   # fp8 delayed: its second step has the history
                eng.train_step([batch], 3e-4, t, Hyper())
            eng.train_step_once = lambda: eng.train_step([batch], 3e-4, 3, Hyper())
            seen = record(eng)
            cp.cuda.Device().synchronize()
            rows, total = [], 0.0
            for plan, call_args, calls, what, lt in seen.values():
                times = time_candidates(lt, plan, call_args, args.reps, args.sustain_ms)
                ok = [(t, i) for i, t in enumerate(times) if t is not None]
                best_t, best_i = min(ok)
                cur = times[plan[6]]
                save = calls * (cur - best_t)
                total += save
                rows.append({"problem": what, "calls": calls, "chosen": plan[6], "chosen_ms": cur, "best": best_i,
                             "best_ms": best_t, "candidates_ms": times, "save_ms_per_step": save})
                table.setdefault(lt.table_key, {})[plan[8]] = choose(times)
                print(f"{v}:B{B} {p} {what}: {calls} calls, runs #{plan[6]} {cur:.4f} ms, fastest #{best_i} "
                      f"{best_t:.4f} ms ({len(ok)}/{len(times)} candidates run), saves {save:.3f} ms/step",
                      flush=True)
            print(f"{v}:B{B} {p}: the fastest candidates would save {total:.3f} ms a step", flush=True)
            allres[f"{v}:B{B}:{p}"] = {"problems": rows, "save_ms_per_step": total}
            if args.json:
                atomic_write_json(Path(args.json), allres)
            if args.write_table:
                atomic_write_json(Path(args.write_table), {k: dict(sorted(v.items())) for k, v in table.items()})
            del eng
            cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
