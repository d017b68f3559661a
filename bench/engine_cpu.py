"""CPU benchmark of the NumPy engine against a PyTorch model of the same shapes (the anchor),
same thread count, same run: tokens/s of full training steps (forward, backward, clip,
AdamW) and peak RSS, each side in its own child process so RSS is its own.

    python bench/engine_cpu.py                      # tiny profile shapes, 2 threads
    python bench/engine_cpu.py --threads 1 --steps 20 --repeats 5 --profile tiny

The anchor is andrea.engine.oracle_torch.TorchGPT (F.scaled_dot_product_attention,
F.layer_norm, autograd, torch.optim.AdamW foreach) in eager mode, float32. The engine
is andrea.engine.engine.Engine on the NumPy backend. Each repeat runs both back to back
(who goes first alternates) so load from other processes hits both; the best run of each is
reported and the ratio ours/torch printed (>= 1.0 means the engine is at least as fast), and
beside it the median of the per-repeat ratios, which one lucky run cannot move. CPU time per
step (process_time) is printed beside wall time: on a shared machine it is the steadier
figure (with --threads 1 it is the step's own cost, whatever else runs).
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


def child(args) -> None:
    """One measurement in this process; prints one JSON line."""
    import numpy as np

    from andrea.config import load_config
    from andrea.engine.engine import Hyper
    from andrea.engine.model import ModelConfig
    from andrea.settings import Settings

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
        opt = model.adamw(lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay)
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
                      "peak_rss": rss, "loss_first": losses[0], "loss_last": losses[-1],
                      "shape": f"V={V} C={mc.d_model} H={mc.n_head} L={mc.n_layer} T={T} B={B}"}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="tiny")
    p.add_argument("--vocab", type=int, default=0, help="vocab size (default: 256 + tokenizer.n_morphemes + 1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--engine", choices=["numpy", "torch"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.engine:
        child(args)
        return 0
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads),
               MKL_NUM_THREADS=str(args.threads))
    best: dict[str, dict] = {}
    pairs: list[float] = []                        # ours / torch tok/s, per repeat (back to back)
    for r in range(args.repeats):
        got = {}
        for eng in (("numpy", "torch") if r % 2 == 0 else ("torch", "numpy")):   # alternate who goes first
            cmd = [sys.executable, __file__, "--engine", eng, "--profile", args.profile, "--vocab", str(args.vocab),
                   "--threads", str(args.threads), "--steps", str(args.steps), "--warmup", str(args.warmup)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stderr, file=sys.stderr)
                return out.returncode
            res = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"  run {r + 1} {eng:6s} {res['tok_s']:10,.0f} tok/s {res['ms_step']:8.1f} ms/step "
                  f"{res['cpu_ms_step']:8.1f} cpu-ms/step "
                  f"peak RSS {res['peak_rss'] / 2**20:7.1f} MiB  loss {res['loss_first']:.3f} -> {res['loss_last']:.3f}")
            got[eng] = res["tok_s"]
            if eng not in best or res["tok_s"] > best[eng]["tok_s"]:
                best[eng] = res
            if eng + "_cpu" not in best or res["cpu_ms_step"] < best[eng + "_cpu"]["cpu_ms_step"]:
                best[eng + "_cpu"] = res
        pairs.append(got["numpy"] / got["torch"])
    a, t = best["numpy"], best["torch"]
    print(f"\nengine_cpu ({a['shape']}, {args.threads} threads, best of {args.repeats} x {args.steps} steps)")
    ac, tcpu = best["numpy_cpu"], best["torch_cpu"]
    print(f"{'':8s} {'tok/s':>10s} {'ms/step':>9s} {'cpu-ms/step':>12s} {'peak RSS MiB':>13s}")
    for name, r, rc in (("andrea", a, ac), ("torch", t, tcpu)):
        print(f"{name:8s} {r['tok_s']:10,.0f} {r['ms_step']:9.1f} {rc['cpu_ms_step']:12.1f} {r['peak_rss'] / 2**20:13.1f}")
    print(f"ratio andrea/torch: tokens/s {a['tok_s'] / t['tok_s']:.2f}x best vs best (target >= 1.0x); "
          f"CPU time per step {tcpu['cpu_ms_step'] / ac['cpu_ms_step']:.2f}x (torch/andrea: >1 = andrea cheaper); "
          f"peak RSS {a['peak_rss'] / t['peak_rss']:.2f}x")
    print(f"paired tokens/s ratios (each repeat's two runs back to back): median {statistics.median(pairs):.2f}x, "
          f"range {min(pairs):.2f}-{max(pairs):.2f}x over {len(pairs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
