"""bench/kernel_profile.py's idle-time analysis without a GPU: synthetic device timelines cut into steps
at the step's first kernel, the idle time between neighbours summed per pair.

    pytest -q tests/test_bench_kernel_profile.py
"""

from __future__ import annotations

import pytest

from script_helpers import load_script


def _timeline(steps: int, memset_gap: int):
    """Per step (10 us apart in ns): k_embed_fwd 0-1000, a memset 1000-1100, a GEMM starting memset_gap
    later and lasting 5000, then a kernel overlapping the GEMM's tail (a side stream)."""
    ops = []
    for s in range(steps):
        t = s * 10_000
        g0 = t + 1100 + memset_gap
        ops += [(t, 1000, "k_embed_fwd"), (t + 1000, 100, "Memset (Device)"), (g0, 5000, "nvjet_gemm"),
                (g0 + 4000, 2000, "k_side")]
    return sorted(ops)


def test_idle_time_is_summed_per_neighbour_pair_and_step():
    kp = load_script("bench/kernel_profile.py")
    got = kp.step_gaps(_timeline(4, memset_gap=3000))
    assert got["wall_ms"] == [0.01, 0.01, 0.01]                  # the last step has no next start: left out
    assert got["busy_ms"] == [pytest.approx(0.0081)] * 3
    pairs = {(b, a): (ms, n) for ms, n, b, a in got["pairs"]}
    assert pairs[("Memset (Device)", "nvjet_gemm")] == (pytest.approx(0.003), 1.0)
    assert pairs[("nvjet_gemm", "k_side")] == (0.0, 1.0)         # overlapping: no idle time
    # after k_side ends (g0 + 6000 = t + 10100 > the next step's start t + 10000): no idle before k_embed_fwd
    assert pairs[("k_side", "k_embed_fwd")] == (0.0, 1.0)
    assert got["idle_ms"] == pytest.approx(0.003)
    assert got["pairs"][0][2:] == ["Memset (Device)", "nvjet_gemm"]


def test_a_tighter_timeline_shows_less_idle_and_too_few_steps_give_nothing():
    kp = load_script("bench/kernel_profile.py")
    # memset -> GEMM 500 ns; k_side now ends at t + 7600, 2400 ns before the next step's k_embed_fwd
    got = kp.step_gaps(_timeline(3, memset_gap=500))
    assert got["idle_ms"] == pytest.approx(0.0005 + 0.0024)
    assert got["pairs"][0] == [pytest.approx(0.0024), 1.0, "k_side", "k_embed_fwd"]
    assert kp.step_gaps(_timeline(1, memset_gap=500)) == {"wall_ms": [], "busy_ms": [], "idle_ms": 0.0,
                                                          "pairs": []}


def _two_streams(steps: int):
    """Per step (10 us apart): on the engine's stream 7, k_embed_fwd 0-1000, k_ln 3000-3500, a GEMM 3500-6000;
    on stream 9 (the update), k_adamw 1000-2800 and 7000-8000. The engine stream idles 2000 ns before k_ln (1800
    of them beside the update) and 4000 ns before the next step's k_embed_fwd (1000 beside it)."""
    ops = []
    for s in range(steps):
        t = s * 10_000
        ops += [(t, 1000, "k_embed_fwd", 7), (t + 3000, 500, "k_ln", 7), (t + 3500, 2500, "nvjet_gemm", 7),
                (t + 1000, 1800, "k_adamw", 9), (t + 7000, 1000, "k_adamw", 9)]
    return sorted(ops)


def test_the_engine_streams_idle_time_is_split_by_what_the_side_stream_runs_then():
    kp = load_script("bench/kernel_profile.py")
    got = kp.stream_waits(_two_streams(4))
    assert got["idle_ms"] == [pytest.approx(0.006)] * 3
    assert got["beside_ms"] == [pytest.approx(0.0028)] * 3
    assert got["device_idle_ms"] == [pytest.approx(0.0032)] * 3
    assert got["side"] == {"k_adamw": [pytest.approx(0.0028), pytest.approx(2.0)]}
    assert got["waits"][0] == [pytest.approx(0.002), pytest.approx(0.0018), 1.0, "k_embed_fwd", "k_ln"]
    assert got["waits"][1] == [pytest.approx(0.004), pytest.approx(0.001), 1.0, "nvjet_gemm", "k_embed_fwd"]
    # the same timeline without the side stream: the same idle time, none of it beside side work
    alone = kp.stream_waits([o for o in _two_streams(4) if o[3] == 7])
    assert alone["idle_ms"] == got["idle_ms"] and alone["beside_ms"] == [0.0] * 3 and alone["side"] == {}
    assert kp.stream_waits(_two_streams(1))["idle_ms"] == []


def test_covered_counts_each_nanosecond_once():
    kp = load_script("bench/kernel_profile.py")
    assert kp._covered(0, 100, [(10, 30), (20, 40), (90, 200)]) == 30 + 10
    assert kp._covered(50, 60, [(0, 10), (70, 80)]) == 0
