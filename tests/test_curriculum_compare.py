"""The figures of bench/curriculum_compare.py: steps-to-reach, mean curves, the three ratios.

    pytest tests/test_curriculum_compare.py

Pure functions on hand-made held-out curves and per-source figures (no training).
"""

from __future__ import annotations

import json
import math

import pytest

from script_helpers import load_script


@pytest.fixture(scope="module")
def cc():
    return load_script("bench/curriculum_compare.py")


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
                "late_shares": {"a": 0.25 * seed, "b": 1.0 - 0.25 * seed},
                "late_reward": {"mean": {"a": float(seed), "b": 2.0}, "n": {"a": 3, "b": 3}, "spread": 2.0 * seed},
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
    assert f["late_shares"] == pytest.approx({"a": 0.375, "b": 0.625})   # means over the seeds
    assert f["late_reward"] == pytest.approx({"a": 1.5, "b": 2.0}) and f["late_reward_spread"] == pytest.approx(3.0)


def test_late_shares_count_the_pulls_from_a_step_on(cc, tmp_path):
    pulls = [{"step": 0, "source": "a", "dwell": 1}, {"step": 5, "source": "a", "dwell": 3},
             {"step": 9, "source": "b", "dwell": 1}, {"step": 10, "source": None, "dwell": 1}]
    (tmp_path / "model.loss.json").write_text(json.dumps({"pulls": pulls}), encoding="utf-8")
    assert cc.batch_shares(tmp_path) == pytest.approx({"a": 0.8, "b": 0.2})
    assert cc.batch_shares(tmp_path, since=5) == pytest.approx({"a": 0.75, "b": 0.25})
    assert cc.batch_shares(tmp_path, since=9) == {"b": 1.0}


def test_pull_rewards_pool_the_within_source_spread(cc, tmp_path):
    pulls = [{"step": 0, "source": "a", "reward": None}, {"step": 1, "source": "a", "reward": 1.0},
             {"step": 2, "source": "a", "reward": 3.0}, {"step": 3, "source": "b", "reward": 10.0},
             {"step": 4, "source": "b", "reward": 14.0}, {"step": 5, "source": "b", "reward": 12.0}]
    (tmp_path / "model.loss.json").write_text(json.dumps({"pulls": pulls}), encoding="utf-8")
    r = cc.pull_rewards(tmp_path)
    assert r["mean"] == pytest.approx({"a": 2.0, "b": 12.0}) and r["n"] == {"a": 2, "b": 3}
    assert r["spread"] == pytest.approx(math.sqrt((2.0 + 8.0) / 3))   # squares about each mean / (n - 1 per source)
    assert cc.pull_rewards(tmp_path, since=3)["spread"] == pytest.approx(2.0)
    assert cc.pull_rewards(tmp_path, since=5)["spread"] is None          # one reward: no spread


def test_a_variant_spec_names_its_sets(cc):
    assert cc.parse_variant("x=bandit.policy=ucb1,bandit.floor=0.1") == ("x", ["bandit.policy=ucb1", "bandit.floor=0.1"])
    with pytest.raises(Exception, match="--variant"):
        cc.parse_variant("just-a-name")
