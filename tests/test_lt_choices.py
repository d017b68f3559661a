"""cuBLASLt's algorithm table without a GPU (andrea/cuda/cublaslt.py): a problem tries the table's
candidate first and keeps the first that runs; without a table entry the heuristic's order; the
table is read per GPU model and library version; bench/lt_algos.py writes a choice only where it
beats the first candidate by its margin.

    pytest -q tests/test_lt_choices.py
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from andrea.cuda import cublaslt as lt_mod
from andrea.errors import AndreaError
from script_helpers import load_script


def _lt(prefer: dict, refuse=()):
    """An Lt whose library records the algorithm each cublasLtMatmul call gets (refusing ``refuse``)."""
    tried = []

    def matmul(h, desc, alpha, a, al, b, bl, beta, c, cl, d, dl, algo, ws, wsb, stream):
        tried.append(algo)
        lt.ws_given.append(wsb)
        return lt_mod.STATUS_NOT_SUPPORTED if algo in refuse else 0

    lt = lt_mod.Lt.__new__(lt_mod.Lt)
    lt.lib, lt.h, lt.prefer = SimpleNamespace(cublasLtMatmul=matmul), None, prefer
    lt._alpha, lt._beta = np.ones(1, np.float32), {0.0: np.zeros(1, np.float32), 1.0: np.ones(1, np.float32)}
    lt.ws, lt.ws_bytes = SimpleNamespace(data=SimpleNamespace(ptr=0)), 32 << 20
    lt.plan_ws, lt.ws_given, lt.plans16 = {}, [], {}
    return lt, tried


def _plan(pid, n=4):
    return [None, None, None, None, None, [100 + i for i in range(n)], None, None, pid]


def test_the_tables_candidate_runs_first_and_is_kept():
    lt, tried = _lt({"16:(1,)": 2})
    plan = _plan("16:(1,)")
    lt._run(plan, 0, 0, 0, 0.0, 0, lambda: "p")
    lt._run(plan, 0, 0, 0, 0.0, 0, lambda: "p")
    assert tried == [102, 102] and plan[6] == 2


def test_without_an_entry_or_with_a_refused_choice_the_heuristic_order_runs():
    lt, tried = _lt({"16:(1,)": 3}, refuse={103, 100})
    plan = _plan("16:(1,)")
    lt._run(plan, 0, 0, 0, 0.0, 0, lambda: "p")
    assert tried == [103, 100, 101] and plan[6] == 1
    lt, tried = _lt({})
    plan = _plan("fp8:(2,)")
    lt._run(plan, 0, 0, 0, 0.0, 0, lambda: "p")
    assert tried == [100] and plan[6] == 0
    lt, tried = _lt({}, refuse={100, 101, 102, 103})
    with pytest.raises(AndreaError, match=r"failed with status \[15, 15, 15, 15\] over 4 candidate"):
        lt._run(_plan("16:(3,)"), 0, 0, 0, 0.0, 0, lambda: "p")


def test_try_order_problem_id_and_the_table_file(tmp_path):
    assert lt_mod.try_order(4, None) == [0, 1, 2, 3]
    assert lt_mod.try_order(4, 2) == [2, 0, 1, 3]
    assert lt_mod.try_order(2, 5) == [0, 1]                      # a stale entry past the candidates
    key = (32768, 768, 2304, 14, 0.0, True, 1, (256, 256, 256, 256), 0, 0)
    assert lt_mod.problem_id("fp8", key) == "fp8:" + repr(key)
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"NVIDIA H200 | cuBLASLt 130000": {"16:(1,)": 2}}))
    assert lt_mod.load_choices(str(f))["NVIDIA H200 | cuBLASLt 130000"] == {"16:(1,)": 2}
    assert lt_mod.load_choices(str(tmp_path / "none.json")) == {}
    shipped = lt_mod.load_choices()                  # the committed table: model | version -> entries it reads
    assert all(" | cuBLASLt " in k and all(lt_mod.table_choice(e, pid)[0] is not None for pid, e in v.items())
               for k, v in shipped.items())


def test_a_table_entry_is_an_index_or_a_no_workspace_index():
    assert lt_mod.table_choice(None) == (None, None)
    assert lt_mod.table_choice(3) == (3, None)
    assert lt_mod.table_choice("w0:2") == (2, 0)
    for bad in (-1, True, "2", "w0:", "w1:2", 1.5):
        with pytest.raises(AndreaError, match=r"lt_choices\.json: 16:\(1,\) = .* is neither a candidate index .*"
                                              r"bench/lt_algos\.py --write-table"):
            lt_mod.table_choice(bad, "16:(1,)")


def test_a_no_workspace_choice_asks_the_heuristic_for_none_and_calls_without_one(monkeypatch):
    """_plan16 with a "w0:i" entry asks the heuristic for algorithms that fit no workspace and its calls
    pass a workspace size of 0; a problem without such an entry keeps the engine's workspace."""
    asked = []
    lib = SimpleNamespace(**{f: (lambda *a: 0) for f in ("cublasLtMatmulDescCreate", "cublasLtMatmulDescSetAttribute",
                                                          "cublasLtMatrixLayoutCreate")})
    key0 = (64, 64, 64, False, True, 14, 14, 64, 64, 64, 0.0, 1, (256, 256, 256, 256), 0, 0)
    key1 = key0[:10] + (1.0,) + key0[11:]
    lt, tried = _lt({lt_mod.problem_id("16", key0): "w0:1"})
    matmul = lt.lib.cublasLtMatmul
    lt.lib = SimpleNamespace(cublasLtMatmul=matmul, **vars(lib))

    def candidates(desc, a_l, b_l, d_l, aligns, what, hint="", c_l=None, ws_bytes=None):
        asked.append(ws_bytes)
        return [desc, a_l, b_l, d_l, None, [200, 201, 202], None, c_l]

    monkeypatch.setattr(lt, "_candidates", candidates)
    for key in (key0, key1):
        plan = lt._plan16(key)
        lt._run(plan, 0, 0, 0, key[10], 0, lambda: "p")
    assert asked == [0, None]
    assert tried == [201, 200] and lt.ws_given == [0, 32 << 20]
    assert lt.plan_ws == {lt_mod.problem_id("16", key0): 0}


def test_lt_algos_writes_a_choice_only_past_its_margin():
    mod = load_script("bench/lt_algos.py")
    assert mod.choose([1.0, 0.99, 1.2]) == 0                      # 1% faster: noise, keep the first
    assert mod.choose([1.0, 0.97, 0.95]) == 2
    assert mod.choose([None, 0.5, 0.4]) == 2                      # the first refused
    assert mod.choose([1.0, None, 1.1]) == 0
    assert mod.choose([1.0, 0.97], [0.99, 0.95]) == "w0:1"          # no workspace, 5% faster
    assert mod.choose([1.0, 0.99], [0.985, None]) == 0               # 1.5% faster: noise
    assert mod.choose([None, 0.5], [0.5]) == 1                      # a tie goes to the engine's workspace


def test_lt_algos_times_both_lists_and_names_the_engines_candidate():
    """pools: the engine's plan for the list it was built from, a fresh heuristic list for the other (none
    for a kind whose alignments the name does not give); engine_label names a no-workspace run "w0:i"."""
    mod = load_script("bench/lt_algos.py")
    pid = "16:(64, 64, 64, False, True, 14, 14, 64, 64, 64, 0.0, 1, (256, 256, 128, 256), 0, 0)"
    asked = []

    def candidates(desc, a_l, b_l, d_l, aligns, what, hint="", c_l=None, ws_bytes=None):
        asked.append((aligns, ws_bytes))
        return ["fresh", ws_bytes]

    plan = [None] * 6 + [2, None, pid]
    key = (64, 64, 64, False, True, 14, 14, 64, 64, 64, 0.0, 1, (256, 256, 128, 256), 0, 0)   # pid's
    lt = SimpleNamespace(ws_bytes=32 << 20, plan_ws={}, _candidates=candidates, plans16={key: plan})
    assert [(pre, ws, o is plan) for pre, ws, o in mod.pools(lt, plan, False)] == [("", 32 << 20, True)]
    assert [(pre, ws, o is plan) for pre, ws, o in mod.pools(lt, plan, True)] == [("", 32 << 20, True), ("w0:", 0, False)]
    assert asked == [((256, 256, 128, 256), 0)] and mod.engine_label(lt, plan) == 2
    lt.plan_ws[pid] = 0                                               # the engine runs it without a workspace
    assert [(pre, ws, o is plan) for pre, ws, o in mod.pools(lt, plan, False)] == [("", 32 << 20, False), ("w0:", 0, True)]
    assert asked[-1] == ((256, 256, 128, 256), None) and mod.engine_label(lt, plan) == "w0:2"
    fp8 = [None] * 6 + [0, None, "fp8:(16, 16, 16)"]
    assert [pre for pre, _, _ in mod.pools(lt, fp8, True)] == [""]
