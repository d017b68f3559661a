"""bench/fp8_ab.py's rounds without a GPU: the configurations alternate their order round by round,
each flip is patched only for its own run, and the ratios are bf16's ms over each configuration's.

    pytest tests/test_bench_fp8_ab.py

The timed function is replaced by a stand-in; nothing here measures speed.
"""

from __future__ import annotations

import json

from script_helpers import load_script


def test_rounds_alternate_and_each_flip_is_patched_for_its_run_alone(tmp_path, monkeypatch):
    ab = load_script("bench/fp8_ab.py")
    import andrea.cuda.fp8 as k8

    before = k8.HPRE_E4M3
    seen = []

    def ours(s, B, steps, warmup, prec):
        seen.append((prec, k8.HPRE_E4M3))
        return {"ms": {"bf16": 48.0}.get(prec, 40.0 if k8.HPRE_E4M3 == before else 41.0)}

    monkeypatch.setattr(ab.eg, "bench_ours", ours)
    out = tmp_path / "ab.json"
    assert ab.main(["--variants", "andrea-12m:8", "--flip", "HPRE_E4M3", "--rounds", "3", "--json", str(out)]) == 0
    fwd = [("bf16", before), ("fp8:delayed", before), ("fp8:delayed", not before)]
    assert seen == fwd + fwd[::-1] + fwd
    assert k8.HPRE_E4M3 == before
    got = json.loads(out.read_text())["andrea-12m:B8"]
    assert got["ms"]["fp8-flip-HPRE_E4M3"] == [41.0] * 3
    assert got["ratio_vs_bf16"]["fp8"] == [1.2] * 3 and got["ratio_vs_bf16"]["bf16"] == [1.0] * 3


def test_the_median_of_the_paired_rounds_is_printed_and_saved(tmp_path, monkeypatch, capsys):
    """Each round's ratio pairs that round's bf16 with its fp8, and the median is over those pairs:
    48 / 44, 50 / 36, 46 / 40 give 1.15x, where the ratio of the medians would be 48 / 40 = 1.2x."""
    ab = load_script("bench/fp8_ab.py")
    timings = iter([48.0, 44.0, 36.0, 50.0, 46.0, 40.0])          # round 1 runs fp8 first
    monkeypatch.setattr(ab.eg, "bench_ours", lambda s, B, steps, warmup, prec: {"ms": next(timings)})
    out = tmp_path / "ab.json"
    assert ab.main(["--variants", "andrea-12m:8", "--rounds", "3", "--json", str(out)]) == 0
    got = json.loads(out.read_text())["andrea-12m:B8"]
    assert got["ms"] == {"bf16": [48.0, 50.0, 46.0], "fp8": [44.0, 36.0, 40.0]}
    assert got["median_ratio_vs_bf16"] == {"bf16": 1.0, "fp8": 46.0 / 40.0}
    assert "median 1.150x" in capsys.readouterr().out


def test_kernel_profile_flips_each_switch_for_its_own_fp8_profile(tmp_path, monkeypatch):
    """bench/kernel_profile.py --fp8-flip: one more profile per switch, fp8 precisions only, with that
    andrea/cuda/fp8.py boolean flipped for it alone and restored after; --gaps and --streams reach each."""
    kp = load_script("bench/kernel_profile.py")
    import andrea.cuda.fp8 as k8

    before = k8.HPRE_E4M3
    seen = []
    monkeypatch.setattr(kp, "profile", lambda v, B, p, steps, fp8_gelu=None, gaps=False, streams=False:
                        seen.append((p, k8.HPRE_E4M3, gaps, streams)) or {})
    out = tmp_path / "k.json"
    assert kp.main(["--variants", "andrea-12m:8", "--precision", "bf16", "fp8:delayed", "--fp8-flip", "HPRE_E4M3",
                    "--json", str(out), "--gaps", "--streams"]) == 0
    assert seen == [("bf16", before, True, True), ("fp8:delayed", before, True, True),
                    ("fp8:delayed", not before, True, True)]
    assert k8.HPRE_E4M3 == before
    assert sorted(json.loads(out.read_text())) == ["andrea-12m:8:bf16", "andrea-12m:8:fp8:delayed",
                                                   "andrea-12m:8:fp8:delayed:flip-HPRE_E4M3"]
