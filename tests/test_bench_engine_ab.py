"""bench/engine_ab.py on the CPU: --flip parsing and its one-line refusals, each arm run under its
settings and put back after, the rounds alternating, and --json (the step replaced by a stand-in; nothing
here measures speed).

    PYTHONPATH=. python3 -m pytest tests/test_bench_engine_ab.py
"""

from __future__ import annotations

import json

import pytest

from andrea.errors import AndreaError
from script_helpers import load_script


@pytest.fixture()
def ab():
    return load_script("bench/engine_ab.py")


def test_a_flip_names_engine_settings_with_literal_values(ab):
    assert ab.parse_flip("OVERLAP_UPDATE=False") == {"OVERLAP_UPDATE": False}
    assert ab.parse_flip("OWN_DGELU=True,OWN_DGELU_DEFINES=('MM_CLUSTER=2','MM_BN=192')") == {
        "OWN_DGELU": True, "OWN_DGELU_DEFINES": ("MM_CLUSTER=2", "MM_BN=192")}
    with pytest.raises(AndreaError, match="'NO_SUCH' is not an upper-case setting"):
        ab.parse_flip("NO_SUCH=1")
    with pytest.raises(AndreaError, match="'yes' is not a Python literal"):
        ab.parse_flip("OWN_DGELU=yes")


def test_a_flip_may_set_cublaslt_and_every_setting_is_put_back(ab):
    """cublaslt.NAME sets andrea.cuda.cublaslt's NAME (another algorithm table for an A/B of two), beside the
    engine's settings in the same arm; both go back after the block, whatever happens in it."""
    import andrea.cuda.cublaslt as ltm
    import andrea.cuda.engine as ce

    got = ab.parse_flip("cublaslt.CHOICES='/tmp/t.json',OVERLAP_UPDATE=False")
    assert got == {"cublaslt.CHOICES": "/tmp/t.json", "OVERLAP_UPDATE": False}
    table, overlap = ltm.CHOICES, ce.OVERLAP_UPDATE
    with pytest.raises(RuntimeError, match="inside"):
        with ab.flipped(got):
            assert (ltm.CHOICES, ce.OVERLAP_UPDATE) == ("/tmp/t.json", False)
            raise RuntimeError("inside")
    assert (ltm.CHOICES, ce.OVERLAP_UPDATE) == (table, overlap)
    with pytest.raises(AndreaError, match="'NO_SUCH' is not an upper-case setting of andrea/cuda/cublaslt.py"):
        ab.parse_flip("cublaslt.NO_SUCH=1")
    with pytest.raises(AndreaError, match="'CHOICES' is not an upper-case setting of andrea/cuda/engine.py"):
        ab.parse_flip("CHOICES='/tmp/t.json'")


def test_a_flip_may_name_cudnn_attentions_plan_and_only_modules_it_knows(ab):
    """cudnn_attention.NAME sets andrea.cuda.cudnn_attention's NAME (the plan its graphs build), put back
    after the block; a prefix that names no module the bench flips is refused in one line."""
    import andrea.cuda.cudnn_attention as ca

    got = ab.parse_flip("cudnn_attention.BWD_PLAN='eng4_k9=2',OVERLAP_UPDATE=False")
    assert got == {"cudnn_attention.BWD_PLAN": "eng4_k9=2", "OVERLAP_UPDATE": False}
    with ab.flipped(got):
        assert ca.BWD_PLAN == "eng4_k9=2"
    assert ca.BWD_PLAN is None
    with pytest.raises(AndreaError, match="'NO_SUCH' is not an upper-case setting of andrea/cuda/cudnn_attention.py"):
        ab.parse_flip("cudnn_attention.NO_SUCH=1")
    with pytest.raises(AndreaError, match="'BWD_PLAN' is not an upper-case setting of andrea/cuda/engine.py"):
        ab.parse_flip("torch.BWD_PLAN=None")


def test_a_bad_flip_stops_before_any_gpu_work(ab, capsys):
    assert ab.main(["--flip", "FUSE_GELU=maybe"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "FUSE_GELU" in err[0]


def test_each_arm_runs_under_its_flip_alternating_and_the_json_holds_them(ab, monkeypatch, tmp_path, capsys):
    import andrea.cuda.engine as ce

    seen = []

    def ours(s, B, steps, warmup, prec):
        seen.append((ce.OVERLAP_UPDATE, ce.OWN_DGELU))
        return {"ms": 41.0 if ce.OVERLAP_UPDATE else 40.0, "n_params": 1_000_000}

    monkeypatch.setattr(ab.eg, "bench_ours", ours)
    monkeypatch.setattr(ab.eg, "bench_torch", lambda s, B, steps, warmup, a: {"ms": 44.0})
    out = tmp_path / "ab.json"
    assert ab.main(["--variants", "andrea-12m:8", "--flip", "OVERLAP_UPDATE=False", "--rounds", "2",
                    "--json", str(out)]) == 0
    assert seen == [(True, False), (False, False), (False, False), (True, False)]
    assert ce.OVERLAP_UPDATE is True
    got = json.loads(out.read_text())["andrea-12m:B8"]
    assert got["committed"]["ms"] == 41.0 and got["OVERLAP_UPDATE=False"]["ratio_vs_anchor"] == pytest.approx(1.1)
    assert "OVERLAP_UPDATE=False 40.00 ms" in capsys.readouterr().out


def test_power_gives_each_arm_the_median_clock_and_energy_of_its_own_rounds(ab, monkeypatch, tmp_path, capsys):
    """--power: every round's PowerLog window is that round's own timed steps (``timed_at``); an arm gets the
    medians over its rounds, a round without samples is kept as None and left out of them; the anchor gets
    its one run's; the log is closed."""
    import andrea.cuda.engine as ce

    clock = iter(range(100))

    class Log:
        closed = False

        def between(self, t0, t1):
            assert t1 == t0 + 0.5
            if t0 == 3.0:                          # the committed arm's second round: no sample
                return None
            return {"sm_mhz": 1600.0 + t0, "power_w": 600.0 + t0, "power_samples": 4}

        def close(self):
            Log.closed = True

    def ours(s, B, steps, warmup, prec):
        t = float(next(clock))
        return {"ms": 41.0 if ce.OVERLAP_UPDATE else 40.0, "n_params": 1_000_000, "timed_at": [t, t + 0.5]}

    monkeypatch.setattr(ab.eg, "PowerLog", Log)
    monkeypatch.setattr(ab.eg, "bench_ours", ours)
    monkeypatch.setattr(ab.eg, "bench_torch", lambda s, B, steps, warmup, a: {"ms": 44.0, "timed_at": [9.0, 9.5]})
    out = tmp_path / "ab.json"
    assert ab.main(["--variants", "andrea-12m:8", "--flip", "OVERLAP_UPDATE=False", "--rounds", "3", "--power",
                    "--json", str(out)]) == 0
    got = json.loads(out.read_text())["andrea-12m:B8"]
    # rounds: committed at t = 0, 3, 4 (A B, B A, A B); the flip at t = 1, 2, 5
    committed, flip = got["committed"], got["OVERLAP_UPDATE=False"]
    assert committed["power_rounds"][1] is None
    assert committed["sm_mhz"] == 1602.0 and committed["power_w"] == 602.0               # median of t = 0, 4
    assert committed["joules_per_step"] == pytest.approx(602.0 * 41.0e-3)
    assert flip["sm_mhz"] == 1602.0 and flip["joules_per_step"] == pytest.approx(602.0 * 40.0e-3)
    assert got["anchor"]["sm_mhz"] == 1609.0 and got["anchor"]["joules_per_step"] == pytest.approx(609.0 * 44.0e-3)
    assert "committed 41.00 ms (MFU" in (line := capsys.readouterr().out) and "1602 MHz, 24.68 J" in line
    assert Log.closed


def test_power_without_nvidia_smi_says_so_in_one_line_and_times_anyway(ab, monkeypatch, capsys):
    def no_smi():
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(ab.eg, "PowerLog", no_smi)
    monkeypatch.setattr(ab.eg, "bench_ours", lambda s, B, steps, warmup, prec: {"ms": 40.0, "n_params": 1_000_000})
    assert ab.main(["--variants", "andrea-12m:8", "--flip", "OVERLAP_UPDATE=False", "--rounds", "1", "--power",
                    "--anchor", "none"]) == 0
    out = capsys.readouterr()
    assert out.err.count("--power: nvidia-smi cannot run") == 1 and "committed 40.00 ms (MFU" in out.out
    assert "MHz" not in out.out
