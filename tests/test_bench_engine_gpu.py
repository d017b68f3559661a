"""bench/engine_gpu.py's bookkeeping without a GPU: --json keeps every figure measured before a
later measurement dies (a device call's time limit, an engine refusing a precision).

    pytest tests/test_bench_engine_gpu.py

The timed functions are replaced by stand-ins; nothing here measures speed.
"""

from __future__ import annotations

import json

import pytest

from script_helpers import fake_device_clock, load_script


@pytest.fixture()
def eg():
    return load_script("bench/engine_gpu.py")


def fake_ours(ms: float) -> dict:
    return {"ms": ms, "peak_bytes": 2 ** 30, "n_params": 12_000_000, "planned_bytes": 2 ** 30,
            "pool_used_bytes": 2 ** 30}


def test_variants_parse_to_profiles_and_batches_and_a_bad_one_is_refused(eg):
    from andrea.errors import AndreaError

    assert eg.parse_variants(["andrea-12m:8,64", "andrea-480m"], 16) == [
        ("andrea-12m", 8), ("andrea-12m", 64), ("andrea-480m", 16)]
    for item, why in (("andrea-12m:8,x", "must be integers of 1 or more"), ("andrea-12m:0", "of 1 or more"),
                      ("andrea-9t:8", "no profile params/profile/andrea-9t.yaml")):
        with pytest.raises(AndreaError, match=why):
            eg.parse_variants([item], 8)


def test_json_keeps_the_figures_measured_before_a_later_one_dies(eg, tmp_path, monkeypatch):
    def ours(s, B, steps, warmup, prec):
        if prec == "fp8":
            raise RuntimeError("killed at the call's time limit")
        return fake_ours(6.0 if B == 8 else 40.0)

    monkeypatch.setattr(eg, "bench_ours", ours)
    out = tmp_path / "bench.json"
    with pytest.raises(RuntimeError, match="time limit"):
        eg.main(["--variants", "andrea-12m:8", "andrea-120m:8", "--precision", "bf16", "fp8", "--anchors",
                 "--json", str(out)])
    got = json.loads(out.read_text())
    assert list(got) == ["andrea-12m:B8"]                       # the second shape's bf16 was never reached
    assert got["andrea-12m:B8"]["partial"] is True and got["andrea-12m:B8"]["ours"]["ms"] == 6.0


def test_json_of_a_finished_run_has_every_shape_and_its_ratios(eg, tmp_path, monkeypatch):
    monkeypatch.setattr(eg, "bench_ours", lambda s, B, steps, warmup, prec: fake_ours(5.0 if prec == "bf16" else 4.0))
    out = tmp_path / "bench.json"
    assert eg.main(["--variants", "andrea-12m:8,64", "--precision", "bf16", "fp8", "--anchors",
                    "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert sorted(got) == ["andrea-12m:B64", "andrea-12m:B8"]
    r = got["andrea-12m:B8"]
    assert "partial" not in r and r["ours-fp8"]["tokens_per_s"] / r["ours"]["tokens_per_s"] == pytest.approx(1.25)


def test_fp8_gelu_choices_are_timed_on_the_first_fp8_precision(eg, tmp_path, monkeypatch):
    """--fp8-gelu: one more run of ours per choice, on the first fp8 precision, with
    engine.FUSE_GELU_FP8 set to it (``none``: the empty set); nothing without an fp8 precision."""
    calls = []

    def ours(s, B, steps, warmup, prec, recompute=None, fp8_gelu=None):
        calls.append((prec, fp8_gelu))
        return fake_ours(5.0)

    monkeypatch.setattr(eg, "bench_ours", ours)
    out = tmp_path / "bench.json"
    assert eg.main(["--variants", "andrea-12m:8", "--precision", "bf16", "fp8:delayed", "--fp8-gelu", "none", "fwd",
                    "--anchors", "--json", str(out)]) == 0
    assert calls == [("bf16", None), ("fp8:delayed", None), ("fp8:delayed", frozenset()),
                     ("fp8:delayed", frozenset({"fwd"}))]
    got = json.loads(out.read_text())["andrea-12m:B8"]
    assert {"ours-fp8:delayed-gelu-none", "ours-fp8:delayed-gelu-fwd"} <= set(got)
    calls.clear()
    assert eg.main(["--variants", "andrea-12m:8", "--precision", "bf16", "--fp8-gelu", "none", "--anchors"]) == 0
    assert calls == [("bf16", None)]


def test_breakdown_reports_the_step_time_no_class_holds(eg, tmp_path, monkeypatch, capsys):
    # the host wait session 9 found: 26.7 ms of step, 20.1 in the classes
    bd = {"attention fwd": 1.9, "attention bwd": 5.3, "gemm": 8.9, "layernorm": 2.2, "elementwise": 0.4,
          "loss": 0.9, "embed": 0.25, "optimizer": 0.25, "total": 26.7}
    monkeypatch.setattr(eg, "bench_ours", lambda s, B, steps, warmup, prec: fake_ours(25.0))
    monkeypatch.setattr(eg, "breakdown", lambda s, B, prec: dict(bd))
    monkeypatch.setattr(eg, "gemm_compare", lambda s, B: {})
    out = tmp_path / "bench.json"
    assert eg.main(["--variants", "andrea-12m:64", "--anchors", "--breakdown", "--json", str(out)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("unattributed"))
    assert float(line.split()[1]) == pytest.approx(6.6)
    assert json.loads(out.read_text())["andrea-12m:B64"]["breakdown_ms"]["unattributed"] == pytest.approx(6.6)


def test_fp8_cast_paths_are_timed_with_their_switches_set_and_restored(eg, tmp_path, monkeypatch):
    """--fp8-plain, --fp8-cast-t and --fp8-flip: one more run of ours on the first fp8 precision each,
    with the fp8 module's switches as they say during that run (plain: no kept transposes, no
    GELU-backward cast, the weights one by one; cast-t: CAST_T; flip: that switch alone) and as they
    were afterwards."""
    import andrea.cuda.fp8 as k8

    seen = []

    def ours(s, B, steps, warmup, prec, recompute=None, fp8_gelu=None):
        seen.append((prec, k8.SAVE_TRANSPOSES, k8.DGELU_CAST, k8.Fp8Gemm.cast_weights is k8.Fp8Gemm.cast_weights_each,
                     k8.CAST_T, k8.FC_E4M3))
        return fake_ours(5.0)

    monkeypatch.setattr(eg, "bench_ours", ours)
    before = (k8.SAVE_TRANSPOSES, k8.DGELU_CAST, k8.Fp8Gemm.cast_weights, k8.CAST_T, k8.FC_E4M3)
    out = tmp_path / "bench.json"
    assert eg.main(["--variants", "andrea-12m:8", "--precision", "bf16", "fp8:delayed", "--fp8-plain",
                    "--fp8-cast-t", "smem", "warp", "--fp8-flip", "FC_E4M3", "--anchors", "--json", str(out)]) == 0
    d = before[3]
    assert seen == [("bf16", True, True, False, d, True), ("fp8:delayed", True, True, False, d, True),
                    ("fp8:delayed", False, False, True, d, True), ("fp8:delayed", True, True, False, "smem", True),
                    ("fp8:delayed", True, True, False, "warp", True), ("fp8:delayed", True, True, False, d, False)]
    assert (k8.SAVE_TRANSPOSES, k8.DGELU_CAST, k8.Fp8Gemm.cast_weights, k8.CAST_T, k8.FC_E4M3) == before
    got = json.loads(out.read_text())["andrea-12m:B8"]
    assert {"ours-fp8:delayed-plain", "ours-fp8:delayed-cast-smem", "ours-fp8:delayed-cast-warp",
            "ours-fp8:delayed-flip-FC_E4M3"} <= set(got)


def test_lt_first_times_every_precision_without_the_algorithm_table_and_restores_it(eg, tmp_path, monkeypatch):
    """--lt-first: one more run of ours per precision with cublaslt.USE_CHOICES off, then back on."""
    import andrea.cuda.cublaslt as ltm

    seen = []

    def ours(s, B, steps, warmup, prec, recompute=None, fp8_gelu=None):
        seen.append((prec, ltm.USE_CHOICES))
        return fake_ours(5.0)

    monkeypatch.setattr(eg, "bench_ours", ours)
    out = tmp_path / "bench.json"
    assert eg.main(["--variants", "andrea-12m:8", "--precision", "bf16", "fp8:delayed", "--lt-first", "--anchors",
                    "--json", str(out)]) == 0
    assert seen == [("bf16", True), ("fp8:delayed", True), ("bf16", False), ("fp8:delayed", False)]
    assert ltm.USE_CHOICES is True
    got = json.loads(out.read_text())["andrea-12m:B8"]
    assert {"ours-bf16-heuristic", "ours-fp8:delayed-heuristic"} <= set(got)


def test_kernel_times_averages_per_step_and_drops_the_profilers_own_rows(eg):
    """kernel_times (the torch.profiler reading both benches share): device us -> ms a step, calls a
    step, ProfilerStep / cudaGraph rows and zero-time rows left out, the older cuda_time_total read
    where device_time_total is missing."""
    from types import SimpleNamespace as E

    class Old:                                        # an event from a torch without device_time_total
        key, count, cuda_time_total = "k_old", 6, 3000.0

    prof = E(key_averages=lambda: [E(key="k_a", count=6, device_time_total=1500.0),
                                   E(key="ProfilerStep#1", count=3, device_time_total=9e6),
                                   E(key="cudaGraphLaunch", count=3, device_time_total=5.0),
                                   E(key="k_zero", count=3, device_time_total=0.0), Old()])
    assert eg.kernel_times(prof, 3) == {"k_a": [0.5, 2.0], "k_old": [1.0, 2.0]}


def test_every_window_is_kept_so_a_drift_shows(eg, monkeypatch):
    # a step that gets slower each time (as bf16 on the H200 for a few steps after warm-up): each window's
    # ms a step is its own, in order, and the median of them is what "ms" reports
    clock, cost, synced = [0.0], [1e-3], []

    def step():
        clock[0] += cost[0]
        cost[0] += 1e-4

    monkeypatch.setattr(eg.time, "perf_counter", lambda: clock[0])
    got = eg._windows(step, lambda: synced.append(clock[0]), steps=2, windows=3)
    assert got == pytest.approx([1.05, 1.25, 1.45])                  # ms a step of steps 1-2, 3-4, 5-6
    assert len(synced) == 6                                           # the device drained at both ends


def test_power_log_takes_the_medians_of_the_samples_in_a_window(eg):
    """PowerLog over a stand-in for nvidia-smi: lines that are not samples ("[N/A]") are skipped, each
    sample is stamped as it arrives, and a window holds the medians of its own samples only."""
    import sys
    import time

    script = ("import sys, time\nprint('[N/A], [N/A]', flush=True)\n"
              "for i in range(30):\n    print(f'{1500 + i}, 690.5', flush=True)\n    time.sleep(0.01)\n")
    t0 = time.time()
    log = eg.PowerLog((sys.executable, "-c", script))
    log.proc.wait()
    log.thread.join(timeout=10)
    t1 = time.time()
    got = log.between(t0, t1)
    assert got == {"sm_mhz": 1514.5, "power_w": 690.5, "power_samples": 30}
    assert log.between(t1 + 1, t1 + 2) is None
    log.close()


def test_power_figures_land_beside_each_engines_timing(eg, tmp_path, monkeypatch):
    """--power: each engine's result gets the clock and power of its own timed steps (``timed_at``)."""
    class Log:
        def __init__(self):
            self.closed = False

        def between(self, t0, t1):
            return {"sm_mhz": 1000.0 + t0, "power_w": 690.0, "power_samples": 3}

        def close(self):
            self.closed = True

    logs = []
    monkeypatch.setattr(eg, "PowerLog", lambda: logs.append(Log()) or logs[-1])
    monkeypatch.setattr(eg, "bench_ours", lambda s, B, steps, warmup, prec: {**fake_ours(5.0), "timed_at": [7.0, 8.0]})
    out = tmp_path / "bench.json"
    assert eg.main(["--variants", "andrea-12m:8", "--anchors", "--power", "--json", str(out)]) == 0
    ours = json.loads(out.read_text())["andrea-12m:B8"]["ours"]
    assert (ours["sm_mhz"], ours["power_w"], ours["power_samples"]) == (1007.0, 690.0, 3)
    assert ours["joules_per_step"] == pytest.approx(690.0 * 5.0e-3)
    assert logs[0].closed


@pytest.mark.parametrize("sustain_ms,calls", [(0.0, 4), (10.0, 3 + 20 + 10)])
def test_event_timing_counts_its_calls_against_a_fake_device_clock(eg, monkeypatch, sustain_ms, calls):
    """sustained_ms over a fake device where every call takes 0.5 ms: ``reps`` timed calls; with
    sustain_ms, 3 calls to gauge one, sustain_ms of calls back to back, then calls filling half of it.
    event_ms adds one untimed call before its ``reps``."""
    n = [0]
    fake_device_clock(monkeypatch, n)

    def call():
        n[0] += 1

    assert eg.sustained_ms(call, 4, sustain_ms) == 0.5 and n[0] == calls
    n[0] = 0
    assert eg.event_ms(call, 4) == 0.5 and n[0] == 5


def test_power_log_counts_the_clock_slowdown_reasons_of_its_samples(eg):
    """PowerLog with nvidia-smi's temperature and clock event reasons: the median temperature, and for each
    SLOWDOWNS reason the share of the window's samples whose bit mask holds it; "[N/A]" reasons count as
    none known, not as no slowdown."""
    import sys
    import time

    rows = ["1700, 690, 60, 0x0000000000000004", "1650, 700, 62, 0x000000000000000C",
            "1980, 150, 58, 0x0000000000000000", "1600, 699, 64, [N/A]"]
    script = "import sys\n" + "".join(f"print({r!r}, flush=True)\n" for r in rows)
    t0 = time.time()
    log = eg.PowerLog((sys.executable, "-c", script))
    log.proc.wait()
    log.thread.join(timeout=10)
    got = log.between(t0, time.time())
    assert got["sm_mhz"] == 1675.0 and got["power_w"] == 694.5 and got["power_samples"] == 4
    assert got["temp_c"] == 61.0
    assert got["slowdown_share"] == pytest.approx({"sw power cap": 2 / 3, "hw slowdown": 1 / 3, "sw thermal": 0.0,
                                                   "hw thermal": 0.0, "power brake": 0.0})
    log.close()
    assert eg.power_why(got) == " (61 C, sw power cap 67%; hw slowdown 33%)"
    assert eg.power_why({"temp_c": 50.0, "slowdown_share": dict.fromkeys(eg.SLOWDOWNS, 0.0)}) == \
        " (50 C, no slowdown reason)"
    assert eg.power_why({"sm_mhz": 1.0}) == ""


@pytest.mark.parametrize("refused,fields", [(0, 0), (1, 1), (2, 2)])
def test_power_query_drops_the_fields_an_older_nvidia_smi_refuses(eg, refused, fields):
    """power_query tries SMI_FIELDS, then each of SMI_OLDER but the last, until nvidia-smi answers one (the
    first ``refused`` trials fail here); the last is the clock and the power alone, never tried. It samples
    every 100 ms either way."""
    import types

    tried = []

    def run(argv, **kw):
        tried.append(argv[1])
        return types.SimpleNamespace(returncode=6 if len(tried) <= refused else 0)

    cmd = eg.power_query(run)
    lists = [eg.SMI_FIELDS, *eg.SMI_OLDER]
    assert tried == ["--query-gpu=" + ",".join(f) for f in lists[:min(refused + 1, 2)]]
    assert cmd[1] == "--query-gpu=" + ",".join(lists[fields]) and cmd[-2:] == ("-lms", "100")
    assert lists[-1] == ("clocks.sm", "power.draw")


def test_release_pool_collects_the_cycles_before_it_frees_the_blocks(eg, monkeypatch):
    """release_pool: what only a reference cycle holds (as a dropped GpuEngine's arena) is gone by the time
    the pool gives its free blocks back, so they include it."""
    import gc
    import sys
    import types
    import weakref

    class Engine:
        pass

    eng = Engine()
    eng.me = eng                                  # a cycle: del alone does not free it
    gone = weakref.ref(eng)
    seen = []
    pool = types.SimpleNamespace(free_all_blocks=lambda: seen.append(gone() is None))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(get_default_memory_pool=lambda: pool))
    gc.disable()
    try:
        del eng
        assert gone() is not None
        eg.release_pool()
    finally:
        gc.enable()
    assert seen == [True]


def test_autotune_seed_places_the_kept_timings_under_their_hash_and_keeps_this_machines(eg, tmp_path, monkeypatch):
    """--autotune-seed: before max-autotune, every committed inductor GEMM-timing file lands in
    $TORCHINDUCTOR_CACHE_DIR/cache/<its system hash>, byte for byte, where inductor looks it up; a file
    already there (this machine's own timings) is left alone; without max-autotune nothing is placed. The kept
    kernel-config bundles of this card (asked of the device; here an H100) land at their paths too, another
    card's do not."""
    seeds = sorted(eg.ROOT.glob(eg.AUTOTUNE_SEEDS))
    kept = {json.loads(f.read_text())["system"]["hash"]: f.read_bytes() for f in seeds}
    assert len(kept) >= 2                                     # the H200's (session 35) and the H100's (39)
    cache = tmp_path / "inductor"
    own = next(iter(kept))
    (cache / "cache").mkdir(parents=True)
    (cache / "cache" / own).write_text("{\"this machine\": 1}")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    asked = []
    monkeypatch.setattr(eg, "device_name", lambda: asked.append(1) or "NVIDIA H100 80GB HBM3")
    ran = []
    monkeypatch.setattr(eg, "bench_ours", lambda s, B, steps, warmup, prec: fake_ours(5.0))
    monkeypatch.setattr(eg, "bench_torch", lambda s, B, steps, warmup, a, profile=False:
                        ran.append(sorted(p.name for p in (cache / "cache").iterdir())) or dict(fake_ours(6.0), warmup_s=1.0))
    assert eg.main(["--variants", "andrea-12m:8", "--anchors", "compile-reduce-overhead"]) == 0
    assert not asked and not list(cache.glob("*/*.best_config"))
    assert ran == [[own]]                                     # no max-autotune, no seeds
    assert eg.main(["--variants", "andrea-12m:8", "--anchors", "compile-max-autotune", "--autotune-seed"]) == 0
    assert ran[-1] == sorted(kept)
    assert json.loads((cache / "cache" / own).read_text()) == {"this machine": 1}   # not inductor's: left alone
    for h, d in kept.items():
        if h != own:
            assert (cache / "cache" / h).read_bytes() == d
    bundles = {b["system"]["device"]["name"]: b["files"]
               for b in (json.loads(f.read_text()) for f in sorted(eg.ROOT.glob(eg.BEST_CONFIG_SEEDS)))}
    assert asked and "NVIDIA H100 80GB HBM3" in bundles and len(bundles) >= 2
    placed = {p.relative_to(cache).as_posix(): p.read_text() for p in cache.glob("*/*.best_config")}
    assert placed == bundles["NVIDIA H100 80GB HBM3"]


def test_the_fastest_mode_is_also_compared_window_by_window(eg, tmp_path, monkeypatch, capsys):
    """Beside the ratio of the medians (105 / 90 = 1.167x), the median of window i of the fastest mode over
    window i of ours: 100/90, 105/100, 110/90 -> 1.111, 1.05, 1.222 -> 1.111x, in the JSON and on the table."""
    monkeypatch.setattr(eg, "bench_ours", lambda s, B, steps, warmup, prec: {
        **fake_ours(90.0), "windows_ms": [90.0, 100.0, 90.0]})
    torch_ms = {"compile-default": [120.0] * 3, "compile-reduce-overhead": [100.0, 105.0, 110.0]}
    monkeypatch.setattr(eg, "bench_torch", lambda s, B, steps, warmup, a, profile=False: {
        "ms": float(sorted(torch_ms[a])[1]), "windows_ms": torch_ms[a], "peak_bytes": 2 ** 31, "warmup_s": 1.0})
    out = tmp_path / "bench.json"
    assert eg.main(["--variants", "andrea-12m:8", "--anchors", "compile-default", "compile-reduce-overhead",
                    "--json", str(out)]) == 0
    r = json.loads(out.read_text())["andrea-12m:B8"]
    assert r["best_compile"] == "compile-reduce-overhead"
    assert r["ratio_vs_best"] == pytest.approx(105.0 / 90.0)
    assert r["paired_vs_best"] == pytest.approx(100.0 / 90.0)
    assert "best=compile-reduce-overhead: 1.17x (paired windows 1.11x) mem 0.50" in capsys.readouterr().out
    assert eg.paired_ratio({"windows_ms": [1.0]}, {"ms": 2.0}) is None      # a record without windows: no pairing
