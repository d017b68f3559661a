"""andrea/resources.py: what each stage asks a scheduler for, and how a Snakemake rule declares it."""

import copy
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from andrea.config import load_config
from andrea.engine.backend import NumpyBackend
from andrea.engine.engine import Engine
from andrea.errors import ConfigError
from andrea.resources import (STAGES, main, model_config, numpy_planned_bytes, numpy_slots, numpy_threads, rule_resources,
                              rule_threads, stage_resources, train_steps)

ROOT = Path(__file__).resolve().parents[1]
PROFILES = sorted(p.stem for p in (ROOT / "params" / "profile").glob("*.yaml"))


@pytest.fixture(scope="module")
def cfgs():
    return {p: load_config(ROOT / "params.yaml", p) for p in PROFILES}


def test_numpy_plan_is_the_engines_planned_bytes(cfgs):
    cfg = cfgs["tiny"]
    eng = Engine(model_config(cfg), int(cfg["train"]["batch_size"]), NumpyBackend())
    assert numpy_planned_bytes(cfg) == eng.planned_bytes


def test_numpy_slots_are_the_pools_batch_slices(cfgs):
    for B in (1, 3, int(cfgs["tiny"]["train"]["batch_size"]), 64):
        assert numpy_slots(B) == NumpyBackend.row_slots(B)


def test_the_table_covers_every_profile_and_refuses_an_unknown_one(capsys):
    assert main(["--params", str(ROOT / "params.yaml")]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert sorted({r.split()[0] for r in rows}) == PROFILES and len(PROFILES) >= 2
    assert len(rows) == len(PROFILES) * (len(STAGES) + 1)
    assert main(["--params", str(ROOT / "params.yaml"), "--profile", "nope"]) == 3
    out = capsys.readouterr()
    assert out.out == "" and "profile 'nope'" in out.err and "known: " in out.err


def test_the_plan_and_threads_follow_the_fixed_batch_slices(cfgs, monkeypatch):
    from andrea.engine import pool

    cfg = cfgs["tiny"]
    two, threads = numpy_planned_bytes(cfg), numpy_threads(cfg)
    assert threads == pool.BATCH_SLICES
    monkeypatch.setattr(pool, "BATCH_SLICES", 4)
    monkeypatch.setattr(pool.batch_slices, "__defaults__", (4,))
    assert numpy_threads(cfg) == 4 and numpy_planned_bytes(cfg) > two  # each slice: own gradients, scratch


def test_tiny_train_runs_on_cpu_with_room_for_its_plan(cfgs):
    cfg = cfgs["tiny"]
    r = stage_resources("train", cfg, phase="warmup")
    assert r["gpu"] == 0 and r["threads"] == len(NumpyBackend.row_slots(int(cfg["train"]["batch_size"])))
    assert r["mem_mb"] * 2**20 > numpy_planned_bytes(cfg)
    assert isinstance(r["runtime"], int) and r["runtime"] > 0


@pytest.mark.parametrize("backend,precision,gpu", [("auto", "fp32", 1), ("cupy", "bf16", 1), ("numpy", "fp32", 0)])
def test_gpu_follows_the_backend(cfgs, backend, precision, gpu):
    cfg = copy.deepcopy(cfgs["tiny"])
    cfg["train"].update(backend=backend, precision=precision)
    for stage, phase in (("train", "main"), ("eval", None), ("audit", None)):
        assert stage_resources(stage, cfg, phase)["gpu"] == gpu
    assert stage_resources("tokenizer", cfg)["gpu"] == 0


def test_runtime_grows_with_steps_and_memory_with_the_model(cfgs):
    base = cfgs["andrea-12m"]
    longer = copy.deepcopy(base)
    longer["train"]["max_steps"] *= 4
    assert stage_resources("train", longer, "main")["runtime"] > stage_resources("train", base, "main")["runtime"]
    assert stage_resources("train", longer, "warmup") == stage_resources("train", base, "warmup")
    assert (stage_resources("train", cfgs["andrea-480m"], "main")["mem_mb"]
            > stage_resources("train", cfgs["andrea-120m"], "main")["mem_mb"]
            > stage_resources("train", base, "main")["mem_mb"])
    assert train_steps(base, "warmup") + train_steps(base, "main") == base["train"]["max_steps"]


def test_a_retry_asks_for_more(cfgs):
    one = stage_resources("diet-alignment", cfgs["tiny"])
    two = stage_resources("diet-alignment", cfgs["tiny"], attempt=2)
    assert (two["mem_mb"], two["runtime"], two["threads"]) == (2 * one["mem_mb"], 2 * one["runtime"], one["threads"])


def test_the_hub_corpus_takes_longer_than_the_embedded_one(cfgs):
    cfg = cfgs["tiny"]
    assert (stage_resources("pull-hermes3", cfg, corpus="hub")["runtime"]
            > stage_resources("pull-hermes3", cfg, corpus="embedded")["runtime"])


@pytest.mark.parametrize("profile", PROFILES)
def test_every_stage_of_every_profile_has_whole_positive_figures(cfgs, profile):
    for stage in STAGES:
        for phase in (("warmup", "main") if stage == "train" else (None,)):
            r = stage_resources(stage, cfgs[profile], phase)
            assert set(r) == {"threads", "mem_mb", "runtime", "gpu"}
            assert all(isinstance(v, int) for v in r.values()), (stage, r)
            assert r["threads"] >= 1 and r["mem_mb"] >= 256 and r["runtime"] >= 1 and r["gpu"] in (0, 1)


def test_bad_requests_name_what_is_wrong(cfgs):
    with pytest.raises(ConfigError, match="stage 'trian'"):
        stage_resources("trian", cfgs["tiny"])
    with pytest.raises(ConfigError, match="phase"):
        stage_resources("train", cfgs["tiny"])
    with pytest.raises(ConfigError, match="phase 'cooldown'"):
        stage_resources("train", cfgs["tiny"], phase="cooldown")


def test_rule_helpers_evaluate_per_wildcards_and_attempt(cfgs):
    w = SimpleNamespace(variant="tiny", corpus="hub")
    res = rule_resources("train", lambda w: cfgs[w.variant], phase="main")
    assert set(res) == {"mem_mb", "runtime", "gpu"}
    want = stage_resources("train", cfgs["tiny"], "main", attempt=3)
    assert {k: f(w, 3) for k, f in res.items()} == {k: want[k] for k in res}
    assert rule_threads("train", lambda w: cfgs[w.variant], phase="main")(w) == want["threads"]
    pull = rule_resources("pull-hermes3", lambda w: cfgs["tiny"], corpus_of=lambda w: w.corpus)
    assert pull["runtime"](w, 1) == stage_resources("pull-hermes3", cfgs["tiny"], corpus="hub")["runtime"]


@pytest.mark.skipif(shutil.which("snakemake") is None, reason="snakemake is not installed")
def test_a_snakemake_rule_declares_them(tmp_path, cfgs):
    """The way workflow/rules/*.smk call it: Snakemake sees the threads and resources."""
    (tmp_path / "Snakefile").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from andrea.config import load_config
        from andrea.resources import rule_resources, rule_threads
        CFG = {{"tiny": load_config({str(ROOT / "params.yaml")!r}, "tiny")}}

        rule train:
            output: "runs/{{variant}}/main.done"
            threads: rule_threads("train", lambda w: CFG[w.variant], phase="main")
            resources:
                **rule_resources("train", lambda w: CFG[w.variant], phase="main"),
            shell: "touch {{output}}"
        """))
    out = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "64", "runs/tiny/main.done"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr + out.stdout
    want = stage_resources("train", cfgs["tiny"], "main")
    log = out.stdout + out.stderr
    assert f"threads: {want['threads']}" in log
    assert f"mem_mb={want['mem_mb']}," in log and f"runtime={want['runtime']}," in log and "gpu=0" in log
