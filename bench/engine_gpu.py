"""Benchmark: the CuPy engine against a nanoGPT-style PyTorch model of the same shapes, same run.

    PYTHONPATH=. python3 bench/engine_gpu.py                       # 12m, 120m, 480m at B=8, T=1024
    PYTHONPATH=. python3 bench/engine_gpu.py --variants andrea-12m --steps 30 --json out.json

For each variant (shapes from params/profile/<variant>.yaml; V = 256 + n_morphemes + 1): ms/step,
tokens/s, MFU and peak GPU memory of
- ours: ``GpuEngine`` in bf16 (fp32 master weights, m, v), CUDA graph of forward+backward;
- torch.compile: the same model in PyTorch (bf16 autocast, F.scaled_dot_product_attention,
  fused AdamW, tied embedding, no biases, GELU tanh), compiled with torch.compile;
- torch eager: that model without compile.
Ratios are tokens/s of ours over each anchor, and peak memory of ours over each anchor.
MFU = (6 N + 12 L C T) x tokens / time / 989.5e12 (the H100/H200 SXM dense bf16 datasheet
rate; N = parameters without the position embedding). Peak memory: ours = bytes the CuPy pool
holds after the step loop (the engine's arena; cuBLAS's own workspace is outside every pool, as
for torch); torch = torch.cuda.max_memory_allocated. Timing: ``--steps``
steps after ``--warmup`` steps (host clock, device drained at both ends), random tokens (seeded),
the median of three timed windows.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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


def _median_window(step, cuda_sync, steps: int, windows: int = 3) -> float:
    """ms per step: host clock around ``steps`` steps with the device drained at both ends
    (our step ends with a read-back anyway; torch's queue is drained by the final sync)."""
    times = []
    for _ in range(windows):
        cuda_sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        cuda_sync()
        times.append((time.perf_counter() - t0) * 1e3 / steps)
    return float(np.median(times))


def bench_ours(s: dict, B: int, steps: int, warmup: int, precision: str) -> dict:
    import cupy as cp

    from andrea.cuda.backend import make_backend
    from andrea.engine.engine import Hyper
    from andrea.engine.model import ModelConfig

    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    mc = ModelConfig(s["V"], s["C"], s["H"], s["L"], s["T"])
    eng = make_backend().make_engine(mc, B, precision=precision, cuda_graph=True)
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
    ms = _median_window(step, cp.cuda.Device().synchronize, steps)
    res = {"ms": ms, "peak_bytes": int(pool.total_bytes()), "planned_bytes": int(eng.planned_bytes),
           "pool_used_bytes": int(pool.used_bytes()), "n_params": eng.n_params, "loss": None}
    res["loss"] = eng.train_step([batches[0]], 3e-4, it[0] + 1, hp).loss
    del eng
    pool.free_all_blocks()
    return res


def breakdown(s: dict, B: int, precision: str, reps: int = 3) -> dict:
    """ms per step spent in each kind of launch of our engine (eager, events on the engine's stream)."""
    import cupy as cp

    import andrea.cuda.engine as be                      # the launchers the engine's FastOps call
    from andrea.cuda.backend import make_backend
    from andrea.engine.engine import Hyper
    from andrea.engine.model import ModelConfig

    mc = ModelConfig(s["V"], s["C"], s["H"], s["L"], s["T"])
    eng = make_backend().make_engine(mc, B, precision=precision, cuda_graph=False)
    eng.init_weights(1)
    rng = np.random.default_rng(0)
    x = rng.integers(0, s["V"], (B, s["T"])).astype(np.int32)
    y = np.roll(x, -1, axis=1)
    pairs = []
    names = ["k_attn_fwd", "k_attn_bwd", "k_layernorm_fwd", "k_layernorm_bwd", "k_gelu_fwd", "k_gelu_bwd",
             "k_residual_add", "k_cast", "k_loss_fwd", "k_loss_bwd", "k_embed_bwd"]
    saved = {n: getattr(be, n) for n in names}
    mm = eng.blas.mm

    def timed(name, fn):
        def w(*a, **k):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(eng.stream)
            fn(*a, **k)
            e1.record(eng.stream)
            pairs.append((name, e0, e1))
        return w

    for n in names:
        setattr(be, n, timed(n, saved[n]))
    eng.blas.mm = timed("gemm (cuBLAS)", mm)
    try:
        for _ in range(reps + 1):
            pairs.clear()
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(eng.stream)
            eng.zero_grads()
            eng.micro_step(x, y)
            o0 = cp.cuda.Event()
            o0.record(eng.stream)
            eng.apply_update(1, 3.0, 3e-4, 1, Hyper())
            e1.record(eng.stream)
            e1.synchronize()
    finally:
        for n in names:
            setattr(be, n, saved[n])
        eng.blas.mm = mm
    out: dict[str, float] = {}
    for name, a, b in pairs:
        out[name] = out.get(name, 0.0) + cp.cuda.get_elapsed_time(a, b)
    out["optimizer (norm + AdamW)"] = cp.cuda.get_elapsed_time(o0, e1)
    out["total (eager, incl. gaps)"] = cp.cuda.get_elapsed_time(e0, e1)
    del eng
    cp.get_default_memory_pool().free_all_blocks()
    return out


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


def bench_torch(s: dict, B: int, steps: int, warmup: int, compiled: bool) -> dict:
    import torch

    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    dev = "cuda"
    model = build_torch_model(s).to(dev)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    plain = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    fwd = torch.compile(model) if compiled else model
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, s["V"], (B, s["T"]), generator=g).to(dev) for _ in range(4)]
    it = [0]

    def step():
        it[0] += 1
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
    ms = _median_window(step, torch.cuda.synchronize, steps)
    res = {"ms": ms, "peak_bytes": int(torch.cuda.max_memory_allocated()), "warmup_s": compile_s,
           "n_params": sum(p.numel() for p in model.parameters())}
    del model, opt, fwd, xs
    torch.cuda.empty_cache()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", default=["andrea-12m", "andrea-120m", "andrea-480m"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--precision", nargs="+", default=["bf16"], choices=["bf16", "fp16", "fp32", "fp8"],
                    help="ours in each (same run); the first is the one the anchors compare with, and "
                         "every other is also printed as tokens/s over the first's")
    ap.add_argument("--anchors", nargs="*", default=["compile", "eager"], choices=["compile", "eager"],
                    help="torch anchors to run (none: `--anchors` alone, ours only)")
    ap.add_argument("--json", default=None, help="write all figures here")
    ap.add_argument("--breakdown", action="store_true", help="also print where our step spends its time")
    args = ap.parse_args(argv)
    rows, allres = [], {}
    for v in args.variants:
        s = variant_shapes(v)
        B, T = args.batch, s["T"]
        tok = B * T
        prec0, *others = args.precision
        r = {"ours": bench_ours(s, B, args.steps, args.warmup, prec0)}
        print(f"{v}: ours {prec0} {r['ours']['ms']:.2f} ms/step", file=sys.stderr, flush=True)
        for p in others:
            r[f"ours-{p}"] = bench_ours(s, B, args.steps, args.warmup, p)
            print(f"{v}: ours {p} {r[f'ours-{p}']['ms']:.2f} ms/step ({r['ours']['ms'] / r[f'ours-{p}']['ms']:.3f}x "
                  f"{prec0}'s tokens/s)", file=sys.stderr, flush=True)
        for a in args.anchors:
            r[a] = bench_torch(s, B, args.steps, args.warmup, a == "compile")
            print(f"{v}: torch {a} {r[a]['ms']:.2f} ms/step", file=sys.stderr, flush=True)
        fpt = flops_per_token(s, r["ours"]["n_params"])
        for k, x in r.items():
            x["tokens_per_s"] = tok / (x["ms"] / 1e3)
            x["mfu"] = fpt * x["tokens_per_s"] / PEAK_BF16
        allres[v] = {"shapes": s, "batch": B, **r}
        for k, x in r.items():
            ratio = {a: r["ours"]["tokens_per_s"] / r[a]["tokens_per_s"] for a in args.anchors}
            mem = {a: r["ours"]["peak_bytes"] / r[a]["peak_bytes"] for a in args.anchors}
            rows.append((v, k, x["ms"], x["tokens_per_s"], x["mfu"], x["peak_bytes"] / 2 ** 20,
                         " ".join(f"{a}:{ratio[a]:.2f}x/mem {mem[a]:.2f}" for a in args.anchors) if k == "ours" else ""))
    print(f"\n{'variant':<12} {'engine':<8} {'ms/step':>8} {'tokens/s':>10} {'MFU':>6} {'peak MiB':>9}  ours vs anchor")
    for v, k, ms, tps, mfu, mib, rat in rows:
        print(f"{v:<12} {k:<8} {ms:8.2f} {tps:10.0f} {mfu:6.1%} {mib:9.0f}  {rat}")
    for v, r in allres.items():
        o = r["ours"]
        print(f"{v}: planned {o['planned_bytes']:,} bytes; pool in use {o['pool_used_bytes']:,}; "
              f"plan == pool: {o['planned_bytes'] == o['pool_used_bytes']}")
    if args.breakdown:
        for v in args.variants:
            bd = breakdown(variant_shapes(v), args.batch, args.precision[0])
            allres[v]["breakdown_ms"] = bd
            print(f"{v} breakdown (ms/step): " + ", ".join(f"{k} {t:.2f}" for k, t in
                                                          sorted(bd.items(), key=lambda kv: -kv[1])))
    for p in args.precision[1:]:
        print(f"\n{p} / {args.precision[0]} tokens/s (same run): " + ", ".join(
            f"{v} {r[f'ours-{p}']['tokens_per_s'] / r['ours']['tokens_per_s']:.3f}x" for v, r in allres.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(allres, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
