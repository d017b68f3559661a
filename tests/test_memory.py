"""The model family's tables (andrea/memory.py, docs/ANDREA.md) and the memory preflight
(andrea/preflight.py check_memory) without a GPU: the free memory is injected.

    pytest tests/test_memory.py

The doc's generated blocks must equal what the code computes now; the planners' items sum to
the engines' planned bytes; the largest-batch search agrees with a linear scan; the refusal
gives planned and free bytes and the batch that fits; both engines refuse before allocating;
``andrea train`` with a model the host cannot hold exits 2 in one line, writing nothing. The
same refusal on a real device: tests/test_memory_gpu.py.
"""

from __future__ import annotations

import math
import re
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from andrea.cuda.engine import GpuEngine, arena_layout
from andrea.engine.backend import NumpyBackend
from andrea.engine.engine import Engine, engine_bytes
from andrea.engine.model import ModelConfig, param_layout
from andrea.errors import AndreaError
from andrea.memory import (BLOCKS, CONTEXT_RESERVE, GIB, card_batch, load_variants, main, plan_items,
                           planned_bytes, refresh, render)
from andrea.preflight import HEADROOM, check_memory, fits, host_free_memory, largest_batch
from train_helpers import make_data, micro_overrides, run_cli

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ANDREA.md"
MC = ModelConfig(vocab_size=97, d_model=64, n_head=2, n_layer=2, context=32)
MIB = 1 << 20


@pytest.fixture(scope="module")
def variants():
    return load_variants(ROOT / "params.yaml")


# ----------------------------------------------------------------------------- the doc
def test_the_docs_tables_are_what_the_code_computes(capsys):
    assert main(["--params", str(ROOT / "params.yaml"), "--check", str(DOC)]) == 0, capsys.readouterr().err


def test_a_drifted_or_missing_block_is_named_and_rewritten(variants, tmp_path, capsys):
    doc = DOC.read_text(encoding="utf-8")
    blocks = render(variants)
    drifted = doc.replace(blocks["family"].splitlines()[-1], "| andrea-120m | 768 | ... | 120,000,000 |")
    new, changed, missing = refresh(drifted, blocks)
    assert changed == ["family"] and missing == [] and new == doc
    cut = re.sub(r"<!-- memory:cards begin.*?<!-- memory:cards end -->", "", doc, flags=re.S)
    assert refresh(cut, blocks)[2] == ["cards"]
    f = tmp_path / "ANDREA.md"
    f.write_text(drifted, encoding="utf-8")
    assert main(["--params", str(ROOT / "params.yaml"), "--check", str(f)]) == 1
    assert "out of date: family" in capsys.readouterr().err
    assert main(["--params", str(ROOT / "params.yaml"), "--write", str(f)]) == 0
    assert f.read_text(encoding="utf-8") == doc
    with pytest.raises(AndreaError, match="memory:nope: no such table"):
        refresh("<!-- memory:nope begin -->\nx\n<!-- memory:nope end -->", blocks)


def test_every_block_the_module_makes_has_its_place_in_the_doc():
    doc = DOC.read_text(encoding="utf-8")
    for name in BLOCKS:
        assert f"<!-- memory:{name} begin" in doc and f"<!-- memory:{name} end -->" in doc, name


# ----------------------------------------------------------------------------- the counts
def test_the_counts_are_the_layouts_and_the_docs_formula(variants):
    for v in variants:
        mc = v.mc
        C, L = mc.d_model, mc.n_layer
        assert v.n == param_layout(mc).n_params
        assert v.n == mc.vocab_size * C + mc.context * C + L * (12 * C * C + 4 * C) + 2 * C, v.profile
        assert mc.vocab_size == 256 + v.n_morphemes + 1
    by = {v.profile: v for v in variants}
    assert f"{by['andrea-120m'].n / 1e6:.1f}M" == "92.2M"      # the seeds' "120M" shapes


# ----------------------------------------------------------------------------- the planners
@pytest.mark.parametrize("B", [1, 2, 3, 5])
def test_the_numpy_items_sum_to_the_engines_planned_bytes(B):
    eng = Engine(MC, B, NumpyBackend())
    items = plan_items(MC, B, "fp32", "numpy")
    assert sum(items.values()) == eng.planned_bytes == eng.allocated_bytes == engine_bytes(MC, B, NumpyBackend)
    n = eng.n_params
    assert items["master"] == 4 * n and items["adam"] == 8 * n and items["copy"] == 0
    assert items["grads"] == 4 * n * len(eng.slots)           # g + one buffer per slice after the first


@pytest.mark.parametrize("prec", ["fp32", "bf16", "fp16"])
def test_the_gpu_items_sum_to_the_arena(prec):
    items = plan_items(MC, 3, prec)                           # train.grad_accum 1, the profiles' own
    arena = arena_layout(MC, 3, prec, grad_accum=1)
    assert sum(items.values()) == arena.nbytes
    assert sum(plan_items(MC, 3, prec, grad_accum=None).values()) == arena_layout(MC, 3, prec).nbytes
    n = param_layout(MC).n_params
    pad = lambda b: -(-b // 256) * 256  # noqa: E731
    name, shape, dt = arena.spec[-1]                          # the entries tile the arena up to its rounding
    end = arena.offsets[name] + pad(math.prod(shape) * np.dtype(dt).itemsize)
    assert 0 <= arena.nbytes - end < 512 and arena.nbytes % 512 == 0
    assert items["master"] == items["grads"] == pad(4 * n) and items["adam"] == 2 * pad(4 * n)
    vp = -(-MC.vocab_size // 64) * 64                         # + the head's zero-padded wte (Vp, C), 16-bit
    assert items["copy"] == (0 if prec == "fp32" else pad(2 * n) + pad(2 * vp * MC.d_model))
    assert all(items[k] > 0 for k in ("saved", "dgrad", "work"))


@pytest.mark.parametrize("B", [1, 3, 8])
def test_one_microbatch_a_step_lays_the_upper_layers_activations_in_the_gradients(B):
    # engine.ACTS_IN_GRADS: with grad_accum 1 (bf16/fp16, one GPU) layer l's moved buffers lie inside the
    # gradient rows of layer l-1's matmul weights, 256-byte aligned, one after the other, the same names in
    # every layer 1..L-1, each with its layer's shape; their entries keep layer 0, and the arena shrinks by
    # what left them; nothing moves with more microbatches, in fp32 or fp8, on two ranks
    import andrea.cuda.engine as ce
    from andrea.engine import recipe
    from andrea.engine.model import contiguous_span

    mc = ModelConfig(vocab_size=97, d_model=64, n_head=2, n_layer=3, context=32)
    layout, L = param_layout(mc), mc.n_layer
    nbytes = lambda shape, dt: math.prod(shape) * np.dtype(dt).itemsize  # noqa: E731
    pad = lambda b: -(-b // 256) * 256  # noqa: E731
    for prec in ("bf16", "fp16"):
        whole, one = arena_layout(mc, B, prec), arena_layout(mc, B, prec, grad_accum=1)
        full, kept = {n: (s, dt) for n, s, dt in whole.spec}, {n: s for n, s, _ in one.spec}
        assert one.layers and set(one.layers) <= set(ce.ACTS_IN_GRADS) and whole.layers == ()
        placed = {}
        for name, shape, dt, host, at in one.aliases:
            if host != "g":
                continue
            base, l = name.rsplit(".", 1)
            lo, hi = contiguous_span(layout, [f"h.{int(l) - 1}.{k}" for k in recipe.MATMUL_WEIGHTS])
            assert at % 256 == 0 and 4 * lo <= at and at + nbytes(shape, dt) <= 4 * hi
            assert (shape, dt) == (full[base][0][1:], full[base][1]) and kept[base] == (1, *shape)
            placed.setdefault(int(l), []).append((at, at + nbytes(shape, dt), base))
        assert sorted(placed) == list(range(1, L))
        for spans in placed.values():
            assert [s[2] for s in spans] == list(one.layers)
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        freed = sum(pad(nbytes(*full[n])) - pad(nbytes((1, *full[n][0][1:]), full[n][1])) for n in one.layers)
        assert 0 <= freed - (whole.nbytes - one.nbytes) < 512
        assert sum(plan_items(mc, B, prec).values()) == one.nbytes
    for kw in ({"grad_accum": 2}, {"grad_accum": None}, {"world": 2, "grad_accum": 1}):
        assert arena_layout(mc, B, "bf16", **kw).layers == ()
    for prec in ("fp32", "fp8"):
        assert arena_layout(mc, B, prec, grad_accum=1) == arena_layout(mc, B, prec)
    gelu = arena_layout(mc, B, "bf16", recompute="gelu", grad_accum=1)   # one h_act for every layer: stays
    assert "h_act" not in gelu.layers and dict((n, s) for n, s, _ in gelu.spec)["h_act"][0] == 1


def test_the_refusal_counts_its_batch_with_more_microbatches_where_that_plans_more(variants):
    # check_memory's accum_of: the batch it offers (raising train.grad_accum) fits with more than one
    # microbatch a step, whose plan keeps every layer's activations in their own bytes (ACTS_IN_GRADS)
    v = next(v for v in variants if v.profile == "andrea-480m")
    one = lambda b: planned_bytes(v.mc, b, "bf16")  # noqa: E731
    more = lambda b: planned_bytes(v.mc, b, "bf16", grad_accum=None)  # noqa: E731
    free = 24 * GIB - CONTEXT_RESERVE
    assert largest_batch(one, free) > largest_batch(more, free)       # 13 against 12 on 24 GiB
    with pytest.raises(AndreaError) as e:
        check_memory(one, 64, (free, "GPU 0"), "cupy bf16 engine", accum_of=more)
    assert f"the largest batch that fits is {largest_batch(more, free)}:" in str(e.value)


def test_the_planners_grow_with_the_batch():
    for plan in (lambda b: planned_bytes(MC, b, "bf16"), lambda b: planned_bytes(MC, b, "fp32", "numpy")):
        sizes = [plan(b) for b in range(1, 40)]
        assert all(a < b for a, b in zip(sizes, sizes[1:]))


def test_fp8_is_planned_by_the_gpu_engine_and_refused_by_numpy():
    with pytest.raises(AndreaError, match="not supported by the cupy engine"):
        GpuEngine(object(), MC, 1, precision="fp4")
    assert planned_bytes(MC, 1, "fp8") > planned_bytes(MC, 1, "bf16")     # + E4M3 copies, casts, workspace
    with pytest.raises(AndreaError, match="fp32 only"):
        plan_items(MC, 1, "fp8", "numpy")


# ----------------------------------------------------------------------------- the search
@pytest.mark.parametrize("engine,prec", [("numpy", "fp32"), ("cupy", "fp32"), ("cupy", "bf16")])
def test_largest_batch_is_the_linear_scans_answer(engine, prec):
    plan = lambda b: planned_bytes(MC, b, prec, engine)  # noqa: E731
    for free in (0, plan(1), int(plan(1) * HEADROOM), int(plan(7) * HEADROOM) + 1, int(plan(7) * HEADROOM) - 1,
                 int(plan(33) * 1.3)):
        scan = 0
        while fits(plan(scan + 1), free):
            scan += 1
        assert largest_batch(plan, free) == scan, free


def test_card_batches_follow_the_rule(variants):
    v = variants[-1]
    for card in (8, 24):
        b = card_batch(v.mc, "bf16", card)
        free = card * GIB - CONTEXT_RESERVE
        assert b == 0 or fits(planned_bytes(v.mc, b, "bf16"), free)
        assert not fits(planned_bytes(v.mc, b + 1, "bf16"), free)


# ----------------------------------------------------------------------------- the refusal
def test_the_refusal_gives_both_numbers_the_batch_that_fits_and_what_to_set(variants):
    v = next(v for v in variants if v.profile == "andrea-120m")
    plan = lambda b: planned_bytes(v.mc, b, "bf16")  # noqa: E731
    free = 24 * GIB - CONTEXT_RESERVE
    with pytest.raises(AndreaError) as e:
        check_memory(plan, 128, (free, "GPU 0 (24.0 GiB in all)"), "cupy bf16 engine")
    msg = str(e.value)
    assert "\n" not in msg and e.value.exit_code == 2
    fit = int(re.search(r"the largest batch that fits is (\d+): set -S train\.batch_size=(\d+)", msg).group(1))
    assert fits(plan(fit), free) and not fits(plan(fit + 1), free)
    assert f"-S train.batch_size={fit} " in msg and f"multiply train.grad_accum by {-(-128 // fit)}" in msg
    assert f"plans {plan(128) / GIB:.2f} GiB" in msg and f"has {free / GIB:.2f} GiB free" in msg
    assert "train.batch_size=128" in msg and "GPU 0" in msg
    check_memory(plan, fit, (free, "GPU 0"), "cupy bf16 engine")   # what it names does pass
    check_memory(plan, 10 ** 9, None, "cupy bf16 engine")          # unknown free memory: no check


def test_a_model_that_never_fits_says_so(variants):
    plan = lambda b: planned_bytes(variants[-1].mc, b, "fp32")  # noqa: E731
    with pytest.raises(AndreaError, match=r"even train\.batch_size=1 needs .* use a smaller model") as e:
        check_memory(plan, 8, (512 * MIB, "GPU 0"), "cupy fp32 engine")
    assert "512.0 MiB free" in str(e.value)


class TightHost(NumpyBackend):
    """The NumPy backend on a host with ``FREE`` bytes available (the injected query)."""

    FREE = 2 * MIB

    @classmethod
    def free_memory(cls):
        return cls.FREE, "a test host"


def test_the_numpy_engine_refuses_before_allocating():
    need = engine_bytes(MC, 16, NumpyBackend)
    assert need > 4 * TightHost.FREE
    tracemalloc.start()
    try:
        with pytest.raises(AndreaError, match=r"the numpy float32 engine plans .* but a test host has 2\.0 MiB free"):
            Engine(MC, 16, TightHost())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < need // 10, (peak, need)
    TightHost.FREE = int(need * HEADROOM) + 1
    try:
        assert Engine(MC, 16, TightHost()).planned_bytes == need        # what fits is built
    finally:
        TightHost.FREE = 2 * MIB


def test_the_gpu_engine_refuses_before_touching_cupy():
    class FakeDevice:                    # CupyBackend's free_memory, injected; nothing else is reached
        def free_memory(self):
            return 48 * MIB, "GPU 0 (test double)"    # the bf16 arena holds cuBLASLt's 32 MiB workspace

    with pytest.raises(AndreaError, match=r"train\.batch_size=64: the cupy bf16 engine plans .* GPU 0 \(test double\) "
                                          r"has 48\.0 MiB free; the largest batch that fits is \d+"):
        GpuEngine(FakeDevice(), MC, 64, precision="bf16")


# ----------------------------------------------------------------------------- host memory
def test_host_free_memory_reads_meminfo_and_the_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    root = tmp_path / "cg"
    none = tmp_path / "none"
    assert host_free_memory(meminfo, none, root) == (8000000 * 1024, "this host (MemAvailable)")
    v2 = tmp_path / "v2"
    v2.write_text("0::/job_7\n")
    (root / "job_7").mkdir(parents=True)
    (root / "job_7" / "memory.max").write_text("max\n")
    assert host_free_memory(meminfo, v2, root)[0] == 8000000 * 1024
    (root / "job_7" / "memory.max").write_text(f"{1 << 30}\n")
    assert host_free_memory(meminfo, v2, root) == (1 << 30, "this process's cgroup (memory limit 1.00 GiB)")
    v1 = tmp_path / "v1"
    v1.write_text("5:cpu,cpuacct:/x\n4:memory:/slurm/job_8\n")
    (root / "memory" / "slurm" / "job_8").mkdir(parents=True)
    (root / "memory" / "slurm" / "job_8" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert host_free_memory(meminfo, v1, root)[0] == 8000000 * 1024       # v1's "no limit"
    (root / "memory" / "slurm" / "job_8" / "memory.limit_in_bytes").write_text(f"{2 << 30}\n")
    assert host_free_memory(meminfo, v1, root)[0] == 2 << 30
    assert host_free_memory(none, none, root) is None


# ----------------------------------------------------------------------------- through `andrea train`
def test_train_refuses_a_model_the_host_cannot_hold_with_exit_2(tmp_path):
    tok, tokens = make_data(tmp_path)
    huge = {"model.d_model": 16384, "model.n_head": 2, "model.n_layer": 64}   # ~206e9 parameters: ~3 TB of state
    r = run_cli("warmup", tok, tokens, tmp_path / "run", micro_overrides(5, 10, **huge))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert re.search(r"andrea train: error: train\.batch_size=4: the numpy float32 engine plans [\d.]+ GiB .* "
                     r"free; even train\.batch_size=1 needs", lines[0]), lines[0]
    assert not (tmp_path / "run").exists()                        # nothing was started


# ------------------------------------------------------------------------- train.recompute
def test_recompute_gelu_plans_one_gelu_buffer_and_the_refusal_names_it(variants):
    # bf16 keeps h_act per layer (its GELU comes out of the fc GEMM); gelu keeps one buffer and
    # plans exactly the other layers' (N, 4C) 16-bit values less (each entry is 256-byte aligned);
    # fp32 already recomputes it, so gelu changes nothing there
    from andrea.cuda.engine import recompute_for

    v = next(v for v in variants if v.profile == "andrea-120m")
    B, mc = 32, v.mc
    N, F, L = B * mc.context, 4 * mc.d_model, mc.n_layer
    keep, gelu = arena_layout(mc, B, "bf16"), arena_layout(mc, B, "bf16", recompute="gelu")
    assert recompute_for("bf16") == frozenset() and recompute_for("bf16", "gelu") == frozenset({"gelu"})
    assert dict((n, s) for n, s, _ in keep.spec)["h_act"] == (L, N, F)
    assert dict((n, s) for n, s, _ in gelu.spec)["h_act"] == (1, N, F)
    assert keep.nbytes - gelu.nbytes == (L - 1) * N * F * 2
    assert arena_layout(mc, B, "fp32", recompute="gelu").nbytes == arena_layout(mc, B, "fp32").nbytes
    # 24 GiB: 49 fits as the engine chooses, 60 with gelu (dL/dh in the logits' bytes: engine.DH_IN_LOGITS);
    # at 56 the refusal says gelu keeps the batch
    free = 24 * GIB - CONTEXT_RESERVE
    assert (card_batch(mc, "bf16", 24), card_batch(mc, "bf16", 24, "gelu")) == (49, 60)
    plan = lambda b: planned_bytes(mc, b, "bf16")  # noqa: E731
    light = lambda b: planned_bytes(mc, b, "bf16", recompute="gelu")  # noqa: E731
    with pytest.raises(AndreaError) as e:
        check_memory(plan, 56, (free, "GPU 0"), "cupy bf16 engine", ("train.recompute=gelu", light))
    msg = str(e.value)
    assert "\n" not in msg and f"-S train.recompute=gelu keeps this batch ({light(56) / GIB:.2f} GiB)" in msg
    assert "the largest batch that fits is 49" in msg
    with pytest.raises(AndreaError) as e:                       # too big even so: gelu is not offered
        check_memory(plan, 128, (free, "GPU 0"), "cupy bf16 engine", ("train.recompute=gelu", light))
    assert "recompute" not in str(e.value)


def test_a_recompute_choice_outside_the_list_is_a_one_line_refusal():
    from andrea.engine.model import recompute_set

    with pytest.raises(AndreaError, match=r"^train\.recompute='ln': expected one of auto, gelu$") as e:
        recompute_set("ln", frozenset())
    assert e.value.exit_code == 3                              # a config error, as the schema's


def test_train_recompute_is_validated_and_reaches_the_engine(tmp_path):
    # params: optional (auto), checked by the schema; the trainer hands it to the engine it builds
    from rich.console import Console

    from andrea.errors import ConfigError
    from andrea.settings import Settings
    from andrea.train import Trainer
    from train_helpers import micro_cfg

    assert Settings.from_dict(micro_cfg(2, 2)).train.recompute == "auto"
    with pytest.raises(ConfigError, match="recompute"):
        micro_cfg(2, 2, **{"train.recompute": "ln"})
    tok, tokens = make_data(tmp_path / "data")
    tr = Trainer(micro_cfg(2, 2, **{"train.recompute": "gelu"}), "warmup", tok, tokens, tmp_path / "run",
                 console=Console(stderr=True, force_terminal=False))
    assert tr.engine.policy.recompute == frozenset({"gelu"})
