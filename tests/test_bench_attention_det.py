"""bench/attention_det.py: on the CPU, the alternation, the step's switch and ratios, and --json kept
through a later failure (timed functions replaced by stand-ins; nothing here measures speed); on a GPU
with cuDNN's frontend, one small layer's backward under both settings.

    PYTHONPATH=. python3 -m pytest tests/test_bench_attention_det.py        # -m gpu for the device test
"""

from __future__ import annotations

import json

import pytest

from andrea.cuda import cudnn_attention as ca
from script_helpers import cupy_with_cudnn, load_script


@pytest.fixture()
def det():
    return load_script("bench/attention_det.py")


def test_rounds_alternate_which_setting_goes_first(det):
    order = []
    got = det.alternate(3, ["a", "b"], lambda n: order.append(n) or len(order))
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert got == {"a": [1, 4, 5], "b": [2, 3, 6]}


def test_each_step_runs_under_its_setting_and_is_held_to_one_anchor(det, monkeypatch):
    seen = []

    def ours(s, B, steps, warmup, prec, attention=None):
        seen.append((ca.DETERMINISTIC, attention, prec))
        return {"ms": 50.0 if ca.DETERMINISTIC else 40.0, "n_params": 1_000_000}

    monkeypatch.setattr(det.eg, "bench_ours", ours)
    monkeypatch.setattr(det.eg, "bench_torch", lambda s, B, steps, warmup, a: {"ms": 60.0})
    s = {"T": 128, "C": 64, "H": 2, "L": 2, "V": 300}
    r = det.step(s, 4, 2, 5, 1, "compile-reduce-overhead")
    assert seen == [(True, "cudnn", "bf16"), (False, "cudnn", "bf16"), (False, "cudnn", "bf16"),
                    (True, "cudnn", "bf16")]
    assert ca.DETERMINISTIC is True                                 # put back after each run
    assert r["deterministic"]["ratio_vs_anchor"] == pytest.approx(1.2)
    assert r["default"]["ratio_vs_anchor"] == pytest.approx(1.5)
    fpt = det.eg.flops_per_token(s, 1_000_000)
    assert r["default"]["mfu"] == pytest.approx(fpt * 4 * 128 / 0.040 / det.eg.PEAK_BF16)
    assert "anchor" not in det.step(s, 4, 1, 5, 1, None)


def test_json_keeps_the_backward_figures_when_the_step_dies(det, monkeypatch, tmp_path, capsys):
    figures = {n: {"us": us, "repeats": 5, "same_bytes": n == "deterministic"}
               for n, us in (("deterministic", 577.0), ("default", 526.0))}
    figures.update(det_minus_default_us=51.0, det_minus_default_ms_a_step=0.816, max_abs_diff=0.01,
                   max_abs_deterministic=3.0)
    monkeypatch.setattr(det, "alone", lambda *a: figures)

    def dies(*a):
        raise RuntimeError("killed at the call's time limit")

    monkeypatch.setattr(det, "step", dies)
    out = tmp_path / "det.json"
    with pytest.raises(RuntimeError, match="time limit"):
        det.main(["--variants", "andrea-480m:16", "--json", str(out)])
    assert json.loads(out.read_text()) == {"andrea-480m:B16": {"alone": figures}}
    assert "51.0 us a layer, 0.82 ms a step over 16 layers" in capsys.readouterr().out


@pytest.mark.gpu
def test_one_small_layer_under_both_settings(det):
    cupy_with_cudnn()
    B, T, H = 2, 256, 2
    s = {"T": T, "C": 64 * H, "H": H, "L": 2}
    r = det.alone(s, B, 1, 0.0, 2, 3)
    assert r["deterministic"]["same_bytes"]
    # the deterministic one reduces dQ through B H T^2 bf16 of workspace; the default one does not
    assert r["deterministic"]["workspace_bytes"] >= B * H * T * T * 2 > r["default"]["workspace_bytes"]
    # the same gradient either way: tests/test_cuda_kernels.py's bf16 tolerance (2e-2 of the scale, 2e-2
    # of the value), taken at the largest value
    assert r["max_abs_diff"] <= 4e-2 * r["max_abs_deterministic"]
    assert r["deterministic"]["us"] > 0 and r["default"]["us"] > 0
