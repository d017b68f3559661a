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
Needs torch (the ``oracle`` extra).
"""

from __future__ import annotations

import argparse
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


def child(args) -> None:
    """One measurement in this process; prints one JSON line."""
    import numpy as np
    if args.engine != "numpy":
        import torch  # noqa: F401 - the import footprint is measured before anything is built
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
        import torch

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
    print(json.dumps({"engine": args.engine, "tok_s": args.steps * B * T / dt, "ms_step": 1000 * dt / args.steps,
                      "cpu_ms_step": 1000 * cpu / args.steps,
                      "peak_rss": rss, "import_rss": rss_import, "loss_first": losses[0], "loss_last": losses[-1],
                      "shape": f"V={V} C={mc.d_model} H={mc.n_head} L={mc.n_layer} T={T} B={B}"}))


ENGINES = ("numpy", "torch-foreach", "torch-fused")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="tiny")
    p.add_argument("--vocab", type=int, default=0, help="vocab size (default: 256 + tokenizer.n_morphemes + 1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.engine:
        child(args)
        return 0
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads),
               MKL_NUM_THREADS=str(args.threads))
    runs: dict[str, list[dict]] = {e: [] for e in ENGINES}
    for r in range(args.repeats):
        for eng in ENGINES[r % 3:] + ENGINES[:r % 3]:     # rotate who goes first
            cmd = [sys.executable, __file__, "--engine", eng, "--profile", args.profile, "--vocab", str(args.vocab),
                   "--threads", str(args.threads), "--steps", str(args.steps), "--warmup", str(args.warmup)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stderr, file=sys.stderr)
                return out.returncode
            res = json.loads(out.stdout.strip().splitlines()[-1])
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
