"""bench/attention_plans.py: on the CPU, the variant specs refused in one line before any GPU work; on a
GPU with cuDNN's frontend, the tiny profile's attention under every plan cuDNN offers, with the committed
plan repeating its own bytes (nothing here measures speed).

    PYTHONPATH=. python3 -m pytest tests/test_bench_attention_plans.py        # -m gpu for the device test
"""

from __future__ import annotations

import types

import pytest

from andrea.cuda import cudnn_attention as ca
from andrea.errors import AndreaError
from script_helpers import cupy_with_cudnn, load_script


@pytest.fixture()
def plans():
    return load_script("bench/attention_plans.py")


def test_variant_specs_are_checked_before_any_gpu_work(plans):
    assert plans.parse_variant("andrea-480m:8") == ("andrea-480m", 8)
    with pytest.raises(AndreaError, match=r"'andrea-480m': expected NAME:B"):
        plans.parse_variant("andrea-480m")
    with pytest.raises(AndreaError, match=r"'andrea-480m:0': expected NAME:B"):
        plans.parse_variant("andrea-480m:0")
    with pytest.raises(AndreaError, match=r"no profile params/profile/andrea-9t.yaml"):
        plans.parse_variant("andrea-9t:8")


def test_a_bad_spec_is_one_line_on_stderr_and_exit_2(plans, capsys):
    with pytest.raises(SystemExit) as e:
        plans.eg.exit_gpu_main(lambda: plans.main(["--variants", "andrea-480m"]), "attention_plans")
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expected NAME:B" in err[0]


@pytest.mark.gpu
def test_every_offered_plan_of_the_tiny_profile_runs_and_the_committed_one_repeats(plans):
    cupy_with_cudnn()
    a = types.SimpleNamespace(repeats=2, rounds=1, reps=2, sustain_ms=0.0)
    got = plans.one_variant("tiny", 2, a)
    for kind in ("forward", "backward"):
        first, *rest = got[kind]
        assert first["plan"] == "committed" and first["same_bytes"] and first["same_as_committed"]
        assert first["max_abs_diff"] == 0.0 and first["us"] > 0
        assert rest, f"cuDNN offered no {kind} plan"
        for row in rest:       # each either built and ran, or says why not
            assert ("us" in row and row["max_abs_diff"] < 0.1) or row["error"]
    chunk = [r for r in got["backward"] if r["plan"] == "chunk 1"]
    assert len(chunk) == 1 and chunk[0]["same_as_committed"]       # one sequence a call: the same bytes
    assert ca.FWD_PLAN is None and ca.BWD_PLAN is None              # put back after each plan
