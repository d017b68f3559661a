"""Benchmark: one layer's causal attention, ours beside PyTorch's SDPA kernels, same process.

    PYTHONPATH=. python3 bench/attention_gpu.py --json attn.json

For the issue's shapes (T = 1024; 12M B=8 D=32, 120M B=32 D=64, 480M B=8 D=64), ms per call
(CUDA events, mean of --reps calls after one untimed call) and causal TFLOP/s (forward 2 B T^2 C,
backward 2.5x that) of:
- ours: the mma.sync kernels and, on a compute capability 9.0 device, the wgmma kernels at their
  default rows per block, then every rows choice of the wgmma kernels (andrea.cuda.kernels.ATTN_WG_ROWS),
  and the wgmma backward whose dQ kernel reads the dS tiles the dK/dV kernel stored ("wgds");
- torch's F.scaled_dot_product_attention(is_causal=True) forced to its FLASH_ATTENTION
  (FlashAttention-2) and CUDNN_ATTENTION backends, when torch is installed; backward time = forward
  + backward minus the forward.
Inputs are random bf16 (seeded); ours reads a packed (B*T, 3C) qkv, torch (B, H, T, D) tensors.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))

from andrea.fsutil import atomic_write_json  # noqa: E402
from engine_gpu import event_ms as cupy_ms, exit_gpu_main  # noqa: E402  (one untimed call, then reps between CUDA events)

SHAPES = [("andrea-12m", 8, 384, 12), ("andrea-120m", 32, 768, 12), ("andrea-480m", 8, 1536, 24)]
T = 1024


def random_bf16(shape, fan_in: int | None = None):
    """Standard normal values as bf16 bits (uint16, truncated), from CuPy's global generator; with ``fan_in``
    divided by sqrt(fan_in) first (a weight's scale)."""
    import cupy as cp
    import numpy as np

    x = cp.random.standard_normal(shape, dtype=cp.float32)
    if fan_in is not None:
        x /= np.float32(np.sqrt(fan_in))
    return (x.view(cp.uint32) >> 16).astype(cp.uint16)


def ours(B: int, C: int, H: int, reps: int) -> dict:
    import cupy as cp

    from andrea.cuda import kernels as K

    N = B * T
    cp.random.seed(0)
    qkv, dy = random_bf16((N, 3 * C)), random_bf16((N, C))
    y, dqkv = cp.zeros((N, C), cp.uint16), cp.zeros((N, 3 * C), cp.uint16)
    lse, dvec = cp.zeros(B * H * T, cp.float32), cp.zeros(B * H * T, cp.float32)
    fwd = lambda **k: K.k_attn_fwd("bf16", y, lse, qkv, B, T, C, H, **k)  # noqa: E731
    bwd = lambda **k: K.k_attn_bwd("bf16", dqkv, dy, y, lse, dvec, qkv, B, T, C, H, False, **k)  # noqa: E731
    r = {}
    ds = cp.empty(K.attn_ds_bytes(T, B * H), cp.uint8)            # the "wgds" backward's dS tiles
    for im in ("mma", "wg") if K.hopper() else ("mma",):
        r[f"{im} fwd"] = cupy_ms(lambda: fwd(impl=im), reps)
        r[f"{im} bwd"] = cupy_ms(lambda: bwd(impl=im), reps)
    if K.hopper():
        r["wgds bwd"] = cupy_ms(lambda: bwd(impl="wgds", ds=ds), reps)
        for rq in (64, 128, 256):
            r[f"wg fwd r{rq}"] = cupy_ms(lambda: fwd(rows=rq, impl="wg"), reps)
        for rq in (64, 128):
            for rk in (64, 128):
                r[f"wg bwd dq r{rq} dkv r{rk}"] = cupy_ms(lambda: bwd(rows=(rq, rk), impl="wg"), reps)
                r[f"wgds bwd dq r{rq} dkv r{rk}"] = cupy_ms(lambda: bwd(rows=(rq, rk), impl="wgds", ds=ds), reps)
    return r


def torch_sdpa(B: int, C: int, H: int, reps: int) -> dict:
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return {}
    D = C // H
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    g = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=gen)

    def ms(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / reps

    attn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    r = {}
    for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel(be):
                f = ms(attn)
                fb = ms(lambda: attn().backward(g))
        except RuntimeError as e:   # a backend this build or device lacks
            r[be.name] = f"unavailable: {str(e).splitlines()[0][:80]}"
            continue
        r[f"{be.name} fwd"], r[f"{be.name} bwd"] = f, fb - f
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    out = {}
    for name, B, C, H in SHAPES:
        fl = 2.0 * B * T * T * C
        r = {**ours(B, C, H, args.reps), **torch_sdpa(B, C, H, args.reps)}
        out[f"{name}:B{B}"] = r
        print(f"{name} B={B} (D={C // H}), ms per call (TFLOP/s):")
        for k, ms in r.items():
            if isinstance(ms, str):
                print(f"  {k:<26} {ms}")
            else:
                print(f"  {k:<26} {ms:8.4f} ({(2.5 if 'bwd' in k else 1.0) * fl / ms / 1e9:4.0f})")
        if args.json:
            atomic_write_json(Path(args.json), out)
    return 0


if __name__ == "__main__":
    exit_gpu_main(main, "attention_gpu")
