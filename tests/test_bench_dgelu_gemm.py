"""bench/dgelu_gemm.py: on the CPU the --configs parsing and its refusals, the check that gates timing,
the report and --json kept through a later failure (the timed parts replaced by stand-ins; nothing here
measures speed); on an H100/H200 one small shape through every arm.

    PYTHONPATH=. python3 -m pytest tests/test_bench_dgelu_gemm.py        # -m gpu for the device test
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from andrea.cuda import kernels as K
from andrea.engine.fp8_numpy import f32_to_bf16
from andrea.errors import AndreaError
from script_helpers import load_script


@pytest.fixture()
def dg():
    return load_script("bench/dgelu_gemm.py")


def test_configs_name_their_defines_and_a_bad_one_stops_before_any_gpu_work(dg, capsys):
    assert dg.parse_configs(["default", "MM_CLUSTER=2", "MM_BN=192,MM_STAGES=4"]) == {
        "ours:default": (), "ours:MM_CLUSTER=2": ("MM_CLUSTER=2",),
        "ours:MM_BN=192,MM_STAGES=4": ("MM_BN=192", "MM_STAGES=4")}
    with pytest.raises(AndreaError, match="MM_STAGES"):
        dg.parse_configs(["MM_STAGES=5"])
    assert dg.main(["--configs", "MM_BM=64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MM_BM=64" in err[0]


def test_the_check_wants_every_element_written_within_a_bf16_unit_and_repeated():
    ref = f32_to_bf16(np.linspace(-4.0, 4.0, 64, dtype=np.float32)).reshape(8, 8)
    dg = load_script("bench/dgelu_gemm.py")
    assert dg.check(ref, ref, ref)["ok"]
    one_up = ref.copy()
    one_up[3, 3] += 1                         # one bf16 unit: within 2^-7 |ref|
    assert dg.check(one_up, ref, one_up)["ok"]
    nan = ref.copy()
    nan[0, 0] = dg.NAN16
    r = dg.check(nan, ref, nan)
    assert not r["ok"] and r["nan"] == 1
    far = ref.copy()
    far[5, 5] += 8                            # eight units off
    r = dg.check(far, ref, far)
    assert not r["ok"] and r["bad"] == 1
    r = dg.check(ref, ref, one_up)
    assert not r["ok"] and not r["same_bytes"]


def test_the_report_says_which_arm_failed_and_was_not_timed(dg):
    res = {"M": 8192, "N": 6144, "K": 1536, "layers": 16,
           "lt_dgelu": {"us": 270.0, "tflops": 572.0, "vs_lt_dgelu": 1.0, "saves_ms_a_step": 0.0},
           "lt_plain": {"us": 235.0, "tflops": 658.0, "vs_lt_dgelu": 270 / 235, "saves_ms_a_step": 0.56},
           "ours:default": {"ok": True, "nan": 0, "bad": 0, "same_bytes": True, "max_abs_diff": 0.0156,
                            "registers": 157, "ctas": 132, "us": 250.0, "tflops": 618.0, "vs_lt_dgelu": 1.08,
                            "saves_ms_a_step": 0.32},
           "ours:MM_CLUSTER=2": {"ok": False, "nan": 12, "bad": 0, "same_bytes": True, "max_abs_diff": 0.0,
                                 "registers": 157, "ctas": 132},
           "ours:MM_BN=192": {"skipped": "does not fit"}}
    text = dg.report("andrea-480m:B8", res)
    assert "ours:default: 250.0 us (618 TFLOP/s), 1.080x lt_dgelu, +0.32 ms a step checked" in text
    assert "157 regs, 132 CTAs" in text
    assert "ours:MM_CLUSTER=2: FAILED CHECK (nan 12" in text and "not timed" in text
    assert "ours:MM_BN=192: skipped (does not fit)" in text


def test_json_keeps_the_first_shape_when_the_second_dies(dg, monkeypatch, tmp_path):
    done = []

    def fake_shape(s, B, configs, rounds, sustain_ms, reps):
        if done:
            raise RuntimeError("killed at the call's time limit")
        done.append(B)
        return {"M": B * s["T"], "N": 4 * s["C"], "K": s["C"], "layers": s["L"],
                "lt_dgelu": {"us": 1.0, "tflops": 1.0, "vs_lt_dgelu": 1.0, "saves_ms_a_step": 0.0}}

    monkeypatch.setattr(dg, "shape", fake_shape)
    out = tmp_path / "dgelu.json"
    with pytest.raises(RuntimeError, match="time limit"):
        dg.main(["--variants", "andrea-480m:8,16", "--json", str(out)])
    got = json.loads(out.read_text())
    assert list(got) == ["andrea-480m:B8"] and got["andrea-480m:B8"]["alone"]["M"] == 8 * 1024


def test_the_step_runs_the_committed_engine_and_each_arm_that_passed_under_its_defines(dg, monkeypatch, capsys):
    import andrea.cuda.engine as ce

    seen = []

    def ours(s, B, steps, warmup, prec):
        seen.append((ce.OWN_DGELU, ce.OWN_DGELU_DEFINES))
        return {"ms": 40.0 if ce.OWN_DGELU else 41.0, "n_params": 1_000_000}

    alone = {"M": 2048, "N": 256, "K": 64, "layers": 2,
             "lt_dgelu": {"us": 2.0, "tflops": 1.0, "vs_lt_dgelu": 1.0, "saves_ms_a_step": 0.0},
             "ours:default": {"ok": True, "nan": 0, "bad": 0, "same_bytes": True, "max_abs_diff": 0.0,
                              "registers": 157, "ctas": 16, "us": 1.0, "tflops": 2.0, "vs_lt_dgelu": 2.0, "saves_ms_a_step": 0.0},
             "ours:MM_CLUSTER=2": {"ok": False, "nan": 3, "bad": 0, "same_bytes": True, "max_abs_diff": 0.0,
                                   "registers": 157, "ctas": 132}}
    monkeypatch.setattr(dg, "shape", lambda *a: alone)
    monkeypatch.setattr(dg.eg, "bench_ours", ours)
    monkeypatch.setattr(dg.eg, "bench_torch", lambda s, B, steps, warmup, a: {"ms": 44.0})
    assert dg.main(["--variants", "andrea-12m:8", "--configs", "default", "MM_CLUSTER=2", "--step",
                    "--rounds", "2"]) == 0
    # the failed arm never runs in the step; the rounds alternate; the switch is put back after each run
    assert seen == [(False, ()), (True, ()), (True, ()), (False, ())]
    assert ce.OWN_DGELU is False and ce.OWN_DGELU_DEFINES == ()
    out = capsys.readouterr().out
    assert "lt_dgelu 41.00 ms" in out and "ours:default 40.00 ms" in out and "1.100x" in out


@pytest.mark.gpu
def test_one_small_shape_through_every_arm(dg):
    from andrea.cuda.loader import cupy_or_none

    if cupy_or_none() is None:
        pytest.skip("CuPy cannot be imported or finds no CUDA device")
    if not K.hopper():
        pytest.skip("k_mm_dgelu needs a compute capability 9.0 device")
    s = {"T": 256, "C": 192, "L": 2}          # M 512, N 768 (256 and 192 divide it), K 192
    configs = dg.parse_configs(["default", "MM_CLUSTER=2", "MM_BN=192,MM_STAGES=4"])
    r = dg.shape(s, 2, configs, 1, 0.0, 2)
    for name in configs:
        assert r[name]["ok"], r[name]
        assert r[name]["us"] > 0
    assert r["lt_dgelu"]["vs_lt_dgelu"] == 1.0 and r["lt_plain"]["us"] > 0
