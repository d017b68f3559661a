"""Scratch (session 49, docs/bench/s49.md): one attention backward's kernels at 480M B=8 (B 8, T 1024, C 1536,
24 heads), attention.cu's ("wgds" at two row choices, "wg"; "wgdq" too with s49_scratch_wgdq.diff applied)
against cuDNN's deterministic and default backward: sustained us a call (3 alternating rounds,
engine_gpu.sustained_ms) and each kernel's device time (torch.profiler / CUPTI, 20 calls).

    PYTHONPATH=/tmp/cfe:/tmp/deps:. python3 docs/bench/s49_bwd_split.py time OUT.json   # from the repo root, on the GPU
    ncu ... python3 docs/bench/s49_bwd_split.py once                                   # each arm once (for ncu)
"""
import json
import statistics
import sys

sys.path.insert(0, ".")
sys.path.insert(0, "bench")
import cupy as cp  # noqa: E402

import engine_gpu as eg  # noqa: E402
from attention_gpu import random_bf16  # noqa: E402
from andrea.cuda import kernels as K  # noqa: E402
import andrea.cuda.cudnn_attention as ca  # noqa: E402

B, T, C, H = 8, 1024, 1536, 24
N = B * T
cp.random.seed(0)
qkv, dy = random_bf16((N, 3 * C)), random_bf16((N, C))
y, dqkv = cp.zeros((N, C), cp.uint16), cp.zeros((N, 3 * C), cp.uint16)
lse2, dvec = cp.zeros(B * H * T, cp.float32), cp.zeros(B * H * T, cp.float32)
ds = cp.empty(K.attn_ds_bytes(T, B * H), cp.uint8)
K.k_attn_fwd("bf16", y, lse2, qkv, B, T, C, H)
arms = {}
for rows in ((128, 64), (128, 128)):
    arms[f"wgds {rows[0]}/{rows[1]}"] = (lambda rows=rows: K.k_attn_bwd(
        "bf16", dqkv, dy, y, lse2, dvec, qkv, B, T, C, H, False, rows=rows, impl="wgds", ds=ds))
dqs = cp.empty(K.attn_dq_bytes(B, T, C, H), cp.uint8) if hasattr(K, "attn_dq_bytes") else None
for r in (64, 128) if dqs is not None else ():
    arms[f"wgdq {r}"] = (lambda r=r: K.k_attn_bwd("bf16", dqkv, dy, y, lse2, dvec, qkv, B, T, C, H, False,
                                                 rows=(None, r), impl="wgdq", ds=dqs))
arms["wg 128/64"] = lambda: K.k_attn_bwd("bf16", dqkv, dy, y, lse2, dvec, qkv, B, T, C, H, False,
                                         rows=(128, 64), impl="wg")
yc, lse = cp.zeros((N, C), cp.uint16), cp.zeros((B * H, T), cp.float32)
for name, det in (("cudnn det", True), ("cudnn default", False)):
    with eg.patched(ca, DETERMINISTIC=det):
        att = ca.CudnnAttention(B, T, C, H, room=1 << 40)
    scr = cp.empty(max(att.fwd[1], att.bwd[att.chunk][1], 1), cp.uint8)
    if det:
        att.forward(yc, lse, qkv, scr)
    arms[name] = (lambda att=att, scr=scr: att.backward(dqkv, dy, yc, lse, qkv, scr))

if sys.argv[1] == "once":
    for f in arms.values():
        f()
    cp.cuda.Device().synchronize()
    sys.exit(0)

for f in arms.values():
    for _ in range(3):
        f()
cp.cuda.Device().synchronize()
res = {n: {"us_rounds": []} for n in arms}
names = list(arms)
for r in range(3):
    for n in (names if r % 2 == 0 else names[::-1]):
        res[n]["us_rounds"].append(1e3 * eg.sustained_ms(arms[n], 20, 300.0))
for n in names:
    res[n]["us"] = statistics.median(res[n]["us_rounds"])
    print(f"{n:16s} {res[n]['us']:8.1f} us  rounds {[round(x, 1) for x in res[n]['us_rounds']]}", flush=True)

from torch.profiler import ProfilerActivity, profile  # noqa: E402
from kernel_profile import device_ops  # noqa: E402

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
    print(n, "; ".join(f"{k[:60]} {v[0]:.1f}us x{v[1] / reps:g}" for k, v in sorted(per.items(), key=lambda kv: -kv[1][0])),
          flush=True)
json.dump(res, open(sys.argv[2], "w"), indent=1)
