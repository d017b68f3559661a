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
        return lt_mod.STATUS_NOT_SUPPORTED if algo in refuse else 0

    lt = lt_mod.Lt.__new__(lt_mod.Lt)
    lt.lib, lt.h, lt.prefer = SimpleNamespace(cublasLtMatmul=matmul), None, prefer
    lt._alpha, lt._beta = np.ones(1, np.float32), {0.0: np.zeros(1, np.float32), 1.0: np.ones(1, np.float32)}
    lt.ws, lt.ws_bytes = SimpleNamespace(data=SimpleNamespace(ptr=0)), 0
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
    shipped = lt_mod.load_choices()                              # the committed table: model | version -> ints
    assert all(" | cuBLASLt " in k and all(isinstance(i, int) and i >= 0 for i in v.values())
               for k, v in shipped.items())


def test_lt_algos_writes_a_choice_only_past_its_margin():
    mod = load_script("bench/lt_algos.py")
    assert mod.choose([1.0, 0.99, 1.2]) == 0                      # 1% faster: noise, keep the first
    assert mod.choose([1.0, 0.97, 0.95]) == 2
    assert mod.choose([None, 0.5, 0.4]) == 2                      # the first refused
    assert mod.choose([1.0, None, 1.1]) == 0
