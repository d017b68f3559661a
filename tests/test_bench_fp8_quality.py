"""bench/fp8_quality.py without a GPU: a precision's +SWITCH suffix flips that andrea/cuda/fp8.py
boolean for its run only, and a name that is not such a switch is refused in one line.

    pytest -q tests/test_bench_fp8_quality.py
"""

from __future__ import annotations

import pytest

from script_helpers import load_script


def _module():
    return load_script("bench/fp8_quality.py")


def test_a_switch_suffix_flips_it_for_that_run_only(monkeypatch):
    import andrea.cuda.fp8 as k8

    q = _module()
    seen = []
    monkeypatch.setattr(q, "_train", lambda prec, base, *a: seen.append((prec, base, k8.FC_E4M3, k8.FAST_ACCUM_BWD)))
    before = (k8.FC_E4M3, k8.FAST_ACCUM_BWD)
    q.train("fp8:delayed+FC_E4M3+FAST_ACCUM_BWD", None, 8, None, None, None, 0, None)
    q.train("fp8:delayed", None, 8, None, None, None, 0, None)
    assert seen == [("fp8:delayed+FC_E4M3+FAST_ACCUM_BWD", "fp8:delayed", not before[0], not before[1]),
                    ("fp8:delayed", "fp8:delayed", *before)]
    assert (k8.FC_E4M3, k8.FAST_ACCUM_BWD) == before
    with pytest.raises(SystemExit, match="TILE is not a boolean switch"):
        q.train("fp8+TILE", None, 8, None, None, None, 0, None)
    assert k8.TILE == 64
