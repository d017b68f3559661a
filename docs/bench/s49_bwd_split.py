"""Scratch (session 49, docs/bench/s49.md): one attention backward's kernels at 480M B=8 (B 8, T 1024, C 1536,
24 heads), attention.cu's ("wgds" at two row choices, "wg"; "wgdq" too with s49_scratch_wgdq.diff applied)
against cuDNN's deterministic and default backward: sustained us a call (3 alternating rounds,
engine_gpu.sustained_ms) and each kernel's device time (torch.profiler / CUPTI, 20 calls).

    PYTHONPATH=/tmp/cfe:/tmp/deps:. python3 docs/bench/s49_bwd_split.py time OUT.json   # from the repo root, on the GPU
    ncu ... python3 docs/bench/s49_bwd_split.py once                                   # each arm once (for ncu)
"""
import sys

sys.path[:0] = [".", "bench", "docs/bench"]
import cupy as cp  # noqa: E402

from andrea.cuda import kernels as K  # noqa: E402
from arm_times import B, C, H, T, cudnn_arm, inputs, run  # noqa: E402

qkv, dy, y, dqkv, lse2, dvec, ds = inputs()
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
for name, det in (("cudnn det", True), ("cudnn default", False)):
    arms[name] = cudnn_arm(qkv, dy, dqkv, det)

run(arms)
