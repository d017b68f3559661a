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
``--no-workspace``: each 16-bit problem also under every candidate the heuristic offers for no workspace
(cublaslt.table_choice's "w0:i": cuBLASLt then clears no workspace before the kernel, one memset node
fewer in the step's graph, bench/graph_nodes.py), timed the same way with no workspace given.
``--write-table PATH`` merges the choices into that table (andrea/cuda/lt_choices.json is the engine's,
read by cublaslt.Lt): for each problem the fastest candidate (of both lists with ``--no-workspace``) when it
beats the heuristic's first by ``MARGIN`` or more, else the first; keyed by GPU model and cuBLASLt version.
Measure with ``USE_CHOICES`` as committed: the candidate lists do not depend on it.
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


def by_label(times: list, times_w0: list | None = None) -> dict:
    """{the table's name of a candidate: its ms or None}: ``times``' by index (the engine's workspace), then
    ``times_w0``'s as "w0:<index>" (no workspace)."""
    return dict(enumerate(times)) | {f"w0:{i}": t for i, t in enumerate(times_w0 or [])}


def fastest(by: dict) -> tuple[float, int | str]:
    """(ms, name) of the fastest candidate that ran in ``by_label``'s dict; a tie goes to the earlier name."""
    return min(((t, c) for c, t in by.items() if t is not None), key=lambda x: x[0])


def choose(times: list, times_w0: list | None = None) -> int | str:
    """The table's entry for one problem: the fastest candidate, of ``times`` (the engine's workspace: its
    index) and ``times_w0`` (no workspace: "w0:<index>"), when it beats candidate 0 of ``times`` by MARGIN,
    else 0."""
    best_t, best_i = fastest(by_label(times, times_w0))
    first = times[0]
    return best_i if first is None or best_t <= first * (1 - MARGIN) else 0


def plan_aligns(lt, plan) -> tuple | None:
    """The operand alignments of a 16-bit problem (entry 12 of its key in ``lt.plans16``), or None for
    another kind."""
    return next((key[12] for key, p in lt.plans16.items() if p is plan), None)


def call_of(lt, plan, args, algo: int, ws_bytes: int):
    """One cublasLtMatmul of a recorded problem (``record``'s args) under candidate address ``algo`` with
    ``ws_bytes`` of workspace: fn(stream) -> its status."""
    desc, a_l, b_l, d_l, _, _, _, c_l, _ = plan
    a_ptr, b_ptr, d_ptr, beta, c_ptr = args
    c_ptr = d_ptr if c_ptr is None else c_ptr
    return lambda stream: lt.lib.cublasLtMatmul(lt.h, desc, lt._alpha.ctypes.data, a_ptr, a_l, b_ptr, b_l,
                                                lt._beta[float(beta)].ctypes.data, c_ptr, c_l, d_ptr, d_l, algo,
                                                lt.ws.data.ptr, ws_bytes, stream)


def pools(lt, plan, no_workspace: bool) -> list[tuple[str, int, list]]:
    """The candidate lists to time a recorded problem over, each (its table prefix, the workspace bytes its
    calls get, a plan list that owns its candidates): "" and the engine's workspace, then with
    ``no_workspace`` (or where the engine runs it so) for a 16-bit problem "w0:" and none. The engine's own
    plan serves for the list it was built from; the other is asked of the heuristic here."""
    from andrea.errors import AndreaError

    pid = plan[8]
    aligns, runs_w0 = plan_aligns(lt, plan), lt.plan_ws.get(pid) == 0

    def fresh(ws):                                   # a plan list as the engine's: its table name appended
        return lt._candidates(plan[0], plan[1], plan[2], plan[3], aligns, f"{pid} ({ws} bytes of workspace)",
                              c_l=plan[7], ws_bytes=ws) + [pid]

    out = [("", lt.ws_bytes, fresh(None) if runs_w0 else plan)]
    if aligns is not None and (no_workspace or runs_w0):
        try:
            out.append(("w0:", 0, plan if runs_w0 else fresh(0)))
        except AndreaError as e:                     # no algorithm without a workspace: time the others
            print(f"  {pid}: {e}", flush=True)
    return out


def engine_label(lt, plan) -> int | str:
    """The candidate the engine runs for a recorded problem, as the table names it."""
    return f"w0:{plan[6]}" if lt.plan_ws.get(plan[8]) == 0 else plan[6]


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

    with eg.patched(Lt, _run=run):
        eng.train_step_once()
    return seen


def time_candidates(lt, plan, args, reps: int, sustain_ms: float = 0.0, ws_bytes: int | None = None) -> list[float | None]:
    """ms per call of each candidate of ``plan`` (a plan list: the engine's, or one of ``pools``; None: it
    refused the problem), after 3 untimed calls: ``engine_gpu.sustained_ms`` over ``reps`` calls, or with
    ``sustain_ms`` > 0 after that long back to back, at the card's power limit where a training step runs,
    not a short burst at full clock. The calls get ``ws_bytes`` of workspace (None: the engine's)."""
    import cupy as cp

    out = []
    ws = lt.ws_bytes if ws_bytes is None else ws_bytes
    stream = cp.cuda.get_current_stream().ptr     # timed where sustained_ms records its events
    for algo in plan[5]:
        fn = call_of(lt, plan, args, algo, ws)

        def call(fn=fn):
            return fn(stream)
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
    ap.add_argument("--no-workspace", action="store_true",
                    help="also every candidate the heuristic offers for no workspace (16-bit problems)")
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
                timed = {pre: time_candidates(lt, owner, call_args, args.reps, args.sustain_ms, ws)
                         for pre, ws, owner in pools(lt, plan, args.no_workspace)}
                times, times_w0 = timed[""], timed.get("w0:")
                by = by_label(times, times_w0)
                best_t, best_i = fastest(by)
                chosen = engine_label(lt, plan)
                cur = by[chosen]
                save = calls * (cur - best_t)
                total += save
                rows.append({"problem": what, "calls": calls, "chosen": chosen, "chosen_ms": cur, "best": best_i,
                             "best_ms": best_t, "candidates_ms": times, "save_ms_per_step": save}
                            | ({"candidates_w0_ms": times_w0} if times_w0 is not None else {}))
                table.setdefault(lt.table_key, {})[plan[8]] = choose(times, times_w0)
                print(f"{v}:B{B} {p} {what}: {calls} calls, runs #{chosen} {cur:.4f} ms, fastest #{best_i} "
                      f"{best_t:.4f} ms ({sum(x is not None for x in by.values())}/{len(by)} candidates run), saves {save:.3f} ms/step",
                      flush=True)
            print(f"{v}:B{B} {p}: the fastest candidates would save {total:.3f} ms a step", flush=True)
            allres[f"{v}:B{B}:{p}"] = {"problems": rows, "save_ms_per_step": total}
            if args.json:
                atomic_write_json(Path(args.json), allres)
            if args.write_table:
                atomic_write_json(Path(args.write_table), {k: dict(sorted(v.items())) for k, v in table.items()})
            del eng
            eg.release_pool()
    return 0


if __name__ == "__main__":
    eg.exit_gpu_main(main, "lt_algos")
