"""Scratch helper of docs/bench's attention scripts (s49_bwd_split.py, s50_wgt.py): 480M B=8's attention
operands, a cuDNN backward arm, and each arm (a callable that queues one call on the GPU) timed sustained, us a
call over 3 alternating rounds (engine_gpu.sustained_ms, after 3 warm calls each), then each kernel's device
time over 20 calls (torch.profiler / CUPTI). Run from the repo root with bench/ on sys.path, as those scripts
set it."""
import statistics
import sys

import cupy as cp

import andrea.cuda.cudnn_attention as ca
import engine_gpu as eg
from andrea.cuda import kernels as K
from andrea.fsutil import atomic_write_json
from attention_gpu import random_bf16

B, T, C, H = 8, 1024, 1536, 24       # 480M B=8's attention
N = B * T


def inputs():
    """(qkv, dy, y, dqkv, lse2, dvec, ds): random bf16 qkv and dy (seed 0), y and lse2 by attention.cu's
    forward, dqkv, dvec and the "wgds" dS scratch to write into."""
    cp.random.seed(0)
    qkv, dy = random_bf16((N, 3 * C)), random_bf16((N, C))
    y, dqkv = cp.zeros((N, C), cp.uint16), cp.zeros((N, 3 * C), cp.uint16)
    lse2, dvec = cp.zeros(B * H * T, cp.float32), cp.zeros(B * H * T, cp.float32)
    ds = cp.empty(K.attn_ds_bytes(T, B * H), cp.uint8)
    K.k_attn_fwd("bf16", y, lse2, qkv, B, T, C, H)
    return qkv, dy, y, dqkv, lse2, dvec, ds


def cudnn_arm(qkv, dy, dqkv, det: bool):
    """cuDNN's backward (``det``: the engine's deterministic plan, else its default with atomic dQ) into dqkv,
    after its own forward of qkv."""
    with eg.patched(ca, DETERMINISTIC=det):
        att = ca.CudnnAttention(B, T, C, H, room=1 << 40)
    scr = cp.empty(max(att.fwd[1], att.bwd[att.chunk][1], 1), cp.uint8)
    yc, lse = cp.zeros((N, C), cp.uint16), cp.zeros((B * H, T), cp.float32)
    att.forward(yc, lse, qkv, scr)
    return lambda: att.backward(dqkv, dy, yc, lse, qkv, scr)


def time_arms(arms: dict, res: dict, width: int = 16) -> dict:
    """res[name] = {"us_rounds", "us" (their median), "kernels": {kernel: {"us", "calls"}}} for each arm;
    prints each arm's line as it goes."""
    from torch.profiler import ProfilerActivity, profile

    from kernel_profile import device_ops

    for f in arms.values():
        for _ in range(3):
            f()
    cp.cuda.Device().synchronize()
    names = list(arms)
    for n in names:
        res[n] = {"us_rounds": []}
    for r in range(3):
        for n in (names if r % 2 == 0 else names[::-1]):
            res[n]["us_rounds"].append(1e3 * eg.sustained_ms(arms[n], 20, 300.0))
    for n in names:
        res[n]["us"] = statistics.median(res[n]["us_rounds"])
        print(f"{n:{width}s} {res[n]['us']:8.1f} us  rounds {[round(x, 1) for x in res[n]['us_rounds']]}", flush=True)
    for n in names:
        f = arms[n]
        eg.sustained_ms(f, 5, 200.0)
        reps = 20
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                f()
            cp.cuda.Device().synchronize()
        per = {}
        for _, dur, name, _ in device_ops(prof):
            k = name[:90]
            per.setdefault(k, [0.0, 0])
            per[k][0] += dur / 1e3 / reps
            per[k][1] += 1
        res[n]["kernels"] = {k: {"us": v[0], "calls": v[1] / reps} for k, v in per.items()}
        print(n, "; ".join(f"{k[:60]} {v[0]:.1f}us x{v[1] / reps:g}"
                           for k, v in sorted(per.items(), key=lambda kv: -kv[1][0])), flush=True)
    return res


def run(arms: dict, res: dict | None = None, width: int = 16) -> None:
    """The scripts' two modes: ``once`` (argv[1]) runs each arm once (for ncu), ``time OUT.json`` times them
    (time_arms) into OUT.json, with whatever ``res`` already holds."""
    if sys.argv[1] == "once":
        for f in arms.values():
            f()
        cp.cuda.Device().synchronize()
        return
    atomic_write_json(sys.argv[2], time_arms(arms, {} if res is None else res, width))
