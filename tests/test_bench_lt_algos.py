"""bench/lt_algos.py: on the GPU, one 12M step's cuBLASLt problems, each timed under every heuristic
candidate (the engine's own choice is among them and the fastest is no slower than it); on the CPU, how
``--sustain-ms`` times a candidate, against a fake device clock.

    PYTHONPATH=. python3 -m pytest tests/test_bench_lt_algos.py        # -m gpu for the device test
"""

from __future__ import annotations

import json
import types

import pytest

from andrea.cuda.loader import cupy_or_none
from script_helpers import fake_device_clock, load_script

@pytest.mark.parametrize("sustain_ms,warm,timed", [(0.0, 0, 4), (10.0, 20, 10), (1.0, 2, 4)])
def test_a_sustained_candidate_is_timed_after_its_warm_run(sustain_ms, warm, timed, monkeypatch):
    """time_candidates against a fake device where every GEMM call takes 0.5 ms: without --sustain-ms, 3
    untimed calls and ``reps`` timed; with it, 3 more to gauge a call, sustain_ms of calls back to back, then
    at least ``reps`` timed calls filling half of sustain_ms. A refused candidate is None and runs once."""
    mod = load_script("bench/lt_algos.py")
    calls = [0]
    cuda = fake_device_clock(monkeypatch, calls)
    cuda.get_current_stream = lambda: types.SimpleNamespace(ptr=0)

    def matmul(*args):
        calls[0] += 1
        return 7 if args[12] == "refused" else 0        # the algo pointer: a status of 7 refuses the problem

    lib = types.SimpleNamespace(cublasLtMatmul=matmul)
    lt = types.SimpleNamespace(lib=lib, h=0, _alpha=types.SimpleNamespace(ctypes=types.SimpleNamespace(data=0)),
                               _beta={0.0: types.SimpleNamespace(ctypes=types.SimpleNamespace(data=0))},
                               ws=types.SimpleNamespace(data=types.SimpleNamespace(ptr=0)), ws_bytes=0)
    plan = [None, None, None, None, None, ["ok", "refused"], 0, None, "p"]
    times = mod.time_candidates(lt, plan, (1, 2, 3, 0.0, None), 4, sustain_ms)
    assert times == [0.5, None]
    assert calls[0] == 1 + 3 + (3 + warm if sustain_ms else 0) + timed + 1


@pytest.mark.parametrize("engine_runs_w0", [False, True])
def test_each_pool_of_a_problem_times_through_the_same_call(engine_runs_w0, monkeypatch):
    """--no-workspace: the plan list ``pools`` asks the heuristic for (the workspace the engine does not use)
    is timed by ``time_candidates`` as the engine's own is. Session 39's H100 run died there: the fresh
    list lacked the table name the engine's plans carry, and ``call_of`` could not unpack it. The plans
    come from Lt's own ``_table_plan``/``_candidates`` over a fake cuBLASLt that offers two candidates."""
    from andrea.cuda.cublaslt import Lt

    mod = load_script("bench/lt_algos.py")
    calls = [0]
    cuda = fake_device_clock(monkeypatch, calls)
    cuda.get_current_stream = lambda: types.SimpleNamespace(ptr=0)

    def heuristic(h, desc, a_l, b_l, c_l, d_l, pref, n_max, res, n_ref):
        n_ref._obj.value = 2
        return 0

    def matmul(*args):
        calls[0] += 1
        return 0

    lib = types.SimpleNamespace(cublasLtMatmulPreferenceCreate=lambda ref: 0,
                                cublasLtMatmulPreferenceSetAttribute=lambda *a: 0,
                                cublasLtMatmulAlgoGetHeuristic=heuristic, cublasLtMatmul=matmul)
    ns = types.SimpleNamespace
    lt = object.__new__(Lt)
    lt.lib, lt.h, lt.ws_bytes, lt.prefer, lt.plan_ws, lt.plans16 = lib, 0, 1 << 20, {}, {}, {}
    lt._alpha, lt._beta = ns(ctypes=ns(data=0)), {0.0: ns(ctypes=ns(data=0))}
    lt.ws = ns(data=ns(ptr=0))
    if engine_runs_w0:
        lt.prefer["16:p"] = "w0:1"
    plan = lt._table_plan("16:p", 1, 2, 3, 4, (16, 16, 16, 16), "p")
    lt.plans16[("key",) * 12 + ((16, 16, 16, 16),)] = plan
    assert (lt.plan_ws.get("16:p") == 0) == engine_runs_w0
    got = mod.pools(lt, plan, no_workspace=True)
    assert [(pre, ws) for pre, ws, _ in got] == [("", 1 << 20), ("w0:", 0)]
    for pre, ws, p in got:
        assert len(p) == len(plan) and p[8] == "16:p"
        assert mod.time_candidates(lt, p, (1, 2, 3, 0.0, None), 2, 0.0, ws) == [0.5, 0.5]


@pytest.mark.gpu
@pytest.mark.skipif(cupy_or_none() is None, reason="needs CuPy and a CUDA device")
@pytest.mark.filterwarnings("error::DeprecationWarning")     # CuPy 14's ExternalStream warned in every run
def test_every_problem_of_a_step_is_timed_under_each_candidate(tmp_path):
    mod = load_script("bench/lt_algos.py")
    out = tmp_path / "lt.json"
    assert mod.main(["--variants", "andrea-12m:8", "--precision", "bf16", "--reps", "2", "--no-workspace",
                     "--json", str(out)]) == 0
    got = json.loads(out.read_text())["andrea-12m:B8:bf16"]
    probs = got["problems"]
    assert len(probs) >= 6                                   # qkv, attn-out, fc, proj (fwd, dgrad, wgrad), head
    assert any("candidates_w0_ms" in p for p in probs)      # --no-workspace timed the bf16 problems' own list
    for p in probs:
        assert p["calls"] >= 1 and mod.by_label(p["candidates_ms"], p.get("candidates_w0_ms"))[p["chosen"]] is not None
        assert p["best_ms"] <= p["chosen_ms"] and p["save_ms_per_step"] >= 0
    assert got["save_ms_per_step"] == pytest.approx(sum(p["save_ms_per_step"] for p in probs))


def test_record_counts_each_problems_calls_and_puts_the_run_back(monkeypatch):
    """record() sees every Lt._run of one step through the real call: per plan, the last call's buffers,
    the calls a step, the problem's name and its Lt; Lt._run is the original again afterwards, also when
    the step raises."""
    from andrea.cuda.cublaslt import Lt

    mod = load_script("bench/lt_algos.py")
    ran = []
    monkeypatch.setattr(Lt, "_run", lambda self, plan, a, b, d, beta, stream, what, c_ptr=None: ran.append(plan))
    orig = Lt._run
    lt, p1, p2 = object.__new__(Lt), ["p1"], ["p2"]

    def step():
        for i, plan in enumerate([p1, p2, p1]):
            Lt._run(lt, plan, 10 + i, 20 + i, 30 + i, 0.0, None, lambda n=plan[0]: n, c_ptr=40 + i)

    seen = mod.record(types.SimpleNamespace(train_step_once=step))
    assert ran == [p1, p2, p1] and Lt._run is orig
    assert seen == {id(p1): [p1, (12, 22, 32, 0.0, 42), 2, "p1", lt], id(p2): [p2, (11, 21, 31, 0.0, 41), 1, "p2", lt]}

    def boom():
        raise RuntimeError("step died")

    with pytest.raises(RuntimeError):
        mod.record(types.SimpleNamespace(train_step_once=boom))
    assert Lt._run is orig
