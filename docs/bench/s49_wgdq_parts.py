"""Scratch (session 49, docs/bench/s49.md): the fused "wgdq" backward's dQ stage taken apart, with
s49_scratch_wgdq.diff applied (its DQX switches): 1 no dQ product, 2 no global dQ traffic (no adds, no stores,
no final dq), 4 no counts (no release, no acquire), 8 plain stores in place of the ordered adds. Builds
attention.cu without the other kernels' instantiations once per DQX value, times k_attn_dvec16 +
k_attn_bwd_dkvq_wg_bf16_d64_r128 at 480M B=8, sustained, 3 alternating rounds.

    PYTHONPATH=. python3 docs/bench/s49_wgdq_parts.py 1 2 4 8 3 7          # from the repo root, on the GPU
"""
import re, sys, statistics
sys.path[:0] = [".", "bench", "docs/bench"]
import cupy as cp, numpy as np
import engine_gpu as eg
from andrea.cuda import kernels as K, loader
from arm_times import B, C, H, N, T, inputs
D = C // H
qkv, dy, y, dqkv, lse2, dvec, _ = inputs()
need = K.attn_dq_bytes(B, T, C, H)
ds = cp.empty(need, cp.uint8)
K.k_attn_bwd("bf16", dqkv, dy, y, lse2, dvec, qkv, B, T, C, H, False, rows=(None, 128), impl="wgdq", ds=ds)
src = loader.read_source("attention.cu")
keep = [l for l in src.split("\n") if not re.match(r"^(ATTN_(SIMT_ALL|TC_ALL|WG_FWD256_INST|WG_FWD8_INST|WGDS_INST))\(", l)]
src = "\n".join(keep)
nsem = need // 4 - N * C
sem = K.ptr(ds, 4 * N * C)
def runner(mod):
    f = mod.get_function("k_attn_bwd_dkvq_wg_bf16_d64_r128")
    z = mod.get_function("k_attn_dvec16_bf16")
    def call():
        z((K.blocks(B * H * T),), (256,), (y, dy, K.i32(C), dvec, K.i32(B), K.i32(T), K.i32(H), K.i32(D), sem, K.i32(nsem)))
        f((8, B * H), (256,), (K.ptr(qkv), K.ptr(qkv, C), K.ptr(qkv, 2 * C), K.i32(3 * C), dy, K.i32(C), lse2, dvec,
              K.ptr(dqkv), K.ptr(dqkv, C), K.ptr(dqkv, 2 * C), K.i32(T), K.i32(H), np.float32(np.log2(np.e) / 8),
              np.float32(1 / 8), K.i32(0), K.ptr(ds), sem))
    return call
arms = {}
for x in [0] + [int(a) for a in sys.argv[1:]]:
    mod = cp.RawModule(code=f"#define DQX {x}\n" + src, options=loader.options("attention.cu", "90") , backend="nvrtc")
    mod.compile()
    arms[f"DQX={x}"] = runner(mod)
    print("built", x, flush=True)
for n, f in arms.items():
    f(); f()
cp.cuda.Device().synchronize()
res = {n: [] for n in arms}
for r in range(3):
    for n in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
        res[n].append(1e3 * eg.sustained_ms(arms[n], 20, 300.0))
for n, v in res.items():
    print(f"{n:8s} {statistics.median(v):7.1f} us (dvec16 included) {[round(a, 1) for a in v]}", flush=True)
