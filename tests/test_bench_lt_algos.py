"""bench/lt_algos.py on the GPU: one 12M step's cuBLASLt problems, each timed under every heuristic
candidate; the engine's own choice is among them and the fastest is no slower than it.

    PYTHONPATH=. python3 -m pytest -m gpu tests/test_bench_lt_algos.py
"""

from __future__ import annotations

import json

import pytest

from andrea.cuda.loader import cupy_or_none
from script_helpers import load_script

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cupy_or_none() is None, reason="needs CuPy and a CUDA device")]


def test_every_problem_of_a_step_is_timed_under_each_candidate(tmp_path):
    mod = load_script("bench/lt_algos.py")
    out = tmp_path / "lt.json"
    assert mod.main(["--variants", "andrea-12m:8", "--precision", "bf16", "--reps", "2", "--json", str(out)]) == 0
    got = json.loads(out.read_text())["andrea-12m:B8:bf16"]
    probs = got["problems"]
    assert len(probs) >= 6                                   # qkv, attn-out, fc, proj (fwd, dgrad, wgrad), head
    for p in probs:
        assert p["calls"] >= 1 and p["candidates_ms"][p["chosen"]] is not None
        assert p["best_ms"] <= p["chosen_ms"] and p["save_ms_per_step"] >= 0
    assert got["save_ms_per_step"] == pytest.approx(sum(p["save_ms_per_step"] for p in probs))
