"""bench/attention_plans.py: on the CPU, a bad variant spec refused in one line before any GPU work; on a
GPU with cuDNN's frontend, the tiny profile's attention under every plan cuDNN offers, with the committed
plan repeating its own bytes (nothing here measures speed).

    PYTHONPATH=. python3 -m pytest tests/test_bench_attention_plans.py        # -m gpu for the device test
"""

from __future__ import annotations

import types

import pytest

from andrea.cuda import cudnn_attention as ca
from script_helpers import cupy_with_cudnn, load_script


@pytest.fixture()
def plans():
    return load_script("bench/attention_plans.py")


def test_a_bad_spec_is_one_line_on_stderr_and_exit_2_before_any_gpu_work(plans, capsys):
    for spec, why in (("andrea-480m:0", "batches after ':' must be integers of 1 or more"),
                      ("andrea-9t:8", "no profile params/profile/andrea-9t.yaml")):
        with pytest.raises(SystemExit) as e:
            plans.eg.exit_gpu_main(lambda: plans.main(["--variants", spec]), "attention_plans")
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0] and spec in err[0]


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
