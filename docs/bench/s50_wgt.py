"""Scratch (session 50, docs/bench/s50.md): the "wgt" backward (attention.cu's dK/dV kernel fed by TMA through
a ring of ATTN_NS stages) against "wgds" (the same kernel with cp.async double buffers) and cuDNN's deterministic
backward at 480M B=8 (B 8, T 1024, C 1536, 24 heads): first the bytes (wgt's dqkv and dS tiles must equal
wgds's), then sustained us a call (3 alternating rounds, engine_gpu.sustained_ms) and each kernel's device
time (torch.profiler / CUPTI, 20 calls). S50_NS="3 6" also builds and times those ring depths (loader defines) beside the default 4.

The "wgt" kernel is not in the tree: apply docs/bench/s50_scratch_wgt.diff (or s50_scratch_wgt_ring.diff, the
first form) to 9dba32f first.

    git apply docs/bench/s50_scratch_wgt.diff
    PYTHONPATH=/tmp/cfe:/tmp/deps:. python3 docs/bench/s50_wgt.py time OUT.json   # from the repo root, on the GPU
    ncu ... python3 docs/bench/s50_wgt.py once                                   # each arm once (for ncu)
"""
import json
import os
import statistics
import sys

sys.path.insert(0, ".")
sys.path.insert(0, "bench")
import cupy as cp  # noqa: E402

import engine_gpu as eg  # noqa: E402
from attention_gpu import random_bf16  # noqa: E402
from andrea.cuda import kernels as K, loader  # noqa: E402
import andrea.cuda.cudnn_attention as ca  # noqa: E402

B, T, C, H = 8, 1024, 1536, 24
N = B * T
cp.random.seed(0)
qkv, dy = random_bf16((N, 3 * C)), random_bf16((N, C))
y, dqkv = cp.zeros((N, C), cp.uint16), cp.zeros((N, 3 * C), cp.uint16)
lse2, dvec = cp.zeros(B * H * T, cp.float32), cp.zeros(B * H * T, cp.float32)
ds = cp.empty(K.attn_ds_bytes(T, B * H), cp.uint8)
K.k_attn_fwd("bf16", y, lse2, qkv, B, T, C, H)
plain_kernel = K.kernel
NS = [int(x) for x in os.environ.get("S50_NS", "").split()]   # other ring depths to build and time
mods = {ns: loader.build("attention.cu", (f"ATTN_NS={ns}",)) for ns in NS}


def bwd(impl, rows, ns=K.ATTN_NS):
    def run():
        if ns == K.ATTN_NS:
            return K.k_attn_bwd("bf16", dqkv, dy, y, lse2, dvec, qkv, B, T, C, H, False, rows=rows, impl=impl, ds=ds)
        with eg.patched(K, ATTN_NS=ns, kernel=lambda f, n: mods[ns].get_function(n) if "dkvt" in n else plain_kernel(f, n)):
            K.k_attn_bwd("bf16", dqkv, dy, y, lse2, dvec, qkv, B, T, C, H, False, rows=rows, impl=impl, ds=ds)
    return run


arms = {"wgds 128/128": bwd("wgds", (128, 128)), "wgt 128/128": bwd("wgt", (128, 128)),
        "wgt 128/192": bwd("wgt", (128, 192)), "wgt 128/64": bwd("wgt", (128, 64))}
for ns in NS:
    for r in (64, 128, 192):
        arms[f"wgt 128/{r} NS{ns}"] = bwd("wgt", (128, r), ns)
yc, lse = cp.zeros((N, C), cp.uint16), cp.zeros((B * H, T), cp.float32)
with eg.patched(ca, DETERMINISTIC=True):
    att = ca.CudnnAttention(B, T, C, H, room=1 << 40)
scr = cp.empty(max(att.fwd[1], att.bwd[att.chunk][1], 1), cp.uint8)
att.forward(yc, lse, qkv, scr)
arms["cudnn det"] = lambda: att.backward(dqkv, dy, yc, lse, qkv, scr)

if sys.argv[1] == "once":
    for f in arms.values():
        f()
    cp.cuda.Device().synchronize()
    sys.exit(0)

res = {"bytes": {}}
ref = None
for n in [a for a in arms if not a.startswith("cudnn")]:
    dqkv.fill(0)
    ds.fill(0)
    arms[n]()
    got = (cp.asnumpy(dqkv).tobytes(), cp.asnumpy(ds).tobytes())
    if ref is None:
        ref = got
    res["bytes"][n] = {"dqkv": got[0] == ref[0], "ds": got[1] == ref[1]}
    print(f"{n:18s} same dqkv bytes as wgds 128/128: {got[0] == ref[0]}, same dS: {got[1] == ref[1]}", flush=True)
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
    print(f"{n:18s} {res[n]['us']:8.1f} us  rounds {[round(x, 1) for x in res[n]['us_rounds']]}", flush=True)

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
