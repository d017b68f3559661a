"""The figures of bench/curriculum_compare.py: steps-to-reach, mean curves, the three ratios.

    pytest tests/test_curriculum_compare.py

Pure functions on hand-made held-out curves and per-source figures (no training).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cc():
    spec = importlib.util.spec_from_file_location("curriculum_compare", ROOT / "bench" / "curriculum_compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_steps_to_reach_interpolates_between_heldout_points(cc):
    curve = [(100, 3.0), (200, 2.0), (300, 1.5)]
    assert cc.steps_to_reach(curve, 2.5) == pytest.approx(150.0)
    assert cc.steps_to_reach(curve, 1.5) == pytest.approx(300.0)
    assert cc.steps_to_reach(curve, 3.5) == pytest.approx(100.0)   # already there at the first point
    assert cc.steps_to_reach(curve, 1.0) is None                   # never reached


def test_mean_curve_keeps_the_steps_all_runs_share(cc):
    m = cc.mean_curve([[(100, 3.0), (200, 2.0)], [(100, 2.0), (200, 1.0), (300, 0.5)]])
    assert m == [(100, 2.5), (200, 1.5)]


def test_three_figures_against_the_anchor(cc):
    def run(var, seed, per, curve):
        return {"variant": var, "seed": seed, "per_source": per, "shares": {"a": 0.5, "b": 0.5},
                "overall_bpb": (per["a"] + per["b"]) / 2, "curve": curve}
    res = {"runs": {
        "uniform-s1": run("uniform", 1, {"a": 1.0, "b": 2.0}, [(100, 2.0), (200, 1.5)]),
        "uniform-s2": run("uniform", 2, {"a": 1.0, "b": 2.0}, [(100, 2.0), (200, 1.5)]),
        "v-s1": run("v", 1, {"a": 1.2, "b": 1.5}, [(100, 1.6), (200, 1.3)]),
        "v-s2": run("v", 2, {"a": 1.0, "b": 1.5}, [(100, 1.4), (200, 1.3)]),
    }}
    f = cc.figures(res, "v", ["a", "b"])
    assert f["overall_ratio"] == pytest.approx(((2.7 + 2.5) / 4) / 1.5)
    assert f["worst_source"] == "a" and f["worst_source_ratio"] == pytest.approx(1.1)
    assert f["steps_to_reach_ratio"] == pytest.approx(0.5)        # mean curve 1.5 at step 100 of 200
    assert math.isclose(f["source_ratio"]["b"], 0.75)


def test_a_variant_spec_names_its_sets(cc):
    assert cc.parse_variant("x=bandit.policy=ucb1,bandit.floor=0.1") == ("x", ["bandit.policy=ucb1", "bandit.floor=0.1"])
    with pytest.raises(Exception, match="--variant"):
        cc.parse_variant("just-a-name")
