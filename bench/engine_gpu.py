"""Benchmark: the CuPy engine against a nanoGPT-style PyTorch model of the same shapes, same run.

    PYTHONPATH=. python3 bench/engine_gpu.py                       # the issue's shapes, every compile mode
    PYTHONPATH=. python3 bench/engine_gpu.py --variants andrea-12m:8,64 andrea-120m:32 \
        --anchors compile-default compile-reduce-overhead --breakdown --json out.json
    PYTHONPATH=. python3 bench/engine_gpu.py --anchors            # ours only

A variant is ``name`` (batch ``--batch``) or ``name:B1,B2`` (those batches); shapes from
params/profile/<name>.yaml (V = 256 + n_morphemes + 1). For each (variant, batch): ms/step,
tokens/s, MFU and peak GPU memory of
- ours: ``GpuEngine`` in bf16 (fp32 master weights, m, v), CUDA graph of forward+backward;
- the anchors: the same model in PyTorch (bf16 autocast, F.scaled_dot_product_attention, fused
  AdamW, tied embedding, no biases, GELU tanh) compiled with torch.compile in mode ``default``,
  ``max-autotune`` (Triton GEMM autotuning + CUDA graphs) or ``reduce-overhead`` (CUDA graphs),
  and ``eager`` (no compile). Each anchor's compile (warm-up) seconds are printed; max-autotune
  benchmarks Triton GEMM configs for minutes per shape (142 s at 12M B=8, 166 s at 120M B=32 on the
  H200; with ``--autotune-seed``'s timings 61 s and 144 s, the rest being compiles: docs/bench/s40_h200.md),
  so give it few shapes per call; ``--autotune-seed`` (below) reuses what earlier machines tuned.
Ratios are tokens/s of ours over each anchor and over the FASTEST compile mode run (``best``), the latter
also as the median of paired windows (``paired_ratio``: window i of ours against window i of that mode), and
peak memory of ours over that mode's. MFU = (6 N + 12 L C T) x tokens / time / 989.5e12 (the
H100/H200 SXM dense bf16 datasheet rate; N = parameters without the position embedding). Peak
memory: ours = bytes the CuPy pool holds after the step loop (the engine's arena, cuBLASLt's 32 MiB
workspace included; the cuBLAS handle's own workspace, used by fp32 only, is outside every pool, as for torch); torch = torch.cuda.max_memory_reserved over the
timed steps (what its caching allocator holds, CUDA-graph pools included; max_memory_allocated
misses those pools and is kept in the JSON as peak_allocated_bytes).
``bench/gpu_targets.py`` reads the ``--json`` of three runs (ours records the card's name as ``device``) and
says which of issue 19's targets each meets.
Timing: ``--steps`` steps after ``--warmup`` steps (host clock, device drained at both ends),
random tokens (seeded), the median of three timed windows; engines run one after the
other (never resident together).

``--fp8-gelu``: ours in the first fp8 ``--precision`` again for each engine.FUSE_GELU_FP8 choice given
(``fwd,bwd``: the GELU in the fc forward's and proj dgrad's FP8 epilogues; ``fwd``: the forward's
only; ``none``: fp8's separate GELU passes, h_act recomputed), same run.
``--fp8-plain``: ours in the first fp8 ``--precision`` again with the casts as they were before
session 10 (every weight-gradient transpose cast in the backward, k_gelu_bwd then the cast of dL/dh,
the weights cast one by one), same run; the same bytes, so only the time differs.
``--fp8-cast-t``: ours in the first fp8 ``--precision`` again with each transposing cast kernel given
(andrea/cuda/fp8.py CAST_T: smem, warp), same run; the same bytes.
``--lt-first``: ours in every ``--precision`` again with cuBLASLt's first heuristic candidate for each
GEMM instead of the committed table's choice (andrea/cuda/cublaslt.py USE_CHOICES), same run.
``--fp8-flip``: ours in the first fp8 ``--precision`` again with each andrea/cuda/fp8.py switch given
flipped alone (FC_E4M3: h_act cast from bf16 instead of written in E4M3 by the fc GEMM; FAST_ACCUM_BWD:
fast accumulation in the backward GEMMs too; ATTN_E4M3: dqkv cast from bf16 instead of written in E4M3
by the attention backward; LNB_E4M3: the same for the residual LayerNorm backwards' branch gradient;
FP8_HEAD: the tied head's GEMMs in bf16 instead of E4M3; FP8_HEAD_FWD: its forward in bf16, its backward
on E4M3; HPRE_E4M3: the fc GEMM's aux h_pre in bf16 instead of E4M3), same run.
``--attn-sweep``: one layer's attention forward and backward kernels alone, for each rows-per-block
choice of the tensor-core kernels, mma.sync and (on a compute capability 9.0 device) wgmma
(andrea.cuda.kernels.ATTN_MMA_ROWS / ATTN_WG_ROWS pick one per kernel and D, ATTN_HOPPER the kernels).
``--breakdown``: per kernel class (attention fwd / bwd, GEMM, LayerNorm, elementwise, loss, embed,
optimizer) ms per step of ours (CUDA events around each launcher, eager) beside the anchor's
(torch.profiler's CUDA kernel times of the first compile mode run, grouped by kernel name), with
TFLOP/s for attention (causal flops: fwd 2 B T^2 C per layer, bwd 2.5x that) and the GEMMs; then
ours per named GEMM (qkv, attn-out, fc, proj, head x fwd, dgrad, wgrad: ms, TFLOP/s, share; bf16/fp16/fp8
tag the GEMMs with a fused GELU epilogue "fc fwd+gelu" and "proj dgrad+dgelu": their time holds the
GELU that the elementwise class then lacks), and
(bf16) each GEMM alone through cublasGemmEx, cuBLASLt and cuBLASLt with padded logits rows.
``--power``: the SM clock and the board power over each engine's timed steps (medians of ``nvidia-smi``
samples every 100 ms, ``PowerLog``) and the energy a step (power x step time): at 480M B=16 both engines
hold the H200 at its 700 W limit (at B=8 and 120M B=32 too on some cards), where the ratio of their step
times is the ratio of these energies, and the one at the lower clock does more work per unit of time
(docs/bench/s26_h200.md, s27_h200.md). Beside them the GPU temperature and, for each reason the driver gives
for holding the clock down (software power cap, hardware slowdown, thermal, power brake), the share of
the samples it was active in.
Inductor's cache goes to $TORCHINDUCTOR_CACHE_DIR (default /tmp/andrea-inductor). ``--autotune-seed``
first places there what max-autotune tuned on earlier machines of this card, kept in docs/bench/
(bench/inductor_seed.py: the GEMM timings, and coordinate descent's kernel configs), beside anything the
machine has of its own, which wins; max-autotune then tunes only what neither holds. Inductor reads only what
was made on the same card model with the same software, and its choice among the candidates is still its own.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from andrea.errors import AndreaError, exit_main  # noqa: E402
from andrea.fsutil import atomic_write_json  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from inductor_seed import AUTOTUNE_SEEDS, BEST_CONFIG_SEEDS, DEFAULT_CACHE, seed_all  # noqa: E402

# the CUDA runtime errors that mean "no GPU here", as CuPy's CUDARuntimeError words them
NO_DEVICE = ("cudaErrorNoDevice", "cudaErrorInsufficientDriver")


def exit_gpu_main(main, prog: str) -> None:
    """``andrea.errors.exit_main`` for a GPU bench run as a script: cupy or torch missing, and CuPy finding no
    CUDA device or too old a driver, are its one line on stderr and exit 2 as well, not a traceback; anything
    else keeps its traceback."""
    def guarded():
        try:
            return main()
        except ModuleNotFoundError as e:
            root = (e.name or "").split(".")[0]
            if root not in ("cupy", "torch"):
                raise
            raise AndreaError(f"needs {root}, which this Python cannot import ({e}); run it where {root} is "
                              f"installed{' and a CUDA GPU is' if root == 'cupy' else ''}") from None
        except Exception as e:  # noqa: BLE001 - only CuPy's no-device refusals become one line; the rest re-raise
            if type(e).__name__ != "CUDARuntimeError" or not any(k in str(e) for k in NO_DEVICE):
                raise
            raise AndreaError(f"CuPy finds no usable CUDA device ({e}); run it on a machine with an NVIDIA GPU") \
                from None

    exit_main(guarded, prog)


def release_pool() -> None:
    """CuPy's default pool gives its free blocks back to the device, after the collector has freed what only
    reference cycles still held: a dropped GpuEngine holds some, so ``del eng`` alone leaves its arena in use
    (engine_ab's arms piled up 21 GB engines until an 80 GB H100 refused one, session 38)."""
    import cupy as cp

    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()


@contextmanager
def patched(obj, **attrs):
    """obj's attributes set as given inside the block and put back after it, whatever happens."""
    saved = {k: getattr(obj, k) for k in attrs}
    for k, v in attrs.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(obj, k, v)

PEAK_BF16 = 989.5e12


def variant_shapes(name: str) -> dict:
    base = yaml.safe_load((ROOT / "params.yaml").read_text())
    over = yaml.safe_load((ROOT / "params" / "profile" / f"{name}.yaml").read_text())
    m = {**base["model"], **over.get("model", {})}
    n_morph = over.get("tokenizer", {}).get("n_morphemes", base["tokenizer"]["n_morphemes"])
    return {"C": int(m["d_model"]), "H": int(m["n_head"]), "L": int(m["n_layer"]), "T": int(m["context"]),
            "V": 256 + int(n_morph) + 1}


def flops_per_token(s: dict, n_params: int) -> float:
    n = n_params - s["T"] * s["C"]
    return 6 * n + 12 * s["L"] * s["C"] * s["T"]


# nvmlClocksEventReason bits (nvml.h) that hold the SM clock below its maximum while the card is busy
SLOWDOWNS = {"sw power cap": 0x4, "hw slowdown": 0x8, "sw thermal": 0x20, "hw thermal": 0x40, "power brake": 0x80}
SMI_FIELDS = ("clocks.sm", "power.draw", "temperature.gpu", "clocks_event_reasons.active")
# what an nvidia-smi that refuses SMI_FIELDS is asked instead, in turn: the reasons under their name before
# driver 535, then the clock and the power alone
SMI_OLDER = (SMI_FIELDS[:3] + ("clocks_throttle_reasons.active",), SMI_FIELDS[:2])


def power_query(run=subprocess.run) -> tuple[str, ...]:
    """The nvidia-smi command PowerLog samples with, every 100 ms: SMI_FIELDS, or the first of SMI_OLDER
    that this driver's nvidia-smi answers (one trial query each)."""
    def cmd(fields):
        return ("nvidia-smi", "--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits", "-lms", "100")

    for fields in (SMI_FIELDS, *SMI_OLDER[:-1]):
        if run(list(cmd(fields)[:3]), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
               timeout=30).returncode == 0:
            return cmd(fields)
    return cmd(SMI_OLDER[-1])


def _field(parts: list[str], i: int, conv):
    """conv(parts[i]), or None where the line has no such field or it reads "[N/A]" (a sample without it)."""
    try:
        return conv(parts[i]) if len(parts) > i else None
    except ValueError:
        return None


class PowerLog:
    """GPU 0's SM clock (MHz), board power (W), temperature (C) and clock event reasons, sampled in the
    background by ``cmd`` (nvidia-smi every 100 ms, ``power_query``), each line stamped with the host clock
    (time.time) as it arrives. ``between(t0, t1)``: the medians of the samples in that window, and the share
    of them with each SLOWDOWNS reason active (why the clock sat below its maximum); None where no sample
    fell in it."""

    def __init__(self, cmd=None):
        self.samples: list[tuple[float, float, float, float | None, int | None]] = []
        self.proc = subprocess.Popen(list(cmd or power_query()), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            parts = [x.strip() for x in line.split(",")]
            try:
                mhz, watts = (float(x) for x in parts[:2])
            except ValueError:                   # "[N/A]" or a header: not a sample
                continue
            temp, reasons = _field(parts, 2, float), _field(parts, 3, lambda x: int(x, 16))
            self.samples.append((time.time(), mhz, watts, temp, reasons))

    def between(self, t0: float, t1: float) -> dict | None:
        got = [x for x in list(self.samples) if t0 <= x[0] <= t1]
        if not got:
            return None
        out = {"sm_mhz": statistics.median(x[1] for x in got), "power_w": statistics.median(x[2] for x in got),
               "power_samples": len(got)}
        if temps := [x[3] for x in got if x[3] is not None]:
            out["temp_c"] = statistics.median(temps)
        if reasons := [x[4] for x in got if x[4] is not None]:
            out["slowdown_share"] = {k: sum(1 for r in reasons if r & bit) / len(reasons)
                                     for k, bit in SLOWDOWNS.items()}
        return out

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def _windows(step, cuda_sync, steps: int, windows: int = 3) -> list[float]:
    """ms per step of each of ``windows`` consecutive windows: host clock around ``steps`` steps with the
    device drained at both ends (our step ends with a read-back anyway; torch's queue is drained by the
    final sync). The benches report their median as "ms" and the list as "windows_ms": on the H200 bf16
    steps slow down for a few steps after warm-up (docs/bench/s22_h200.md), which the list shows."""
    times = []
    for _ in range(windows):
        cuda_sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        cuda_sync()
        times.append((time.perf_counter() - t0) * 1e3 / steps)
    return times


def engine_args(spec: str) -> tuple[str, dict]:
    """A --precision value: ``bf16`` ... or ``fp8:current`` / ``fp8:delayed`` (train.fp8_scaling;
    plain ``fp8`` is current) -> (precision, make_engine's extra keywords)."""
    prec, _, scaling = spec.partition(":")
    return prec, ({"fp8_scaling": scaling} if scaling else {})


def device_name() -> str:
    """The current CUDA device's name, as nvidia-smi gives it ("NVIDIA H100 80GB HBM3")."""
    import cupy as cp

    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def bench_ours(s: dict, B: int, steps: int, warmup: int, precision: str, recompute=None, fp8_gelu=None,
               attention=None) -> dict:
    """Our engine's ms/step and peak; ``recompute`` (a frozenset) replaces engine.RECOMPUTE and
    engine.RECOMPUTE_FUSED (bf16/fp16/fp8's, with the GELU epilogues) for this run, ``fp8_gelu``
    (a frozenset) engine.FUSE_GELU_FP8; ``precision`` as ``engine_args`` reads it; ``attention``:
    train.attention (None: its default, auto)."""
    import cupy as cp

    import andrea.cuda.engine as ce

    from andrea.cuda.backend import make_backend
    from andrea.engine.engine import Hyper
    from andrea.engine.model import ModelConfig

    pool = cp.get_default_memory_pool()
    release_pool()
    mc = ModelConfig(s["V"], s["C"], s["H"], s["L"], s["T"])
    default = ce.RECOMPUTE, ce.RECOMPUTE_FUSED, ce.FUSE_GELU_FP8
    if recompute is not None:
        ce.RECOMPUTE = ce.RECOMPUTE_FUSED = recompute
    if fp8_gelu is not None:
        ce.FUSE_GELU_FP8 = fp8_gelu
    try:
        prec, kw = engine_args(precision)
        kw.update({} if attention is None else {"attention": attention})
        eng = make_backend().make_engine(mc, B, precision=prec, cuda_graph=True, grad_accum=1, **kw)   # one batch a step
    finally:
        ce.RECOMPUTE, ce.RECOMPUTE_FUSED, ce.FUSE_GELU_FP8 = default
    print(eng.describe(), file=sys.stderr, flush=True)
    eng.init_weights(1337)
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(4):
        x = rng.integers(0, s["V"], (B, s["T"])).astype(np.int32)
        batches.append((x, np.roll(x, -1, axis=1)))
    hp = Hyper()
    it = [0]

    def step():
        it[0] += 1
        eng.train_step([batches[it[0] % 4]], 3e-4, it[0], hp)

    for _ in range(warmup):
        step()
    cp.cuda.Device().synchronize()
    t0 = time.time()
    windows = _windows(step, cp.cuda.Device().synchronize, steps)
    res = {"ms": float(np.median(windows)), "windows_ms": windows, "timed_at": [t0, time.time()],
           "peak_bytes": int(pool.total_bytes()),
           "device": device_name(),
           "attention": eng.attention,
           "planned_bytes": int(eng.planned_bytes), "pool_used_bytes": int(pool.used_bytes()),
           "n_params": eng.n_params, "loss": None}
    res["loss"] = eng.train_step([batches[0]], 3e-4, it[0] + 1, hp).loss
    del eng
    release_pool()
    return res


# our launchers (andrea.cuda.engine's imports) -> kernel class of the breakdown
# (the fused residual add + LayerNorm forward, and the LayerNorm backward that also writes the branch
# gradient's cast, count as layernorm)
OUR_CLASSES = {"k_attn_fwd": "attention fwd", "k_attn_bwd": "attention bwd", "k_layernorm_fwd": "layernorm",
               "k_layernorm_bwd": "layernorm", "k_residual_layernorm_fwd": "layernorm",
               "k_layernorm_fwd_e4m3": "layernorm", "k_gelu_fwd": "elementwise",
               "k_gelu_bwd": "elementwise",
               "k_residual_add": "elementwise", "k_cast": "elementwise", "k_loss_fwd": "loss", "k_loss_bwd": "loss",
               "k_loss_mean": "loss", "k_embed_fwd": "embed", "k_embed_bwd": "embed"}
FP8_SWITCHES = ("FC_E4M3", "LN_E4M3", "SAVE_TRANSPOSES", "DGELU_CAST", "FAST_ACCUM_BWD",  # --fp8-flip: fp8.py's booleans
                "ATTN_E4M3", "LNB_E4M3", "FP8_HEAD", "FP8_HEAD_FWD", "HPRE_E4M3", "ATTN_FWD_E4M3",
                "ATTN_BWD_T", "ADAMW_E4M3", "W8_ONLY")
CLASS_ORDER = ["attention fwd", "attention bwd", "gemm", "fp8 cast", "layernorm", "elementwise", "loss", "embed",
               "optimizer", "other"]
# fp8: the E4M3 casts Fp8Gemm runs inside each GEMM call (andrea.cuda.fp8's launchers) are their own class,
# taken out of the GEMM that ran them; the weights' casts after the optimizer stay in "optimizer"
FP8_CASTS = ("k_fp8_amax", "k_fp8_cast", "k_fp8_cast_t", "k_fp8_t_u8", "k_fp8_weights")


def class_flops(s: dict, B: int) -> dict:
    """Nominal flops per step of the classes with a TFLOP/s figure (causal attention: half the T x T)."""
    T, C, L, V = s["T"], s["C"], s["L"], s["V"]
    fwd = 2.0 * B * T * T * C * L
    return {"attention fwd": fwd, "attention bwd": 2.5 * fwd, "gemm": 6.0 * B * T * (12 * L * C * C + V * C)}


def breakdown(s: dict, B: int, precision: str, reps: int = 3) -> dict:
    """ms per step of each kernel class of our engine (eager, CUDA events on the engine's stream
    around every launcher call), the median over ``reps`` steps after one warm-up step."""
    import cupy as cp

    import andrea.cuda.engine as be                      # the launchers the engine's FastOps call
    import andrea.cuda.fp8 as f8m                        # the E4M3 casts inside fp8's GEMM calls
    from andrea.cuda.backend import make_backend
    from andrea.engine.engine import Hyper
    from andrea.engine.model import ModelConfig

    mc = ModelConfig(s["V"], s["C"], s["H"], s["L"], s["T"])
    prec, kw = engine_args(precision)
    eng = make_backend().make_engine(mc, B, precision=prec, cuda_graph=False, **kw)
    print(f"breakdown of ours {precision}: attention {eng.attention}", file=sys.stderr, flush=True)
    eng.init_weights(1)
    rng = np.random.default_rng(0)
    x = rng.integers(0, s["V"], (B, s["T"])).astype(np.int32)
    y = np.roll(x, -1, axis=1)
    pairs = []
    mm = eng.ops._mm
    phase = ["step"]                                      # "update" once the optimizer runs

    def timed(name, fn):
        """fn with its launches between two events, under ``name`` (a callable: the name when it runs)."""
        def w(*a, **k):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(eng.stream)
            fn(*a, **k)
            e1.record(eng.stream)
            pairs.append((name() if callable(name) else name, e0, e1, 0))
        return w

    def timed_mm(*a, tag="gemm", **k):                    # FastOps._mm: one GEMM, named by its tag
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        first = len(pairs)
        e0.record(eng.stream)
        mm(*a, tag=tag, **k)
        e1.record(eng.stream)
        pairs.append(("gemm " + tag, e0, e1, len(pairs) - first))   # the casts it ran are the pairs before it

    cast_class = lambda: "fp8 weight cast" if phase[0] == "update" else "fp8 cast"  # noqa: E731
    ours = {n: timed(OUR_CLASSES[n], getattr(be, n)) for n in OUR_CLASSES if hasattr(be, n)}
    casts = {n: timed(cast_class, getattr(f8m, n)) for n in FP8_CASTS}
    casts["k_loss_bwd_e4m3"] = timed("loss", f8m.k_loss_bwd_e4m3)     # the E4M3 head's loss backward (FP8_HEAD)
    # cuDNN's attention (train.attention): its two calls, in the attention classes like attention.cu's launchers
    dnn = {} if eng.dnn is None else {"forward": timed("attention fwd", eng.dnn.forward),
                                       "backward": timed("attention bwd", eng.dnn.backward)}
    per_rep = []
    with patched(be, **ours), patched(f8m, **casts), patched(eng.ops, _mm=timed_mm), patched(eng.dnn, **dnn):
        for _ in range(reps + 1):
            pairs.clear()
            phase[0] = "step"
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(eng.stream)
            eng.zero_grads()
            eng.micro_step(x, y)
            o0 = cp.cuda.Event()
            o0.record(eng.stream)
            phase[0] = "update"
            eng.apply_update(1, 3.0, 3e-4, 1, Hyper())
            e1.record(eng.stream)
            e1.synchronize()
            out: dict[str, float] = {}
            ms = [cp.cuda.get_elapsed_time(a, b) for _, a, b, _ in pairs]
            for i, (name, _, _, nested) in enumerate(pairs):
                out[name] = out.get(name, 0.0) + ms[i] - sum(ms[i - nested:i])
            out["gemm"] = sum(v for k, v in out.items() if k.startswith("gemm "))
            out["optimizer"] = cp.cuda.get_elapsed_time(o0, e1)    # fp8: with its "fp8 weight cast"
            out["total"] = cp.cuda.get_elapsed_time(e0, e1)
            per_rep.append(out)
    del eng
    release_pool()
    return {k: float(np.median([r.get(k, 0.0) for r in per_rep[1:]])) for k in per_rep[-1]}


GEMMS = ("qkv", "attn-out", "fc", "proj", "head")
PASSES = ("fwd", "dgrad", "wgrad")


def gemm_flops(s: dict, B: int) -> dict:
    """Flops per step of each named GEMM (``FastOps._mm``'s tags): every pass of a linear layer
    costs 2 N Cin Cout, times L for the blocks' (the head once)."""
    N, C, L, V = B * s["T"], s["C"], s["L"], s["V"]
    per = {"qkv": L * 3 * C * C, "attn-out": L * C * C, "fc": L * 4 * C * C, "proj": L * 4 * C * C, "head": V * C}
    return {f"{g} {p}": 2.0 * N * per[g] for g in GEMMS for p in PASSES}


def gemm_shapes(s: dict, B: int) -> dict:
    """(M, N, K, ta, tb, C fp32) of every named GEMM as FastOps calls it (row-major C = op(A) op(B))."""
    N, C, V = B * s["T"], s["C"], s["V"]
    io = {"qkv": (C, 3 * C), "attn-out": (C, C), "fc": (C, 4 * C), "proj": (4 * C, C)}
    out = {}
    for g, (ci, co) in io.items():
        out[f"{g} fwd"] = (N, co, ci, False, False, False)
        out[f"{g} dgrad"] = (N, ci, co, False, True, False)
        out[f"{g} wgrad"] = (ci, co, N, True, False, True)
    out["head fwd"] = (N, V, C, False, True, False)
    out["head dgrad"] = (N, C, V, False, False, False)
    out["head wgrad"] = (V, C, N, True, False, True)
    return out


def sustained_ms(call, reps: int, sustain_ms: float = 0.0) -> float:
    """ms per call of ``call`` (already warmed up) on the current stream, between CUDA events: over
    ``reps`` calls; with ``sustain_ms`` > 0, first back to back for that long, then over as many calls as
    fill half of it (at least ``reps``): the steady state under the card's power limit,
    where a training step runs (an H200 step of 480M B=16 sits at its 700 W cap, its SM clock near 1.6
    GHz against 1.98 idle), not a short burst at full clock."""
    import cupy as cp

    def ms_per_call(n: int) -> float:
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        for _ in range(n):
            call()
        e1.record()
        e1.synchronize()
        return cp.cuda.get_elapsed_time(e0, e1) / n

    n = reps
    if sustain_ms > 0:
        one = max(ms_per_call(3), 1e-3)
        for _ in range(int(sustain_ms / one)):
            call()
        n = max(reps, int(sustain_ms / 2 / one))
    return ms_per_call(n)


def event_ms(fn, reps: int) -> float:
    """ms per call of ``fn`` on the current stream: one untimed call, then ``reps`` between CUDA events."""
    fn()
    return sustained_ms(fn, reps)


def gemm_compare(s: dict, B: int, reps: int = 5) -> dict:
    """ms per call of every named GEMM alone (random bf16 operands) through cuBLAS's cublasGemmEx
    (kernels.Blas, the engine's path before cuBLASLt) and through cuBLASLt (cublaslt.Lt.mm, the
    engine's path now), the head's logits rows contiguous (ld = V) and padded (ld = V rounded up
    to engine.LOGITS_PAD), the other GEMMs' operands contiguous as in the engine."""
    import cupy as cp

    from andrea.cuda.cublaslt import Lt
    from andrea.cuda.engine import LOGITS_PAD
    from andrea.cuda.fp8 import LT_WORKSPACE
    from andrea.cuda.kernels import CUDA_R_16BF, Blas

    blas, lt = Blas(), Lt(cp.zeros(LT_WORKSPACE, dtype=cp.uint8))
    V, Vp = s["V"], -(-s["V"] // LOGITS_PAD) * LOGITS_PAD
    cp.random.seed(0)
    bf16 = lambda r, c: (cp.random.standard_normal((r, c), dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)

    timed = lambda fn: event_ms(fn, reps)  # noqa: E731

    out = {}
    for name, (M, N, K, ta, tb, c32) in gemm_shapes(s, B).items():
        A = bf16(*((K, M) if ta else (M, K)))
        Bm = bf16(*((N, K) if tb else (K, N)))
        C = cp.zeros((M, N), cp.float32 if c32 else cp.uint16)
        beta = 1.0 if c32 else 0.0
        row = {"cublas": timed(lambda: blas.mm(C, A, Bm, ta=ta, tb=tb, beta=beta, lowtype=CUDA_R_16BF)),
               "cublaslt": timed(lambda: lt.mm(C, A, Bm, ta=ta, tb=tb, beta=beta, lowtype=CUDA_R_16BF))}
        if name.startswith("head"):        # as the engine runs it: logits rows of Vp, wte zero-padded to Vp rows
            n_rows = B * s["T"]
            lg = cp.zeros((n_rows, Vp), cp.uint16)
            lg[:, :V] = bf16(n_rows, V)
            wp = cp.zeros((Vp, s["C"]), cp.uint16)
            wp[:V] = bf16(V, s["C"])
            P = lg[:, :V]
            if name == "head fwd":
                fn = lambda: lt.mm(lg, A, wp, tb=True, lowtype=CUDA_R_16BF)
            elif name == "head dgrad":
                fn = lambda: lt.mm(C, lg, wp, lowtype=CUDA_R_16BF)
            else:
                fn = lambda: lt.mm(C, P, Bm, ta=True, beta=1.0, lowtype=CUDA_R_16BF)
            row["cublaslt padded"] = timed(fn)
            del lg, P, wp
        out[name] = row
        del A, Bm, C
    cp.get_default_memory_pool().free_all_blocks()
    return out


def attn_sweep(s: dict, B: int, reps: int = 10) -> dict:
    """ms per call (and TFLOP/s) of one layer's attention forward and backward (bf16, random q, k, v,
    dy) for each implementation and rows-per-block choice of the tensor-core kernels."""
    import cupy as cp

    from andrea.cuda import kernels as K

    C, H, T = s["C"], s["H"], s["T"]
    N = B * T
    bf16 = lambda shape: (cp.random.standard_normal(shape, dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
    cp.random.seed(0)
    qkv, dy = bf16((N, 3 * C)), bf16((N, C))
    y, dqkv = cp.zeros((N, C), cp.uint16), cp.zeros((N, 3 * C), cp.uint16)
    lse, dvec = cp.zeros(B * H * T, cp.float32), cp.zeros(B * H * T, cp.float32)
    fwd_fl = 2.0 * B * T * T * C

    timed = lambda fn: event_ms(fn, reps)  # noqa: E731

    out = {}
    impls = ("mma", "wg") if K.hopper() else ("mma",)
    for im in impls:
        for r in (64, 128) + ((256,) if im == "wg" else ()):
            ms = timed(lambda: K.k_attn_fwd("bf16", y, lse, qkv, B, T, C, H, rows=r, impl=im))
            out[f"{im} fwd r{r}"] = (ms, fwd_fl / ms / 1e9)
    K.k_attn_fwd("bf16", y, lse, qkv, B, T, C, H)
    for im in impls + (("wgds",) if K.hopper() else ()):
        for rq in (64, 128):
            for rk in (64, 128):
                ms = timed(lambda: K.k_attn_bwd("bf16", dqkv, dy, y, lse, dvec, qkv, B, T, C, H, False, rows=(rq, rk),
                                                impl=im))
                out[f"{im} bwd dq r{rq} dkv r{rk}"] = (ms, 2.5 * fwd_fl / ms / 1e9)
    return out


def torch_class(name: str) -> str:
    """Kernel class of a CUDA kernel of the torch anchor, from its name (cuBLAS/cuDNN/flash/Triton)."""
    n = name.lower()
    if any(w in n for w in ("flash", "fmha", "attention", "attn", "efficient", "sdpa")):
        bwd = ("bwd", "bprop", "backward", "dq", "dkv", "dot_do_o")
        return "attention bwd" if any(w in n for w in bwd) else "attention fwd"
    if any(w in n for w in ("gemm", "nvjet", "xmma", "cutlass", "cublas", "triton_tem", "_mm_", "matmul")):
        return "gemm"
    if "adam" in n or "multi_tensor" in n or "foreach" in n or ("norm_" in n and "layer" not in n):
        return "optimizer"
    if "layer_norm" in n or "layernorm" in n:
        return "layernorm"
    if any(w in n for w in ("nll", "log_softmax", "cross_entropy", "logsumexp")):
        return "loss"
    if "embedding" in n or "index" in n or "scatter" in n:
        return "embed"
    if n.startswith("triton") or "elementwise" in n or "vectorized" in n or "reduce" in n:
        return "elementwise"
    return "other"


def build_torch_model(s: dict):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    C, H, L, T, V = s["C"], s["H"], s["L"], s["T"], s["V"]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
            self.qkv = nn.Linear(C, 3 * C, bias=False)
            self.proj = nn.Linear(C, C, bias=False)
            self.fc = nn.Linear(C, 4 * C, bias=False)
            self.fc2 = nn.Linear(4 * C, C, bias=False)

        def forward(self, x):
            Bq, Tq, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            q, k, v = (t.view(Bq, Tq, H, C // H).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).contiguous().view(Bq, Tq, C))
            return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.lnf = nn.LayerNorm(C)

        def forward(self, idx, targets):
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for b in self.blocks:
                x = b(x)
            logits = self.lnf(x) @ self.wte.weight.t()
            return F.cross_entropy(logits.float().view(-1, V), targets.view(-1))

    return GPT()


ANCHORS = ["compile-default", "compile-max-autotune", "compile-reduce-overhead", "eager"]


def bench_torch(s: dict, B: int, steps: int, warmup: int, anchor: str, profile: bool = False) -> dict:
    """The torch anchor ``anchor`` (one of ANCHORS) at batch B; with ``profile`` also the CUDA
    kernel time per kernel class of two more steps (torch.profiler), under "breakdown_ms"."""
    import torch
    import torch._inductor.config as icfg

    icfg.compile_threads = min(16, os.cpu_count() or 1)
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch._dynamo.reset()
    dev = "cuda"
    model = build_torch_model(s).to(dev)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    plain = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    mode = anchor.removeprefix("compile-")
    fwd = model if anchor == "eager" else torch.compile(model, mode=mode)
    graphs = mode in ("reduce-overhead", "max-autotune")
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, s["V"], (B, s["T"]), generator=g).to(dev) for _ in range(4)]
    it = [0]

    def step():
        it[0] += 1
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        x = xs[it[0] % 4]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(x, torch.roll(x, -1, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.time()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    compile_s = time.time() - t0
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    windows = _windows(step, torch.cuda.synchronize, steps)
    res = {"ms": float(np.median(windows)), "windows_ms": windows, "timed_at": [t0, time.time()],
           "peak_bytes": int(torch.cuda.max_memory_reserved()),
           "peak_allocated_bytes": int(torch.cuda.max_memory_allocated()), "warmup_s": compile_s,
           "n_params": sum(p.numel() for p in model.parameters())}
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as tprofile

        with tprofile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        by: dict[str, float] = {}
        for name, (ms_step, _) in kernel_times(prof, 2).items():
            by[torch_class(name)] = by.get(torch_class(name), 0.0) + ms_step
        res["breakdown_ms"] = by
    del model, opt, fwd, xs
    torch.cuda.empty_cache()
    return res


def kernel_times(prof, steps: int) -> dict[str, list]:
    """{kernel name: [device ms a step, calls a step]} of a torch.profiler run over ``steps`` steps (its
    own bookkeeping rows, ProfilerStep and cudaGraph launches, left out)."""
    out: dict[str, list] = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = getattr(ev, "cuda_time_total", 0.0)
        if t and ev.key and not ev.key.startswith(("ProfilerStep", "cudaGraph")):
            a = out.setdefault(ev.key, [0.0, 0.0])
            a[0] += t / 1e3 / steps
            a[1] += ev.count / steps
    return out


def parse_variants(items: list[str], batch: int) -> list[tuple[str, int]]:
    """``name`` -> [(name, batch)]; ``name:8,64`` -> [(name, 8), (name, 64)]. AndreaError (one line, before any
    GPU work) names an item whose batches are not integers of 1 or more, or that has no params/profile/NAME.yaml."""
    out = []
    for it in items:
        name, _, bs = it.partition(":")
        bad = AndreaError(f"--variants {it}: batches after ':' must be integers of 1 or more, e.g. andrea-12m:8,64")
        try:
            got = [(name, int(b)) for b in bs.split(",")] if bs else [(name, batch)]
        except ValueError:
            raise bad from None
        if min(b for _, b in got) < 1:
            raise bad
        if not (ROOT / "params" / "profile" / f"{name}.yaml").is_file():
            raise AndreaError(f"--variants {it}: no profile params/profile/{name}.yaml")
        out += got
    return out


def open_power_log() -> PowerLog | None:
    """A PowerLog (``--power``), or None with one line on stderr where nvidia-smi cannot run."""
    try:
        return PowerLog()
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"--power: nvidia-smi cannot run ({e}); no clock or power figures", file=sys.stderr)
        return None


def power_of(plog: PowerLog, x: dict) -> dict | None:
    """PowerLog's figures over a timed result's own steps (``x["timed_at"]``) and its energy a step (board
    power x step time: at the power limit the ratio of the energies is the ratio of the speeds); None
    where no sample fell in that window."""
    pw = plog.between(*x["timed_at"])
    return pw and {**pw, "joules_per_step": pw["power_w"] * x["ms"] / 1e3}


def power_why(x: dict) -> str:
    """' (61 C, sw power cap 80%)': the temperature and the share of samples each slowdown reason was
    active in, where PowerLog had them."""
    why = [f"{x['temp_c']:.0f} C"] if "temp_c" in x else []
    shares = [f"{k} {v:.0%}" for k, v in x.get("slowdown_share", {}).items() if v > 0]
    why += ["; ".join(shares) if shares else "no slowdown reason"] if "slowdown_share" in x else []
    return f" ({', '.join(why)})" if why else ""


def paired_ratio(ours: dict, anchor: dict) -> float | None:
    """Ours' tokens/s over the anchor's window by window: the median over i of the anchor's window i over ours'
    window i (``_windows``: each engine times the same number of consecutive windows after its warm-up).
    None where a record has no windows_ms or the counts differ."""
    a, o = anchor.get("windows_ms"), ours.get("windows_ms")
    if not a or not o or len(a) != len(o):
        return None
    return float(np.median([x / y for x, y in zip(a, o)]))


def ratio_text(rec: dict, anchors: list[str]) -> str:
    """Ours' tokens/s over each anchor's, then the figures against the fastest compile mode that ``main``
    recorded in ``rec`` (ratio_vs_best, paired_vs_best, mem_vs_best)."""
    parts = [f"{a}:{rec['ours']['tokens_per_s'] / rec[a]['tokens_per_s']:.2f}x" for a in anchors]
    if rec["best_compile"]:
        paired = rec["paired_vs_best"]
        parts.append(f"| best={rec['best_compile']}: {rec['ratio_vs_best']:.2f}x"
                     + (f" (paired windows {paired:.2f}x)" if paired is not None else "")
                     + f" mem {rec['mem_vs_best']:.2f}")
    return " ".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", default=["andrea-12m:8,64", "andrea-120m:8,32", "andrea-480m:8,16"],
                    help="name or name:B1,B2 (batches); plain names use --batch")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--precision", nargs="+", default=["bf16"],
                    choices=["bf16", "fp16", "fp32", "fp8", "fp8:current", "fp8:delayed"],
                    help="ours in each (same run); the first is the one the anchors compare with, and "
                         "every other is also printed as tokens/s over the first's; fp8:delayed is "
                         "train.fp8_scaling=delayed (fp8 and fp8:current: current)")
    ap.add_argument("--anchors", nargs="*", default=ANCHORS[:3], choices=ANCHORS,
                    help="torch anchors to run (none: `--anchors` alone, ours only)")
    ap.add_argument("--json", default=None, help="write all figures here")
    ap.add_argument("--recompute", nargs="*", default=[],
                    help="also time ours (first precision) recomputing these sets instead of engine.RECOMPUTE, "
                         "e.g. ln,gelu gelu none")
    ap.add_argument("--fp8-gelu", nargs="*", default=[],
                    help="also time ours in the first fp8 --precision with these engine.FUSE_GELU_FP8 choices "
                         "(the GEMMs with the GELU epilogue), e.g. fwd,bwd fwd none "
                         "(default set: engine.FUSE_GELU_FP8)")
    ap.add_argument("--fp8-plain", action="store_true",
                    help="also time ours in the first fp8 --precision casting as before session 10: every "
                         "transpose in the backward, k_gelu_bwd then the cast, the weights one by one "
                         "(fp8.SAVE_TRANSPOSES, fp8.DGELU_CAST off, Fp8Gemm.cast_weights_each)")
    ap.add_argument("--fp8-cast-t", nargs="*", default=[], choices=["smem", "warp"],
                    help="also time ours in the first fp8 --precision with each of these transposing casts "
                         "(andrea/cuda/fp8.py CAST_T), same run")
    ap.add_argument("--fp8-flip", nargs="*", default=[], choices=list(FP8_SWITCHES),
                    help="also time ours in the first fp8 --precision with each of these andrea/cuda/fp8.py "
                         "switches flipped, one at a time, same run")
    ap.add_argument("--lt-first", action="store_true",
                    help="also time ours in every --precision with cuBLASLt's first heuristic candidate for every "
                         "GEMM instead of andrea/cuda/lt_choices.json's (cublaslt.USE_CHOICES off), same run")
    ap.add_argument("--attn-sweep", action="store_true",
                    help="also time one layer's attention kernels for every rows-per-block choice")
    ap.add_argument("--attn", default=None, metavar="FWD,BWD",
                    help="on a compute capability 9.0 device, the attention kernels of the forward and the "
                         "backward (mma or wg each, and wgds for the backward: dQ from stored dS; e.g. wg,wgds) "
                         "instead of kernels.ATTN_HOPPER")
    ap.add_argument("--attention", nargs="*", default=[], choices=["cudnn", "kernels"],
                    help="also time ours (each --precision) with train.attention set to each of these (the first "
                         "run takes its default, auto), same run")
    ap.add_argument("--power", action="store_true",
                    help="also record the SM clock and board power over each engine's timed steps (nvidia-smi)")
    ap.add_argument("--autotune-seed", action="store_true",
                    help=f"before max-autotune, place what it tuned on earlier machines of this card ({AUTOTUNE_SEEDS}, "
                         f"{BEST_CONFIG_SEEDS}) in inductor's cache, beside its own (which wins): it then tunes only "
                         "what neither holds")
    ap.add_argument("--breakdown", action="store_true",
                    help="also print per kernel class where our step (and the first compile anchor's) spends its time")
    args = ap.parse_args(argv)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", DEFAULT_CACHE)
    if args.autotune_seed and "compile-max-autotune" in args.anchors:
        cache = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
        placed = seed_all(cache, ROOT, device_name)
        print(f"--autotune-seed: placed {', '.join(placed) or 'nothing (this machine holds all it was kept for it)'}"
              f" in {cache}", file=sys.stderr, flush=True)
    if args.attn:
        from andrea.cuda import kernels as K

        fwd, bwd = args.attn.split(",")
        if fwd not in ("mma", "wg") or bwd not in ("mma", "wg", "wgds"):
            ap.error(f"--attn {args.attn}: expected FWD,BWD: FWD mma or wg, BWD mma, wg or wgds")
        K.ATTN_HOPPER.update(fwd=fwd, bwd=bwd)
    compiled = [a for a in args.anchors if a.startswith("compile-")]
    rows, allres = [], {}
    plog = open_power_log() if args.power else None

    def save(key=None, partial=None) -> None:
        """--json after every measurement (a figure survives a later step's timeout or crash);
        a shape still being measured is marked ``partial``."""
        if args.json:
            done = dict(allres) if partial is None else {**allres, key: {"partial": True, **partial}}
            atomic_write_json(Path(args.json), done)

    for v, B in parse_variants(args.variants, args.batch):
        s = variant_shapes(v)
        tok = B * s["T"]
        key = f"{v}:B{B}"
        prec0, *others = args.precision
        r = {"ours": bench_ours(s, B, args.steps, args.warmup, prec0)}
        save(key, r)
        print(f"{key}: ours {prec0} {r['ours']['ms']:.2f} ms/step, peak {r['ours']['peak_bytes'] / 2 ** 20:.0f} MiB",
              file=sys.stderr, flush=True)
        for p in others:
            r[f"ours-{p}"] = bench_ours(s, B, args.steps, args.warmup, p)
            print(f"{key}: ours {p} {r[f'ours-{p}']['ms']:.2f} ms/step ({r['ours']['ms'] / r[f'ours-{p}']['ms']:.3f}x "
                  f"{prec0}'s tokens/s)", file=sys.stderr, flush=True)
            save(key, r)
        if args.lt_first:
            import andrea.cuda.cublaslt as ltm

            for p in args.precision:
                with patched(ltm, USE_CHOICES=False):
                    r[f"ours-{p}-heuristic"] = x = bench_ours(s, B, args.steps, args.warmup, p)
                print(f"{key}: ours {p} with the heuristic's first GEMM algorithms {x['ms']:.2f} ms/step",
                      file=sys.stderr, flush=True)
                save(key, r)
        for at in args.attention:
            for p in args.precision:
                r[f"ours-{p}-attention-{at}"] = x = bench_ours(s, B, args.steps, args.warmup, p, attention=at)
                print(f"{key}: ours {p} with train.attention={at} {x['ms']:.2f} ms/step, peak "
                      f"{x['peak_bytes'] / 2 ** 20:.0f} MiB", file=sys.stderr, flush=True)
                save(key, r)
        for rc in args.recompute:
            sel = frozenset() if rc == "none" else frozenset(rc.split(","))
            r[f"ours-recompute-{rc}"] = x = bench_ours(s, B, args.steps, args.warmup, prec0, sel)
            print(f"{key}: ours recomputing {rc} {x['ms']:.2f} ms/step, peak {x['peak_bytes'] / 2 ** 20:.0f} MiB",
                  file=sys.stderr, flush=True)
            save(key, r)
        p8 = next((p for p in args.precision if p.startswith("fp8")), None)
        for ch in args.fp8_gelu if p8 else []:
            sel = frozenset() if ch == "none" else frozenset(ch.split(","))
            r[f"ours-{p8}-gelu-{ch}"] = x = bench_ours(s, B, args.steps, args.warmup, p8, fp8_gelu=sel)
            print(f"{key}: ours {p8} with the GELU epilogue on {ch} {x['ms']:.2f} ms/step, peak "
                  f"{x['peak_bytes'] / 2 ** 20:.0f} MiB", file=sys.stderr, flush=True)
            save(key, r)
        if p8 and (args.fp8_plain or args.fp8_cast_t or args.fp8_flip):
            import andrea.cuda.fp8 as k8

            runs = [("plain", "casting as before (--fp8-plain)",
                     [(k8, {"SAVE_TRANSPOSES": False, "DGELU_CAST": False}),
                      (k8.Fp8Gemm, {"cast_weights": k8.Fp8Gemm.cast_weights_each})])] if args.fp8_plain else []
            runs += [(f"cast-{kern}", f"with the {kern} transposing cast", [(k8, {"CAST_T": kern})])
                     for kern in args.fp8_cast_t]
            runs += [(f"flip-{sw}", f"with fp8.{sw} = {not getattr(k8, sw)}", [(k8, {sw: not getattr(k8, sw)})])
                     for sw in args.fp8_flip]
            for suffix, what, switches in runs:
                with ExitStack() as stack:
                    for obj, attrs in switches:
                        stack.enter_context(patched(obj, **attrs))
                    r[f"ours-{p8}-{suffix}"] = x = bench_ours(s, B, args.steps, args.warmup, p8)
                print(f"{key}: ours {p8} {what} {x['ms']:.2f} ms/step, peak {x['peak_bytes'] / 2 ** 20:.0f} MiB",
                      file=sys.stderr, flush=True)
                save(key, r)
        for a in args.anchors:
            prof = args.breakdown and compiled and a == compiled[0]
            r[a] = bench_torch(s, B, args.steps, args.warmup, a, profile=bool(prof))
            print(f"{key}: torch {a} {r[a]['ms']:.2f} ms/step, peak {r[a]['peak_bytes'] / 2 ** 20:.0f} MiB "
                  f"(warm-up incl. compile {r[a]['warmup_s']:.1f} s)", file=sys.stderr, flush=True)
            save(key, r)
        fpt = flops_per_token(s, r["ours"]["n_params"])
        for x in r.values():
            x["tokens_per_s"] = tok / (x["ms"] / 1e3)
            x["mfu"] = fpt * x["tokens_per_s"] / PEAK_BF16
            if plog and (pw := power_of(plog, x)):
                x.update(pw)
        if plog:
            print(f"{key}: SM MHz / board W / J a step over the timed steps: " + ", ".join(
                f"{k} {x['sm_mhz']:.0f} / {x['power_w']:.0f} / {x['joules_per_step']:.2f}{power_why(x)}"
                if "sm_mhz" in x else f"{k} no samples" for k, x in r.items()), file=sys.stderr, flush=True)
        best = max(compiled, key=lambda a: r[a]["tokens_per_s"]) if compiled else None
        allres[key] = {"variant": v, "shapes": s, "batch": B, "best_compile": best, **r}
        if best:
            allres[key]["ratio_vs_best"] = r["ours"]["tokens_per_s"] / r[best]["tokens_per_s"]
            allres[key]["paired_vs_best"] = paired_ratio(r["ours"], r[best])
            allres[key]["mem_vs_best"] = r["ours"]["peak_bytes"] / r[best]["peak_bytes"]
        save()
        for k, x in r.items():
            rows.append((v, B, k, x["ms"], x["tokens_per_s"], x["mfu"], x["peak_bytes"] / 2 ** 20,
                         x.get("warmup_s"), ratio_text(allres[key], args.anchors) if k == "ours" else ""))
    print(f"\n{'variant':<12} {'B':>3} {'engine':<24} {'ms/step':>8} {'tokens/s':>10} {'MFU':>6} {'peak MiB':>9} "
          f"{'warm s':>7}  ours vs anchor (tokens/s)")
    for v, B, k, ms, tps, mfu, mib, ws, rat in rows:
        wtxt = f"{ws:7.1f}" if ws is not None else f"{'':7}"
        print(f"{v:<12} {B:>3} {k:<24} {ms:8.2f} {tps:10.0f} {mfu:6.1%} {mib:9.0f} {wtxt}  {rat}")
    for key, r in allres.items():
        o = r["ours"]
        print(f"{key}: planned {o['planned_bytes']:,} bytes; pool in use {o['pool_used_bytes']:,}; "
              f"plan == pool: {o['planned_bytes'] == o['pool_used_bytes']}")
    if args.breakdown:
        for key, r in allres.items():
            s, B = r["shapes"], r["batch"]
            bd = breakdown(s, B, args.precision[0])
            r["breakdown_ms"] = bd
            theirs = r[compiled[0]].get("breakdown_ms", {}) if compiled else {}
            fl = class_flops(s, B)
            print(f"\n{key} breakdown, ms/step (ours eager with events; "
                  f"{compiled[0] if compiled else 'no anchor'}: torch.profiler kernel time)")
            print(f"  {'class':<16} {'ours':>8} {'TFLOP/s':>8} {'anchor':>8} {'TFLOP/s':>8}")
            for c in CLASS_ORDER:
                o, t = bd.get(c), theirs.get(c)
                if o is None and t is None:
                    continue
                tf = lambda ms: f"{fl[c] / ms / 1e9:8.0f}" if c in fl and ms else f"{'':8}"
                print(f"  {c:<16} {o if o is not None else float('nan'):8.2f} {tf(o)} "
                      f"{t if t is not None else float('nan'):8.2f} {tf(t)}")
            # ours' step time that no class holds: the GPU waiting on the host (batch prep, launches,
            # syncs) or on kernels no launcher wraps; session 9 found 6.6 ms of host work here at 12M B=64
            idle = bd["total"] - sum(bd[c] for c in CLASS_ORDER if c in bd)
            bd["unattributed"] = idle
            print(f"  {'unattributed':<16} {idle:8.2f}")
            if "fp8 weight cast" in bd:
                print(f"  {'(of optimizer: fp8 weight casts':<16} {bd['fp8 weight cast']:8.2f})")
            print(f"  {'total':<16} {bd['total']:8.2f} {'':8} {sum(theirs.values()) if theirs else float('nan'):8.2f}")
            gf = gemm_flops(s, B)
            print(f"  per GEMM (ours, in the step): {'ms':>8} {'TFLOP/s':>8} {'share':>6}")
            for k in gf:                       # a GEMM with a fused epilogue is tagged "fc fwd+gelu"
                tag = next((t[5:] for t in bd if t == "gemm " + k or t.startswith(f"gemm {k}+")), None)
                ms = bd.get(f"gemm {tag}") if tag else None
                if ms:
                    print(f"    {tag:<26} {ms:8.3f} {gf[k] / ms / 1e9:8.0f} {ms / bd['gemm']:6.1%}")
            if args.precision[0] == "bf16":
                cmp = gemm_compare(s, B)
                r["gemm_compare_ms"] = cmp
                print("  each GEMM alone, one call, ms (TFLOP/s): cublasGemmEx | cuBLASLt | cuBLASLt padded as the "
                      "engine runs the head (rows of Vp, wte zero-padded)")
                for k, row in cmp.items():
                    per_call = gf[k] / (1 if k.startswith("head") else s["L"])
                    print(f"    {k:<26} " + " | ".join(f"{ms:7.3f} ({per_call / ms / 1e9:4.0f})" for ms in row.values()))
    if args.attn_sweep:
        for key, r in allres.items():
            sw = attn_sweep(r["shapes"], r["batch"])
            r["attn_sweep"] = sw
            D = r["shapes"]["C"] // r["shapes"]["H"]
            print(f"{key} attention (one layer, D={D}): " + "; ".join(f"{k} {ms:.3f} ms {tf:.0f} TFLOP/s"
                                                                  for k, (ms, tf) in sw.items()))
    for p in args.precision[1:]:
        print(f"\n{p} / {args.precision[0]} tokens/s (same run): " + ", ".join(
            f"{key} {r[f'ours-{p}']['tokens_per_s'] / r['ours']['tokens_per_s']:.3f}x" for key, r in allres.items()))
    save()
    if plog:
        plog.close()
    return 0


if __name__ == "__main__":
    exit_gpu_main(main, "engine_gpu")
