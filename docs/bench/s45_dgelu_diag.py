"""Scratch driver of session 45 (docs/bench/s45.md): k_mm_dgelu's diagnostic builds at 480M B=8's proj dgrad
(8192 x 6144 x 1536), timed with CUDA events (3 rounds of 100 calls after 200), or launched twice each for ncu.
On an H100/H200 with docs/bench/s45_scratch_mm_dgelu_diag.diff applied (it adds MM_DIAG, MM_XPF and MM_XREG to
mm_dgelu.cu, the kernel's X pointer argument and the three defines to kernels.py):

    PYTHONPATH=. python3 docs/bench/s45_dgelu_diag.py time MM_CLUSTER=2,MM_LDSM=1 MM_CLUSTER=2,MM_LDSM=1,MM_DIAG=4
    ncu -k k_mm_dgelu --metrics gpu__time_duration.sum,sm__cycles_elapsed.max,... --csv \
        python3 docs/bench/s45_dgelu_diag.py once MM_CLUSTER=2,MM_LDSM=1 ...

With ``time``, the builds without MM_DIAG are also checked to give the same bytes as the first one named.
"""
import sys
import cupy as cp
from andrea.cuda import kernels as K
once = sys.argv[1] == "once"
M, N, Kd = 8192, 6144, 1536
rng = cp.random.default_rng(0)
def bf(shape):
    return (rng.standard_normal(shape, dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
a, b, x = bf((M, Kd)), bf((N, Kd)), bf((M, N))
d = cp.zeros((M, N), cp.uint16)
ks = {cfg: K.MmDgelu(tuple(s for s in cfg.split(",") if s)) for cfg in sys.argv[2:]}


def launch_twice() -> None:
    """``once``: each build launched twice (ncu profiles both)."""
    for k in ks.values():
        k(d, a, b, x)
        k(d, a, b, x)
    cp.cuda.Device().synchronize()


def time_and_check() -> None:
    """``time``: 3 rounds of 100 timed calls after 200 a build, then the builds without MM_DIAG held to the
    bytes of the first of them."""
    for r in range(3):
        for cfg, k in ks.items():
            for _ in range(200):
                k(d, a, b, x)
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            for _ in range(100):
                k(d, a, b, x)
            e1.record()
            e1.synchronize()
            print(f"round {r} {cfg:40s} {cp.cuda.get_elapsed_time(e0, e1) / 100 * 1000:8.1f} us", flush=True)
    ref = None
    for cfg, k in ks.items():
        if "MM_DIAG" in cfg:
            continue
        d.fill(0x7FC0)
        k(d, a, b, x)
        out = cp.asnumpy(d)
        if ref is None:
            ref = (cfg, out)
        print(f"bytes {cfg}: {'same as ' + ref[0] if (out == ref[1]).all() else 'DIFFER from ' + ref[0]}", flush=True)


launch_twice() if once else time_and_check()
