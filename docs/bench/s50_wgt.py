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
import os
import sys

sys.path[:0] = [".", "bench", "docs/bench"]
import cupy as cp  # noqa: E402

import engine_gpu as eg  # noqa: E402
from andrea.cuda import kernels as K, loader  # noqa: E402
from arm_times import B, C, H, T, cudnn_arm, inputs, run  # noqa: E402

qkv, dy, y, dqkv, lse2, dvec, ds = inputs()
plain_kernel = K.kernel
NS = [int(x) for x in os.environ.get("S50_NS", "").split()]   # other ring depths to build and time
mods = {ns: loader.build("attention.cu", (f"ATTN_NS={ns}",)) for ns in NS}


def bwd(impl, rows, ns=K.ATTN_NS):
    def call():
        if ns == K.ATTN_NS:
            return K.k_attn_bwd("bf16", dqkv, dy, y, lse2, dvec, qkv, B, T, C, H, False, rows=rows, impl=impl, ds=ds)
        with eg.patched(K, ATTN_NS=ns, kernel=lambda f, n: mods[ns].get_function(n) if "dkvt" in n else plain_kernel(f, n)):
            K.k_attn_bwd("bf16", dqkv, dy, y, lse2, dvec, qkv, B, T, C, H, False, rows=rows, impl=impl, ds=ds)
    return call


arms = {"wgds 128/128": bwd("wgds", (128, 128)), "wgt 128/128": bwd("wgt", (128, 128)),
        "wgt 128/192": bwd("wgt", (128, 192)), "wgt 128/64": bwd("wgt", (128, 64))}
for ns in NS:
    for r in (64, 128, 192):
        arms[f"wgt 128/{r} NS{ns}"] = bwd("wgt", (128, r), ns)
arms["cudnn det"] = cudnn_arm(qkv, dy, dqkv, True)

if sys.argv[1] == "once":
    run(arms)
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
run(arms, res, 18)
