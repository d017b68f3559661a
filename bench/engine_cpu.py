"""CPU benchmark of the NumPy engine against a PyTorch model of the same shapes (the anchor),
same thread count, same run: tokens/s of full training steps (forward, backward, clip,
AdamW) and memory, each side in its own child process so RSS is its own.

    python bench/engine_cpu.py                      # tiny profile shapes, 2 threads
    python bench/engine_cpu.py --threads 1 --steps 20 --repeats 5 --profile tiny

The anchor is andrea.engine.oracle_torch.TorchGPT (F.scaled_dot_product_attention,
F.layer_norm, autograd) in eager mode, float32, run twice per repeat: with
torch.optim.AdamW(foreach=True) and AdamW(fused=True); the one with the higher median
tokens/s is THE anchor the ratios use (both are printed). The engine is
andrea.engine.engine.Engine on the NumPy backend. Each repeat runs the three back to back
(the order rotates) so load from other processes hits all; the headline is the median of
the per-repeat ratios ours/anchor (>= 1.0 means the engine is at least as fast), which one
lucky run cannot move, beside best-vs-best. CPU time per step (process_time) is printed beside
wall time: on a shared machine it is the steadier figure (with --threads 1 it is the step's
own cost, whatever else runs).

Memory: "import" is the child's RSS after importing its libraries (numpy, numba + andrea, or torch
as well) and before building anything; "peak" its peak RSS after the steps; "peak - import" is what
the model, its buffers and the steps added, the figure the memory ratio compares (the import
footprint of torch alone is ~4x NumPy's and says nothing about the engine).

``--breakdown K``: after the repeats, one more child each for the engine and the anchor, at 1 thread
whatever ``--threads`` says (with more, the engine's ops run on several threads at once and their
times overlap), times K steps by class, side by side (``CLASSES``). The engine's: each op's wall time
(the outermost op of the recipe, ``ops_cpu``'s functions), with the time of its BLAS calls (np.matmul)
moved to "matmul" except inside the attention ops; the step's time outside every op is "other". The
anchor's: torch.profiler's self CPU time of each aten op over the same steps, classed by its name
(``torch_class``; the fused attention op holds its own GEMMs, so attention is compared whole on both
sides); what the profiler adds shows in its step time, printed beside. Both are instrumented runs:
their step times sit above the headline's.
Needs torch (the ``oracle`` extra).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss_now() -> int:
    """This process's resident set now, in bytes (Linux /proc; the peak where that is absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --breakdown's classes, in print order
CLASSES = ("matmul (BLAS)", "attention", "GELU", "loss (softmax, cross-entropy)", "LayerNorm + residual",
           "optimizer (norm, clip, AdamW)", "embedding", "other")
ATTENTION_OPS = frozenset({"attn_forward", "attn_backward"})
# the engine's ops (andrea.engine.ops_cpu) -> the class of the time they spend outside np.matmul
OURS_CLASS = {
    "attn_forward": "attention", "attn_backward": "attention",
    "mlp_forward": "GELU", "mlp_backward": "GELU", "gelu_forward": "GELU",
    "loss_forward": "loss (softmax, cross-entropy)", "loss_backward": "loss (softmax, cross-entropy)",
    "layernorm_forward": "LayerNorm + residual", "layernorm_backward": "LayerNorm + residual",
    "residual_layernorm_forward": "LayerNorm + residual", "layernorm_residual_backward": "LayerNorm + residual",
    "residual_add_forward": "LayerNorm + residual", "residual_add_backward": "LayerNorm + residual",
    "adamw": "optimizer (norm, clip, AdamW)", "grad_norm_partial": "optimizer (norm, clip, AdamW)",
    "grad_norm_final": "optimizer (norm, clip, AdamW)", "grad_scale": "optimizer (norm, clip, AdamW)",
    "embed_forward": "embedding", "embed_backward": "embedding",
}
# the anchor's aten ops by name: GEMMs by their exact name, "aten::add" (the residual adds and the sums of
# their gradients) with the LayerNorms, the rest by the first key their lower-cased name contains
TORCH_MATMUL = frozenset({"aten::mm", "aten::addmm", "aten::bmm"})
TORCH_CLASSES = (
    (("flash_attention", "scaled_dot_product", "efficient_attention"), "attention"),
    (("gelu",), "GELU"),
    (("softmax", "nll_loss", "cross_entropy"), "loss (softmax, cross-entropy)"),
    (("layer_norm",), "LayerNorm + residual"),
    (("adam", "linalg_vector_norm", "foreach", "clip_grad", "aten::mul_"), "optimizer (norm, clip, AdamW)"),
    (("embedding", "index"), "embedding"),
)


def torch_class(name: str) -> str:
    """The class of one aten op's self time (``TORCH_MATMUL``, ``TORCH_CLASSES``), else "other"."""
    n = name.lower()
    if n in TORCH_MATMUL:
        return "matmul (BLAS)"
    if n == "aten::add":
        return "LayerNorm + residual"
    return next((cls for keys, cls in TORCH_CLASSES if any(k in n for k in keys)), "other")


def ours_breakdown(ops, step, steps: int) -> dict:
    """ms a step of ``steps`` calls of step(i) by class, the engine's ops (the functions of module ``ops``)
    and np.matmul timed as they run (an op called from inside another counts toward the outer one)."""
    import numpy as np

    acc = dict.fromkeys(CLASSES, 0.0)
    state = {"op": None, "mm": 0.0}
    matmul = np.matmul

    def timed_matmul(*a, **k):
        t = time.perf_counter()
        try:
            return matmul(*a, **k)
        finally:
            state["mm"] += time.perf_counter() - t

    def wrap(name, fn):
        def op(*a, **k):
            if state["op"] is not None:             # inside another op: its time is the outer op's
                return fn(*a, **k)
            state["op"], state["mm"], t = name, 0.0, time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt, mm = time.perf_counter() - t, state["mm"]
                state["op"] = None
                if name in ATTENTION_OPS:
                    acc["attention"] += dt
                else:
                    acc["matmul (BLAS)"] += mm
                    acc[OURS_CLASS.get(name, "other")] += dt - mm
        return op

    saved = {n: getattr(ops, n) for n in OURS_CLASS.keys() | _linear_ops(ops) if hasattr(ops, n)}
    np.matmul = timed_matmul
    for n, fn in saved.items():
        setattr(ops, n, wrap(n, fn))
    try:
        wall = _wall(step, steps)
    finally:
        np.matmul = matmul
        for n, fn in saved.items():
            setattr(ops, n, fn)
    return _per_step(acc, wall, steps)


def _wall(step, steps: int) -> float:
    """Seconds of ``steps`` calls of step(i)."""
    t0 = time.perf_counter()
    for i in range(steps):
        step(i)
    return time.perf_counter() - t0


def _per_step(acc: dict, wall: float, steps: int) -> dict:
    """A breakdown: the step's ms and each class's, "other" taking the wall time no class holds."""
    acc["other"] += wall - sum(acc.values())
    return {"step_ms": 1000 * wall / steps, "classes": {c: 1000 * v / steps for c, v in acc.items()}}


def _linear_ops(ops) -> set:
    """The recipe's linear layers (attn_qkv_*, attn_out_*): their GEMMs are matmul, the rest "other"."""
    return {n for n in dir(ops) if n.startswith(("attn_qkv_", "attn_out_"))}


def torch_breakdown(step, steps: int) -> dict:
    """ms a step of ``steps`` calls of step(i) by class, from torch.profiler's self CPU time per aten op."""
    from torch.profiler import ProfilerActivity, profile

    acc = dict.fromkeys(CLASSES, 0.0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = _wall(step, steps)
    for ev in prof.key_averages():
        if ev.key.startswith("aten::"):
            acc[torch_class(ev.key)] += ev.self_cpu_time_total / 1e6
    return _per_step(acc, wall, steps)


def child(args) -> None:
    """One measurement in this process; prints one JSON line."""
    import numpy as np
    if args.engine != "numpy":
        import torch  # the import footprint is measured before anything is built
    import threadpoolctl  # noqa: F401

    import andrea.engine.backend  # noqa: F401 - the NumPy backend's ops and their library (numba)
    import andrea.engine.engine  # noqa: F401
    from andrea.config import load_config
    from andrea.engine.engine import Hyper
    from andrea.engine.model import ModelConfig
    from andrea.settings import Settings
    rss_import = _rss_now()

    cfg = load_config(ROOT / "params.yaml", args.profile)
    st = Settings.from_dict(cfg)
    V = args.vocab or 256 + int(cfg["tokenizer"]["n_morphemes"]) + 1
    mc = ModelConfig.of(st.model, V)
    B, T = st.train.batch_size, mc.context
    hp = Hyper.of(st.train)
    lr = st.train.lr
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(4):
        x = rng.integers(0, V, (B, T + 1)).astype(np.int32)
        batches.append((x[:, :-1].copy(), x[:, 1:].copy()))
    if args.engine == "numpy":
        from andrea.engine.backend import NumpyBackend
        from andrea.engine.engine import Engine

        eng = Engine(mc, B, NumpyBackend())
        eng.init_weights(0)

        def step(i):
            return eng.train_step([batches[i % 4]], lr, i + 1, hp).loss
    else:
        from andrea.engine.oracle_torch import TorchGPT

        torch.set_num_threads(args.threads)
        model = TorchGPT(mc)
        from andrea.engine.engine import init_params

        model.load_flat(init_params(mc, 0))
        kw = {"fused": True} if args.engine == "torch-fused" else {"foreach": True}
        opt = model.adamw(lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, **kw)
        tb = [(torch.from_numpy(x).long(), torch.from_numpy(y).long()) for x, y in batches]

        def step(i):
            x, y = tb[i % 4]
            _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), hp.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()
    for i in range(args.warmup):
        step(i)
    t0, c0 = time.perf_counter(), time.process_time()
    losses = [step(args.warmup + i) for i in range(args.steps)]
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    res = {"engine": args.engine, "tok_s": args.steps * B * T / dt, "ms_step": 1000 * dt / args.steps,
           "cpu_ms_step": 1000 * cpu / args.steps,
           "peak_rss": rss, "import_rss": rss_import, "loss_first": losses[0], "loss_last": losses[-1],
           "shape": f"V={V} C={mc.d_model} H={mc.n_head} L={mc.n_layer} T={T} B={B}"}
    if args.breakdown:
        after = args.warmup + args.steps

        def later(i):
            return step(after + i)
        res["breakdown"] = (ours_breakdown(eng.ops, later, args.breakdown) if args.engine == "numpy"
                            else torch_breakdown(later, args.breakdown))
    print(json.dumps(res))


ENGINES = ("numpy", "torch-foreach", "torch-fused")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="tiny")
    p.add_argument("--vocab", type=int, default=0, help="vocab size (default: 256 + tokenizer.n_morphemes + 1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--breakdown", type=int, default=0, metavar="K",
                   help="also K steps of the engine and the anchor at 1 thread, timed by class")
    p.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.engine:
        child(args)             # bad input (a profile, a vocab): exit_main's one line and 2; the parent adds none
        return 0
    if importlib.util.find_spec("torch") is None:
        print("engine_cpu: error: the anchor needs torch, which this Python cannot import "
              "(pip install -e '.[oracle]', or torch's CPU build)", file=sys.stderr)
        return 2
    try:
        return run_all(args)
    except ChildFailed as e:
        print(e, file=sys.stderr)
        return e.code


def run_all(args) -> int:
    runs: dict[str, list[dict]] = {e: [] for e in ENGINES}
    for r in range(args.repeats):
        for eng in ENGINES[r % 3:] + ENGINES[:r % 3]:     # rotate who goes first
            res = measure(eng, args, args.threads)
            print(f"  run {r + 1} {eng:13s} {res['tok_s']:10,.0f} tok/s {res['ms_step']:8.1f} ms/step "
                  f"{res['cpu_ms_step']:8.1f} cpu-ms/step  RSS import {res['import_rss'] / 2**20:6.1f} "
                  f"peak {res['peak_rss'] / 2**20:6.1f} MiB  loss {res['loss_first']:.3f} -> {res['loss_last']:.3f}")
            runs[eng].append(res)
    med = lambda eng, k: statistics.median(x[k] for x in runs[eng])  # noqa: E731
    anchor = max(ENGINES[1:], key=lambda e: med(e, "tok_s"))
    ours = runs["numpy"]
    print(f"\nengine_cpu ({ours[0]['shape']}, {args.threads} threads, {args.repeats} repeats x {args.steps} steps; "
          f"medians, best in brackets)")
    print(f"{'':14s} {'tok/s':>16s} {'cpu-ms/step':>17s} {'import MiB':>11s} {'peak MiB':>9s} {'peak-import':>12s}")
    for eng in ENGINES:
        best, best_cpu = max(x["tok_s"] for x in runs[eng]), min(x["cpu_ms_step"] for x in runs[eng])
        added = med(eng, "peak_rss") - med(eng, "import_rss")
        tag = "andrea" if eng == "numpy" else eng + (" *" if eng == anchor else "")
        print(f"{tag:14s} {med(eng, 'tok_s'):7,.0f} [{best:6,.0f}] {med(eng, 'cpu_ms_step'):8.1f} [{best_cpu:6.1f}] "
              f"{med(eng, 'import_rss') / 2**20:11.1f} {med(eng, 'peak_rss') / 2**20:9.1f} {added / 2**20:12.1f}")
    pairs = [o["tok_s"] / a["tok_s"] for o, a in zip(ours, runs[anchor])]     # same repeat, back to back
    cpus = [a["cpu_ms_step"] / o["cpu_ms_step"] for o, a in zip(ours, runs[anchor])]
    mem = ((med("numpy", "peak_rss") - med("numpy", "import_rss"))
           / (med(anchor, "peak_rss") - med(anchor, "import_rss")))
    print(f"anchor (*): {anchor} (the faster torch optimizer here, by median tokens/s)")
    print(f"ratio andrea/anchor tokens/s: median of paired repeats {statistics.median(pairs):.2f}x "
          f"(range {min(pairs):.2f}-{max(pairs):.2f}x over {len(pairs)}; target >= 1.0x), best vs best "
          f"{max(x['tok_s'] for x in ours) / max(x['tok_s'] for x in runs[anchor]):.2f}x")
    print(f"CPU time per step anchor/andrea: median {statistics.median(cpus):.2f}x (>1 = andrea cheaper)")
    print(f"memory: peak RSS {med('numpy', 'peak_rss') / med(anchor, 'peak_rss'):.2f}x; "
          f"peak minus import footprint {mem:.2f}x (andrea/anchor: < 1 = andrea smaller)")
    if args.breakdown:
        print_breakdown(measure("numpy", args, 1, args.breakdown)["breakdown"],
                        measure(anchor, args, 1, args.breakdown)["breakdown"], anchor, args.breakdown)
    return 0


class ChildFailed(Exception):
    """A child that failed: its message and the exit code the bench returns (2: bad input, 1: a crash)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def measure(eng: str, args, threads: int, breakdown: int = 0) -> dict:
    """One child's JSON line: ``eng`` on ``threads`` threads (BLAS and torch's), with ``breakdown`` steps by class."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads))
    cmd = [sys.executable, __file__, "--engine", eng, "--profile", args.profile, "--vocab", str(args.vocab),
           "--threads", str(threads), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--breakdown", str(breakdown)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode == 2:                         # the child's own one-line refusal
        raise ChildFailed(out.stderr.strip(), 2)
    if out.returncode != 0:
        print(out.stderr, file=sys.stderr)
        raise ChildFailed(f"engine_cpu: the {eng} child exited with {out.returncode}", 1)
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_breakdown(ours: dict, anchor: dict, name: str, steps: int) -> None:
    """The two breakdowns side by side, ms a step by class (``CLASSES``)."""
    print(f"\nbreakdown, 1 thread, ms a step over {steps} instrumented steps (andrea: each op's wall time, its "
          f"np.matmul calls as matmul outside attention; {name}: torch.profiler self CPU time by aten op)")
    print(f"{'':30s} {'andrea':>8s} {'anchor':>8s} {'andrea/anchor':>14s}")
    for c in CLASSES:
        a, b = ours["classes"][c], anchor["classes"][c]
        ratio = f"{a / b:14.2f}" if b > 0.05 else f"{'-':>14s}"
        print(f"{c:30s} {a:8.2f} {b:8.2f} {ratio}")
    print(f"{'step (instrumented)':30s} {ours['step_ms']:8.2f} {anchor['step_ms']:8.2f} "
          f"{ours['step_ms'] / anchor['step_ms']:14.2f}")


if __name__ == "__main__":
    from andrea.errors import exit_main

    exit_main(main, "engine_cpu")
